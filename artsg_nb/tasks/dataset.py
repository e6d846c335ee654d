"""Dataset tasks in TRL's shape: prompts from a column, rewards from TRL-style reward functions.

What it does: `DatasetSource` serves the rows of a list of dicts or a `datasets.Dataset` as
single-turn episodes (`Task.from_dataset` in tasks.py wraps it in a Task) and scores a finished
group with reward functions of TRL's signature `f(prompts, completions, **kwargs) -> list[float |
None]`, called once per group with the keywords TRL 1.15's `GRPOTrainer._calculate_rewards`
passes: `prompts`, `completions` (text for text prompts, `[{"role": "assistant", "content": ...}]`
for chat prompts), `completion_ids`, every other dataset column as a list, `trainer_state` (an
object with `global_step` and `epoch`), `log_extra` and `log_metric`. Async reward functions are
awaited. The reward is TRL's weighted sum over functions, skipping None/NaN (TRL's nansum); a
sample that no function scores has no reward (None), and rollout.py records that on the
trajectory, which GRPO then leaves out of the advantages (TRL would count it as 0). Each
function's own value goes on the trajectory too (`reward_parts`: the rollouts file, the history's
`rewards/<fn>/mean|std`), and a `success` function's (one of them by name, or another) on
`trajectory.success`, which evaluation's pass@k then reads instead of the weighted sum.

Rows and epochs: the group seed picks the row. `group_seeds(run_seed, step, count)` numbers the
groups of a run 0, 1, 2, ... (encoded with the run seed), and group i plays row
perm_e[i mod n] of epoch e = i // n, perm_e a permutation seeded by (run seed, e): every row once
per epoch, in a new order each epoch, the same order in every run with that seed. Any other seed
still maps to a row deterministically. A train/eval split by rows (`eval_fraction` or
`eval_rows`) is disjoint by construction: `part("eval")` serves only held-out rows.

What it does not do: multi-turn episodes (write an Env for those), tokenise, or render prompts
(rollout.py applies the chat template; a text prompt becomes one user message, where TRL would
feed raw text to a non-chat model).
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import numbers
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .episode import Messages, StepResult
from .task_code import DEFAULT_TIMEOUT_S, TaskCodeError, call_task_code

log = logging.getLogger(__name__)

_SEED_BITS = 32
"""Group seeds are run_seed · 2**32 + group index."""
_NOT_COLUMNS = ("completion", "completion_ids")
"""Keys TRL never passes on as columns (besides the prompt column, passed as `prompts`)."""


class DatasetColumnError(ValueError):
    """The dataset has no column of the given name (the message lists the columns it has)."""


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned the wrong number of rewards (recorded per trajectory)."""


class RewardFunctionCheckError(ValueError):
    """A reward function that cannot work, found when the task is built (`check_reward_funcs`):
    a signature that does not take TRL's keywords, or a dry run that raised or returned no reward."""


DRY_RUN_TEXT = "The answer is 42."
"""The fake completion `check_reward_funcs` scores (its token ids are stand-ins too)."""


