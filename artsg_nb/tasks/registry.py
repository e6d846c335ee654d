"""Tasks: the public `Task` type, its registry and specs, and example environments.

What it does: `Task` (episodes of an `Env`, episode.py; `Task.from_dataset` for TRL-style
dataset tasks, dataset.py), `register_task`, and `resolve_task` for the three ways to name a
task (a registered name, a Task object, "package.module:ATTR"); `task_spec` records one in
config.json. The example tasks are small enough for the offline tiny model to learn on CPU within
~10 GRPO steps, and a third is for demos:

- `addition`: "What is 3 + 4?" -> "7" (operands 0..9). Single turn; an exact checker that wants
  the bare number (a sentence scores 0), with partial credit for a near miss, so the G samples
  of a group rarely all score the same (identical rewards give zero advantage).
- `price_lookup`: a tool-using agent. A shared system prompt (what prefix caching reuses
  across a group and a step; kept short, ~50 tokens, because behind a 200-token prompt the tiny
  model copied the asked item into its tool call only half the time, which left GRPO no skill to
  sharpen), "How much is a pear?", the model calls the tool ("price pear"), the tool answers
  ("pear costs 6."), the model answers ("6"). At most 3 replies; the reward is paid at the end.
- `guess_number`: find 1..9 from "Higher."/"Lower." answers in up to 4 guesses, behind a long
  system prompt. Kept for multi-turn and prefix-cache demos (4 turns); GRPO does not improve it
  on the tiny model, which never learned "guess the middle of the range" in a CPU budget (it
  learns copying and single-digit sums in a few hundred steps), so `tiny_model` skips it.

`pretraining_corpus(n, seed, mix, noise)` plays the tasks with scripted teachers that make one
systematic mistake with probability `noise` (addition: the sum in a sentence; price_lookup: a
guess without the lookup; guess_number: a random guess), for `tiny_model`'s pretraining. Each
mistake is a decision at a reply's first token that GRPO can unlearn in a few steps.

What it does not do: tokenise, sample, or talk to a server (rollout.py does). Rewards are pure
functions of the reply text and never raise, whatever the text.
"""
from __future__ import annotations

import importlib
import random
import re
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from .dataset import DatasetSource
from .episode import Env, Messages, StepResult  # noqa: F401  (the Env protocol, re-exported)


class UnknownTaskError(ValueError):
    """`get_task` was given a name that is not registered."""


class TaskImportError(UnknownTaskError):
    """A "package.module:ATTR" task spec did not import (the message says which part failed)."""


@dataclass(frozen=True)
class Task:
    """A named family of episodes; `make_env(seed)` is one episode (one GRPO group per seed).

    Define one in any module and train it with `RunConfig(task=my_task)` or
    `python -m artsg_nb.train --task my_module:my_task`; `register_task` adds it to the names
    `get_task` and `--list-tasks` know. `Task.from_dataset` builds one from rows and TRL-style
    reward functions."""

    name: str
    """Registry name, e.g. "addition"."""
    description: str
    """One line for listings."""
    max_turns: int
    """Most model replies in one episode."""
    max_new_tokens: int
    """Generation limit per model reply."""
    factory: Callable[[int], Env] = field(repr=False, compare=False)
    """Builds the episode for a seed; the same seed gives the same opening prompt."""
    teacher: Callable | None = field(default=None, repr=False, compare=False)
    """Scripted policy `teacher(env, rng, noise) -> reply` for the tiny model's pretraining corpus
    (`pretraining_corpus`); None for tasks the tiny model is not pretrained on."""
    group_reward: Callable | None = field(default=None, repr=False, compare=False)
    """`async group_reward(envs, trajectories) -> list[float | None]`: scores a finished group at
    once (the envs' final rewards are then None). None: each env pays its own reward."""
    source: DatasetSource | None = field(default=None, repr=False, compare=False)
    """The rows of a dataset task (`from_dataset`); None for other tasks."""

    def make_env(self, seed: int) -> Env:
        return self.factory(seed)

    def group_seeds(self, run_seed: int, step: int, count: int) -> list[int]:
        """The env seeds of step `step`'s `count` groups (steps count from 1). Dataset tasks walk
        their rows epoch by epoch (dataset.py); others draw seeds from (run_seed, step)."""
        if self.source is not None:
            return self.source.group_seeds(run_seed, step, count)
        rng = random.Random(run_seed * 1_000_003 + step)
        return [rng.randrange(1 << 30) for _ in range(count)]

    @classmethod
    def from_dataset(cls, rows, prompt: str = "prompt", reward_funcs: Sequence[Callable] | Callable = (),
                     reward_weights: Sequence[float] | None = None, system_prompt: str | None = None,
                     max_new_tokens: int = 256, name: str = "dataset", description: str | None = None,
                     eval_fraction: float = 0.0, eval_rows: Sequence[int] | None = None, split_seed: int = 0,
                     dry_run: bool = True, success: Callable | str | None = None) -> "Task":
        """A single-turn task over `rows` (a list of dicts or a `datasets.Dataset`), as TRL's
        GRPOTrainer takes one: `prompt` names the column holding text or chat messages (a list of
        {"role", "content"}), `reward_funcs` are TRL reward functions `f(prompts, completions,
        **columns) -> list[float | None]`, called once per group and summed with `reward_weights`
        (default all 1). `system_prompt` is put before every prompt. `eval_fraction` (a seeded
        share of the rows, by `split_seed`) or `eval_rows` (row numbers) are held out: the task
        trains on the rest, and `task.split("eval")` is the same task over the held-out rows.
        Raises DatasetColumnError (listing the columns) when there is no `prompt` column.

        A single function may be given instead of a list. Each one is checked here, before any
        server starts: its signature must take those keywords, and (`dry_run`, for plain
        functions) it is called once on a fake completion of the first training row and must
        return one reward (a number or None); RewardFunctionCheckError names the one that fails.
        `dry_run=False` skips the call (a function with side effects, or one that is slow).

        `success` says what evaluation's pass@k counts as solved: the name of one of `reward_funcs`
        (e.g. "accuracy") or another function of the same signature (scored beside them, not
        weighted in); a completion passes when its value is >= 1 (evaluate's success_reward).
        Without it pass@k compares the weighted sum, which a correct but long answer can miss
        when a length or format reward is subtracted."""
        funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
        source = DatasetSource(rows, prompt, funcs, reward_weights, system_prompt, success=success)
        source = source.with_split(eval_fraction, eval_rows, split_seed)
        source.check_reward_funcs(dry_run=dry_run)
        names = ", ".join(getattr(f, "__name__", type(f).__name__) for f in source.reward_funcs)
        return cls(name, description or f"dataset: {len(source)} rows of column {prompt!r}, rewards {names}",
                   max_turns=1, max_new_tokens=max_new_tokens, factory=source.make_env,
                   group_reward=source.score_group, source=source)

    def split(self, part: str) -> "Task":
        """This dataset task over the rows of one split: "train" (what it trains on) or "eval"."""
        if self.source is None:
            raise ValueError(f"task {self.name!r} is not a dataset task; only Task.from_dataset tasks have splits")
        source = self.source.part(part)
        return replace(self, name=f"{self.name}[{part}]", factory=source.make_env,
                       group_reward=source.score_group, source=source)


_INT = re.compile(r"\s*(-?[0-9]{1,9})\s*")  # one ASCII integer (\d would take "٣"); 9 digits bound int()


def parse_int_reply(reply: str) -> int | None:
    """The integer a reply consists of (surrounding whitespace allowed), else None."""
    m = _INT.fullmatch(reply) if isinstance(reply, str) else None
    return int(m.group(1)) if m else None


# ---- addition (single turn) --------------------------------------------------------------------
ADDITION_MAX_OPERAND = 9
"""Operands are drawn from 0..ADDITION_MAX_OPERAND."""


def addition_reward(reply: str, answer: int) -> float:
    """1.0 for exactly the right number; 0.5·max(0, 1 - |error|/5) for another bare number
    (so an off-by-one earns 0.4); 0.0 for anything that is not a bare number."""
    guess = parse_int_reply(reply)
    if guess is None:
        return 0.0
    if guess == answer:
        return 1.0
    return 0.5 * max(0.0, 1.0 - abs(guess - answer) / 5)


class AdditionEnv:
    """Asks "What is a + b?"; the answer is the sum as a bare number. One turn."""

    def __init__(self, seed: int):
        rng = random.Random(seed)
        self.a = rng.randint(0, ADDITION_MAX_OPERAND)
        self.b = rng.randint(0, ADDITION_MAX_OPERAND)
        self.answer = self.a + self.b

    def reset(self) -> Messages:
        return [{"role": "user", "content": f"What is {self.a} + {self.b}?"}]

    def step(self, reply: str) -> StepResult:
        return StepResult(messages=[], reward=addition_reward(reply, self.answer), done=True)