@dataclass
class RewardState:
    """The part of TRL's `trainer_state` a reward function can read for reward shaping."""

    global_step: int = 0
    """Optimizer steps completed before the rollouts being scored."""
    epoch: float = 0.0
    """Passes over the rows so far (fractional), at the scored group."""


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _is_chat(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


class DatasetEnv:
    """One row as a single-turn episode; the reward comes later, from the group's scoring."""

    def __init__(self, source: "DatasetSource", row: int, epoch: float = 0.0):
        self.source, self.row, self.epoch = source, row, epoch
        self.reward_parts: dict[str, float | None] = {}
        """Each reward function's raw value for this episode, by name, once scored."""

    def reset(self) -> Messages:
        prompt = self.source.row(self.row)[self.source.prompt]
        system = [{"role": "system", "content": self.source.system_prompt}] if self.source.system_prompt else []
        if self.source.chat:
            return system + [dict(m) for m in prompt]
        return system + [{"role": "user", "content": str(prompt)}]

    def step(self, reply: str) -> StepResult:
        return StepResult(messages=[], reward=None, done=True)


@dataclass(eq=False, repr=False)  # rows can be large: no field-by-field repr or comparison
class DatasetSource:
    """Rows, the prompt column, reward functions and weights; `indices` are the rows served."""

    rows: Any
    prompt: str
    reward_funcs: Sequence[Callable]
    reward_weights: Sequence[float] | None = None
    system_prompt: str | None = None
    splits: dict[str, list[int]] = field(default_factory=dict)
    indices: list[int] = field(default_factory=list)
    state: RewardState = field(default_factory=RewardState)
    logged: dict[str, list] = field(default_factory=dict)
    """What reward functions passed to `log_metric` / `log_extra`, by name."""
    success: Callable | str | None = None
    """What counts as solved for pass@k: the name of one of `reward_funcs`, or a function of the
    same signature scored beside them (unweighted); None: the weighted reward (evaluate.py)."""

    def __post_init__(self):
        columns = self.columns()
        if self.prompt not in columns:
            raise DatasetColumnError(f"the dataset has no column {self.prompt!r}; its columns are: "
                                     f"{', '.join(map(repr, columns)) or '(none)'}. Try: prompt=<one of them>.")
        if len(self) == 0:
            raise ValueError("the dataset has no rows")
        if not self.reward_funcs or not all(callable(f) for f in self.reward_funcs):
            raise ValueError(f"reward_funcs must be a non-empty list of callables (got {self.reward_funcs!r})")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"{len(self.reward_weights)} reward_weights for {len(self.reward_funcs)} reward_funcs")
        self.weights = list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.reward_funcs)
        first = self.row(0)[self.prompt]
        self.chat = _is_chat(first)
        if not self.chat and not isinstance(first, str):
            raise ValueError(f"column {self.prompt!r} holds {type(first).__name__}; it must hold text or chat "
                             "messages (a list of {'role', 'content'} dicts)")
        self._perms: dict[tuple[int, int], list[int]] = {}
        self.success_func = self._success_func()

    def _success_func(self) -> Callable | None:
        """The function `success` names (one of reward_funcs by name, or a callable)."""
        if self.success is None or callable(self.success):
            return self.success
        by_name = {_name(f): f for f in self.reward_funcs}
        if self.success not in by_name:
            raise ValueError(f"success={self.success!r} names no reward function; the reward functions are: "
                             f"{', '.join(map(repr, by_name))}. Try: success=<one of them> or a function.")
        return by_name[self.success]

    # ---- rows ----------------------------------------------------------------------------------
    def columns(self) -> list[str]:
        if hasattr(self.rows, "column_names"):  # datasets.Dataset
            return list(self.rows.column_names)
        keys: dict[str, None] = {}
        for r in self.rows[:1]:
            keys.update(dict.fromkeys(r))
        return list(keys)

    def row(self, i: int) -> dict:
        return dict(self.rows[i])

    def __len__(self) -> int:
        return len(self.indices) if self.indices else len(self.rows)

    def with_split(self, eval_fraction: float, eval_rows: Sequence[int] | None, seed: int) -> "DatasetSource":
        """Hold out `eval_rows` (row numbers) or a seeded `eval_fraction` of the rows; serve the rest."""
        n = len(self.rows)
        if eval_rows is not None:
            held = sorted(set(int(i) for i in eval_rows))
            if any(not 0 <= i < n for i in held):
                raise ValueError(f"eval_rows must be row numbers in 0..{n - 1}")
        else:
            if not 0.0 <= eval_fraction < 1.0:
                raise ValueError(f"eval_fraction must be in [0, 1) (got {eval_fraction})")
            k = min(n - 1, max(1, round(n * eval_fraction))) if eval_fraction > 0 else 0
            held = sorted(random.Random(f"split/{seed}").sample(range(n), k))
        held_set = set(held)
        train = [i for i in range(n) if i not in held_set]
        if not train:
            raise ValueError("the split leaves no training rows")
        self.splits = {"train": train, "eval": held}
        self.indices = train
        return self

    def part(self, name: str) -> "DatasetSource":
        """The same task over one split's rows ("train" or "eval")."""
        if name not in self.splits:
            raise ValueError(f"no split {name!r}; this dataset task has: {', '.join(self.splits) or 'no split'} "
                             "(give Task.from_dataset eval_fraction= or eval_rows=)")
        if not self.splits[name]:
            raise ValueError(f"split {name!r} has no rows (give Task.from_dataset eval_fraction= or eval_rows=)")
        return DatasetSource(self.rows, self.prompt, self.reward_funcs, self.reward_weights, self.system_prompt,
                             splits=self.splits, indices=list(self.splits[name]), success=self.success)

    # ---- seeds → rows --------------------------------------------------------------------------
    def group_seeds(self, run_seed: int, step: int, count: int) -> list[int]:
        """Seeds of step `step`'s `count` groups (steps count from 1): groups numbered run-wide."""
        self.state.global_step = step - 1
        first = (step - 1) * count
        return [(run_seed << _SEED_BITS) + first + j for j in range(count)]

    def row_of_seed(self, seed: int) -> int:
        """The row group `seed` plays (see the module docstring)."""
        run_seed, i = divmod(seed, 1 << _SEED_BITS)
        served = self.indices or list(range(len(self.rows)))
        epoch, pos = divmod(i, len(served))
        perm = self._perms.get((run_seed, epoch))
        if perm is None:
            perm = list(range(len(served)))
            random.Random(f"{run_seed}/{epoch}").shuffle(perm)
            self._perms = {(run_seed, epoch): perm}  # only the current epoch's is kept
        return served[perm[pos]]

    def make_env(self, seed: int) -> DatasetEnv:
        return DatasetEnv(self, self.row_of_seed(seed), epoch=(seed % (1 << _SEED_BITS)) / len(self))

    # ---- rewards -------------------------------------------------------------------------------
    async def score_group(self, envs: Sequence[DatasetEnv], trajectories: Sequence,
                          timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[float | None]:
        """One call of each reward function for the group, each within `timeout_s` (task_code.py);
        the weighted sum per sample (None when no function gave a value). Each function's own value
        goes on the trajectory (`reward_parts`) and the env, the success function's on
        `trajectory.success`. Raises RewardFunctionError naming the function that failed or did not
        return."""
        rows = [self.row(e.row) for e in envs]
        prompts = [r[self.prompt] for r in rows]
        texts = [next((m["content"] for m in reversed(t.messages) if m.get("role") == "assistant"), "")
                 for t in trajectories]
        completions = [[{"role": "assistant", "content": x}] for x in texts] if self.chat else texts
        ids = [[tok for tok, m in zip(t.token_ids, t.completion_mask) if m] for t in trajectories]
        self.state.epoch = envs[0].epoch if envs else self.state.epoch
        kwargs = {k: [r.get(k) for r in rows] for k in rows[0] if k != self.prompt and k not in _NOT_COLUMNS}
        kwargs.update(trainer_state=self.state, log_extra=self._log_extra, log_metric=self._log_metric)
        score = functools.partial(_score_one, prompts=prompts, completions=completions, completion_ids=ids,
                                  timeout_s=timeout_s, **kwargs)
        per_func = [await score(fn) for fn in self.reward_funcs]
        success = None
        if self.success_func is not None:
            known = [i for i, fn in enumerate(self.reward_funcs) if fn is self.success_func]
            success = per_func[known[0]] if known else await score(self.success_func)
        rewards = []
        for j, env in enumerate(envs):
            env.reward_parts = {_name(fn): vals[j] for fn, vals in zip(self.reward_funcs, per_func)}
            if j < len(trajectories):
                trajectories[j].reward_parts = dict(env.reward_parts)
                trajectories[j].success = success[j] if success is not None else None
            parts = [w * vals[j] for w, vals in zip(self.weights, per_func) if vals[j] is not None]
            rewards.append(sum(parts) if parts else None)
        return rewards

    def check_reward_funcs(self, dry_run: bool = True) -> None:
        """Each reward function takes the keywords `score_group` passes (its signature binds them)
        and, with `dry_run`, called on one fake completion (DRY_RUN_TEXT) of the first served row,
        returns one reward (a number or None). Async functions get the signature check only (a dry
        run would need the notebook's event loop). Raises RewardFunctionCheckError naming it."""
        row = self.row(self.indices[0] if self.indices else 0)
        completion = [{"role": "assistant", "content": DRY_RUN_TEXT}] if self.chat else DRY_RUN_TEXT
        kwargs = {k: [row.get(k)] for k in row if k != self.prompt and k not in _NOT_COLUMNS}
        kwargs.update(prompts=[row[self.prompt]], completions=[completion], completion_ids=[[0, 1, 2, 3]],
                      trainer_state=RewardState(), log_extra=lambda *a: None, log_metric=lambda *a: None)
        for fn in [*self.reward_funcs, *([self.success_func] if callable(self.success) else [])]:
            _check_signature(fn, kwargs)
            if dry_run and not (inspect.iscoroutinefunction(fn)
                                or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
                _dry_run(fn, kwargs)

    def _log_metric(self, name: str, value) -> None:
        self.logged.setdefault(name, []).append(value)

    def _log_extra(self, column: str, values) -> None:
        self.logged.setdefault(column, []).extend(list(values))


async def _score_one(fn, *, prompts, timeout_s, **kwargs) -> list[float | None]:
    """One reward function's values for a group (finite floats or None), within `timeout_s`."""
    call = functools.partial(fn, prompts=prompts, **kwargs)
    try:
        out = await call_task_code(call, what=f"reward function {_name(fn)!r}", timeout_s=timeout_s)
    except TaskCodeError as e:
        raise RewardFunctionError(str(e)) from e.__cause__
    try:
        out = list(out)
    except TypeError as e:
        raise RewardFunctionError(f"reward function {_name(fn)!r} returned {type(out).__name__}, not a list "
                                  "of rewards (one float or None per completion)") from e
    if len(out) != len(prompts):
        raise RewardFunctionError(f"reward function {_name(fn)!r} returned {len(out)} rewards for "
                                  f"{len(prompts)} completions (one per completion expected)")
    return [_finite_or_none(r) for r in out]


def _check_signature(fn, kwargs: dict) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: no signature to read; the dry run still calls it
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        columns = [k for k in kwargs if k not in ("prompts", "completions", "completion_ids", "trainer_state",
                                                  "log_extra", "log_metric")]
        raise RewardFunctionCheckError(
            f"reward function {_name(fn)!r} takes {signature} but is called once per group with the keywords "
            f"prompts, completions, completion_ids, {', '.join(columns + [''])}trainer_state, log_extra, log_metric "
            f"(TRL's GRPOTrainer signature): {e}. Try: def {_name(fn)}(prompts, completions, **kwargs) -> "
            "list[float | None], naming the dataset columns it reads as keyword arguments.") from None


def _dry_run(fn, kwargs: dict) -> None:
    what = f"reward function {_name(fn)!r}, called on one fake completion ({DRY_RUN_TEXT!r}) of the first row,"
    try:
        out = fn(**kwargs)
    except Exception as e:
        raise RewardFunctionCheckError(
            f"{what} raised {type(e).__name__}: {e}. A reward function must score any completion (None where it "
            "does not apply), since the model writes anything. Try: call it by hand on that completion.") from e
    if inspect.isawaitable(out):
        getattr(out, "close", lambda: None)()  # an async function behind a plain callable: not run here
        return
    try:
        out = list(out)
    except TypeError:
        raise RewardFunctionCheckError(f"{what} returned {type(out).__name__}; it must return a list with one reward "
                                       "(float or None) per completion.") from None
    bad = [v for v in out if v is not None and not isinstance(v, numbers.Real)]
    if len(out) != 1 or bad:
        raise RewardFunctionCheckError(f"{what} returned {out!r}; it must return a list with one reward (float or "
                                       "None) per completion.")


def _finite_or_none(value) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None