def _addition_teacher(env: AdditionEnv, rng: random.Random, noise: float) -> str:
    """The sum as a bare number, or with probability `noise` the sum in a sentence ("The sum is
    7."), which the checker scores 0. The mistake is one decision at the reply's first token,
    shared by every question, so GRPO can fix it within a few steps; near misses (per-question
    decisions) barely moved the tiny model in 20 steps of 8x8."""
    if rng.random() >= noise:
        return str(env.answer)
    return f"The sum is {env.answer}."


# ---- price_lookup (multi-turn agent with a tool) -----------------------------------------------
SHOP_ITEMS = ("apple", "pear", "plum", "fig", "lime", "kiwi", "mango", "lemon")
SHOP_TURNS = 3
_TOOL_CALL = re.compile(r"\s*price\s+(\w+)\s*", re.IGNORECASE)

# No fruit names or digits in the prompt on purpose: for a tiny model they are distractors next to
# the ones in the conversation that it must copy.
SHOP_SYSTEM_PROMPT = """\
You are a shopping agent for a fruit shop. Prices change every day. To look up a price, reply \
with the word price and the fruit's name, nothing else. Then reply with the price in digits only. \
You have three replies at most."""


def shop_reward(answer: int | None, price: int, lookups: list[str], item: str) -> float:
    """1.0 - 0.1·(extra tool calls) for the right price; else 0.2 if `item` was looked up, else 0."""
    if answer == price:
        return round(1.0 - 0.1 * max(0, len(lookups) - 1), 6)
    return 0.2 if item in lookups else 0.0


class PriceLookupEnv:
    """The user asks "How much is a pear?"; the model calls `price pear` (the tool answers "pear costs 6."),
    then answers "6". At most SHOP_TURNS replies; the reward is paid when it answers or runs out."""

    def __init__(self, seed: int):
        rng = random.Random(seed)
        self.item = rng.choice(SHOP_ITEMS)
        self.prices = {name: rng.randint(1, 9) for name in SHOP_ITEMS}
        self.lookups: list[str] = []
        self.replies = 0

    def reset(self) -> Messages:
        self.lookups, self.replies = [], 0
        return [{"role": "system", "content": SHOP_SYSTEM_PROMPT},
                {"role": "user", "content": f"How much is a {self.item}?"}]

    def step(self, reply: str) -> StepResult:
        self.replies += 1
        answer = parse_int_reply(reply)
        if answer is not None or self.replies >= SHOP_TURNS:
            reward = shop_reward(answer, self.prices[self.item], self.lookups, self.item)
            return StepResult(messages=[], reward=reward, done=True)
        return StepResult(messages=[self._respond(reply)], reward=None, done=False)

    def _respond(self, reply: str) -> dict:
        call = _TOOL_CALL.fullmatch(reply) if isinstance(reply, str) else None
        if call is None:
            return {"role": "user", "content": "Reply with a tool call like: price fig, or with the number."}
        name = call.group(1).lower()
        self.lookups.append(name)
        if name not in self.prices:
            return {"role": "tool", "content": f"The shop has no {name}."}
        return {"role": "tool", "content": f"{name} costs {self.prices[name]}."}


def _shop_teacher(env: PriceLookupEnv, rng: random.Random, noise: float) -> str:
    """Looks up the asked item, then answers its price; with probability `noise` it skips the
    lookup and guesses. (Near-miss answers after a lookup, like addition's, blurred the tiny
    model's copying for good; a skipped lookup is one clean decision GRPO can fix.)"""
    if env.item in env.lookups:
        return str(env.prices[env.item])
    return f"price {env.item}" if rng.random() >= noise else str(rng.randint(1, 9))


# ---- guess_number (multi-turn, for caching demos) -----------------------------------------------
GUESS_HI = 9
GUESS_TURNS = 4  # binary search finds any of 1..9 within 4 guesses (2**4 - 1 >= 9)

GUESS_SYSTEM_PROMPT = f"""\
You are an agent playing a number guessing game. The environment has picked a secret whole number \
from 1 to {GUESS_HI}; find it with as few guesses as possible.

Rules:
- Each turn, reply with one guess: a single number and nothing else, for example 5.
- The environment answers "Higher." if the secret number is larger than your guess and "Lower." \
if it is smaller, and tells you the range of numbers that are still possible, for example \
"Higher. It is between 6 and 9." The game ends as soon as you guess the number.
- You have at most {GUESS_TURNS} guesses. A reply that is not a number still uses up a guess.

Scoring: finding the number with your first guess scores 1.0 and each extra guess costs 0.1. If \
you run out of guesses you score at most 0.3, more the closer your last guess was.

Strategy: always guess the middle of the range you were given, rounding down: between 1 and 9 \
guess 5, between 6 and 9 guess 7. This binary search always finds the secret within \
{GUESS_TURNS} guesses."""


def guess_reward(guesses: list[int | None], secret: int, n: int = GUESS_HI) -> float:
    """1.0 - 0.1·(k-1) if guess k found the secret, else 0.3·max(0, 1 - |last - secret|/n)
    (an unparsable last guess scores 0)."""
    for k, g in enumerate(guesses, start=1):
        if g == secret:
            return round(1.0 - 0.1 * (k - 1), 6)
    last = guesses[-1] if guesses else None
    if last is None:
        return 0.0
    return 0.3 * max(0.0, 1.0 - abs(last - secret) / n)


class GuessNumberEnv:
    """Find a secret number in 1..GUESS_HI in GUESS_TURNS guesses. Each answer says "Higher." or
    "Lower." and the range `lo..hi` still consistent with all answers so far."""

    def __init__(self, seed: int):
        self.secret = random.Random(seed).randint(1, GUESS_HI)
        self.guesses: list[int | None] = []
        self.lo, self.hi = 1, GUESS_HI

    def reset(self) -> Messages:
        self.guesses, self.lo, self.hi = [], 1, GUESS_HI
        return [{"role": "system", "content": GUESS_SYSTEM_PROMPT},
                {"role": "user", "content": f"I picked a number between 1 and {GUESS_HI}. Your guess?"}]

    def step(self, reply: str) -> StepResult:
        guess = parse_int_reply(reply)
        self.guesses.append(guess)
        if guess == self.secret or len(self.guesses) >= GUESS_TURNS:
            return StepResult(messages=[], reward=guess_reward(self.guesses, self.secret), done=True)
        return StepResult(messages=[{"role": "user", "content": self._feedback(guess)}], reward=None, done=False)

    def _feedback(self, guess: int | None) -> str:
        if guess is None:
            verdict = "Not a number."
        elif guess < self.secret:
            self.lo, verdict = max(self.lo, guess + 1), "Higher."
        else:
            self.hi, verdict = min(self.hi, guess - 1), "Lower."
        return f"{verdict} It is between {self.lo} and {self.hi}."


def _guess_teacher(env: GuessNumberEnv, rng: random.Random, noise: float) -> str:
    """Binary search; with probability `noise` any number from 1..GUESS_HI instead."""
    if rng.random() >= noise:
        return str((env.lo + env.hi) // 2)
    return str(rng.randint(1, GUESS_HI))


# ---- registry ----------------------------------------------------------------------------------
_BUILTIN = [
    Task("addition", f"single turn: add two numbers from 0..{ADDITION_MAX_OPERAND}, reply with the sum",
         max_turns=1, max_new_tokens=8, factory=AdditionEnv, teacher=_addition_teacher),
    Task("price_lookup", "multi-turn agent: look up an item's price with a tool, then answer it "
         "(long shared system prompt)", max_turns=SHOP_TURNS, max_new_tokens=8, factory=PriceLookupEnv,
         teacher=_shop_teacher),
    Task("guess_number", f"multi-turn game: find a number in 1..{GUESS_HI} from higher/lower answers in "
         f"{GUESS_TURNS} guesses (long shared system prompt; the tiny model is not pretrained on it)",
         max_turns=GUESS_TURNS, max_new_tokens=8, factory=GuessNumberEnv, teacher=_guess_teacher),
]
_TASKS: dict[str, Task] = {t.name: t for t in _BUILTIN}


def register_task(task: Task, replace_existing: bool = False) -> Task:
    """Make `task` known by its name (get_task, `--task NAME`, `--list-tasks`) in this process;
    returns it. "module:ATTR" specs work without registering."""
    if not isinstance(task, Task):
        raise TypeError(f"register_task takes a Task, not {type(task).__name__}")
    if task.name in _TASKS and _TASKS[task.name] is not task and not replace_existing:
        raise ValueError(f"a task named {task.name!r} is already registered; pick another name or pass "
                         "replace_existing=True")
    _TASKS[task.name] = task
    return task


def list_tasks() -> list[Task]:
    return list(_TASKS.values())


def get_task(name: str) -> Task:
    try:
        return _TASKS[name]
    except KeyError:
        raise UnknownTaskError(f"unknown task {name!r}; known tasks: {', '.join(_TASKS)}. A task defined in "
                               "a module is given as \"package.module:ATTR\".") from None


def resolve_task(spec: "str | Task") -> Task:
    """A Task from a registered name, a Task object, or "package.module:ATTR" (the module is
    imported; ATTR may be dotted). Raises UnknownTaskError / TaskImportError saying what failed."""
    if isinstance(spec, Task) or ":" not in str(spec):
        return spec if isinstance(spec, Task) else get_task(spec)
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name + ".").startswith(e.name + "."):
            raise TaskImportError(f"task {spec!r}: module {module_name!r} not found (no {e.name!r} on sys.path). "
                                  "Try: run from the directory that holds it, or add that directory to "
                                  "PYTHONPATH.") from None
        raise TaskImportError(f"task {spec!r}: module {module_name!r} was found but failed to import: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskImportError(f"task {spec!r}: module {module_name!r} imported, but it has no attribute "
                                  f"{attr!r} (missing: {part!r}).") from None
        obj = getattr(obj, part)
    if not isinstance(obj, Task):
        raise TaskImportError(f"task {spec!r}: {attr!r} is a {type(obj).__name__}, not an artsg_nb Task")
    return obj


NOT_IMPORTABLE = "not importable"  # task_spec's note for a Task defined in a notebook or __main__


def task_spec(task: "str | Task") -> tuple[str, str | None]:
    """(spec, note) to record a task in config.json. A string is kept as given. A Task object
    gives "module:ATTR" when a module other than __main__ and this package's holds it at top
    level, else its registered name when it is one of this package's tasks (the built-ins, and
    those its modules register on import, tasks/chat.py's), else its name with the note
    NOT_IMPORTABLE: such a run (a task defined in a notebook, registered there or not) records
    which task it was, but no other process can load it by that spec."""
    if isinstance(task, str):
        return task, None
    main, packaged, holder = sys.modules.get("__main__"), any(t is task for t in _BUILTIN), None
    for mod_name, mod in list(sys.modules.items()):
        # __main__ under any alias (multiprocessing's "__mp_main__") cannot be imported by name
        if mod is None or mod is main or mod_name in ("__main__", "__mp_main__"):
            continue
        for attr, value in list((getattr(mod, "__dict__", None) or {}).items()):
            if value is task and not attr.startswith("_"):
                if mod_name == "artsg_nb" or mod_name.startswith("artsg_nb."):
                    packaged = True
                elif holder is None:
                    holder = f"{mod_name}:{attr}"
    if packaged and _TASKS.get(task.name) is task:  # by name, whatever user module binds it too
        return task.name, None
    return (holder, None) if holder else (task.name, NOT_IMPORTABLE)


def play(env: Env, policy: Callable[[Messages], str], max_turns: int) -> tuple[Messages, float]:
    """Run one episode; `policy(messages)` returns the reply. Returns the transcript and reward."""
    messages = env.reset()
    for _ in range(max_turns):
        reply = policy(messages)
        messages = messages + [{"role": "assistant", "content": reply}]
        result = env.step(reply)
        messages += result.messages
        if result.done:
            return messages, float(result.reward)
    raise AssertionError(f"episode not done after max_turns={max_turns}")


def pretraining_corpus(n: int, seed: int = 0, mix: list[str] | None = None, noise: float = 0.5) -> list[Messages]:
    """`n` transcripts (system/user/assistant/tool messages) played by teachers that make their
    mistake with probability `noise` per reply, taking the tasks named in `mix` in turn
    (default: each of the package's own tasks once; repeat a name to weight it). Only tasks with a
    `teacher` can be played, so a user task never enters the tiny model's build."""
    rng = random.Random(seed)
    tasks = [get_task(name) for name in mix] if mix else [t for t in _BUILTIN if t.teacher is not None]
    if missing := [t.name for t in tasks if t.teacher is None]:
        raise ValueError(f"no scripted teacher (Task.teacher) for {', '.join(missing)}")
    corpus = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        env = task.make_env(rng.randrange(1 << 30))
        messages, _ = play(env, lambda _msgs: task.teacher(env, rng, noise), task.max_turns)
        corpus.append(messages)
    return corpus
