"""Rollouts: G episodes per prompt from an inference server, as token-exact trajectories.

What it does
- `collect_groups` plays one GRPO group of `group_size` episodes per env seed (same seed → same
  opening messages), single- or multi-turn, with at most `concurrency` requests in flight.
- Tokens: turn 1's prompt is the chat template of the opening messages with the generation
  prompt. A model turn's token ids and logprobs are the server's (`Generation.output_ids` /
  `.logprobs`); generated text is never re-tokenised. Between turns the env's messages are
  appended as tokens rendered by the chat template (see `env_suffix_ids`), so
  `token_ids = prompt + (model tokens, env tokens)*` and `completion_mask` is 1 exactly on the
  model's tokens. Each later turn sends the whole history, which the server's prefix cache holds.
- Failures are data: a failed request, an env that raises, or a reward that is None/NaN is
  recorded in `Trajectory.error` (the trainer skips it); the group keeps its valid members. The
  error names where it came from: "EnvError: env.step of task 'x' raised ...", "TokenizerError:
  ...", "TaskCodeTimeout: ..." or the engine's error. The task's code (make_env, reset, step,
  group_reward, reward functions) runs under `task_timeout_s` (tasks/task_code.py).
- Length budget: a trajectory never exceeds `max_seq_tokens`; a request's `max_new_tokens` is
  clamped to the room left, and an episode that runs out of room is cut (`truncated=True`).
- Submission order (`schedule`, one of `SCHEDULES`), the lever on the prefix-cache hit rate: how
  each group's turn-1 requests go out (rollout/submission.py says how each schedule sends them and
  what the cache can reach of each). Only turn 1 is scheduled; later turns extend each episode's
  own history.
- Seeds: with `sampling_seed_base`, member i of a group at model turn t is sampled with the seed
  `request_seed(base, group seed, t) + i` (an n-sample request for members i..i+n-1 sends the
  seed of member i: engines seed sample j with seed + j), so a redone or resumed step draws the
  same samples under every schedule.

What it does not do: decide the order of a group's turn-1 requests (submission.py), talk HTTP
(engines/), compute advantages (grpo.py), build tensors (trainer.py). Env methods are called in the event loop, so they should be quick, or `async def`
(awaited: a tool call that hits an API). A task with `group_reward` (dataset tasks) is scored
once per group after its episodes end; a reward it cannot give is `Trajectory.reward_error`.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import math
import random
import functools
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Coroutine, Sequence

from tqdm.auto import tqdm

from .chat_tokens import TokenizerError, env_suffix_ids, render_ids
from .submission import SCHEDULES, Release, Reuse, close_unstarted, first_reuse, first_turns
from ..tasks.task_code import DEFAULT_TIMEOUT_S, EnvError, await_task_code, call_task_code
from .trajectory import RolloutError, Trajectory, TrajectoryGroup, rollout_stats

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- episodes

@dataclass
class _Ctx:
    """What every request of one `collect_groups` call shares."""

    client: Any
    tokenizer: Any
    params: Any
    adapter: str | None
    sem: asyncio.Semaphore
    max_seq_tokens: int
    truncation_reward: float | None
    max_turns: int
    fallbacks: int = 0
    seed_base: int | None = None
    group_scored: bool = False
    task_name: str = "?"
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    """Limit of each call of the task's own code (tasks/task_code.py)."""

    async def open_envs(self, task, seed: int, size: int) -> tuple[list, list]:
        """The group's envs and their opening messages: make_env and reset of all `size` members in
        one call of the task's code (one hand-off to its thread, not 2G), an async reset awaited
        after it; each under the time limit, a failure an EnvError naming make_env or env.reset."""
        envs, openings = await self.env_call("make_env and env.reset", _open_envs, task, seed, size, self.task_name)
        for i, opening in enumerate(openings):
            if inspect.isawaitable(opening):
                openings[i] = await await_task_code(opening, what=f"env.reset of task {self.task_name!r}",
                                                    timeout_s=self.timeout_s, error=EnvError)
        return envs, openings

    async def env_call(self, role: str, method, *args):
        """`method` ("env.step", "env.reset", "make_env" in `role`) under the time limit; its
        failure is an EnvError naming it and the task."""
        return await call_task_code(method, *args, what=f"{role} of task {self.task_name!r}",
                                    timeout_s=self.timeout_s, error=EnvError)

    def seed(self, group_seed: int, turn: int, index: int) -> int | None:
        """Sampling seed of group member `index` at model turn `turn`; None when unseeded."""
        return None if self.seed_base is None else request_seed(self.seed_base, group_seed, turn) + index


def _open_envs(task, seed: int, size: int, task_name: str) -> tuple[list, list]:
    """`size` envs of `seed` and what their reset returned (an awaitable for an async reset)."""
    try:
        envs = [task.make_env(seed) for _ in range(size)]
    except Exception as e:
        raise EnvError(f"make_env of task {task_name!r} raised {type(e).__name__}: {e}") from e
    try:
        return envs, [env.reset() for env in envs]
    except Exception as e:
        raise EnvError(f"env.reset of task {task_name!r} raised {type(e).__name__}: {e}") from e


def request_seed(base: int, group_seed: int, turn: int) -> int:
    """Seed of member 0 of a group at one turn; member i uses this + i. Below 2**31 - 2**16, so
    it stays a valid 32-bit seed for any group size an engine accepts."""
    return random.Random(f"{base}/{group_seed}/{turn}").randrange((1 << 31) - (1 << 16))


async def _generate(ctx: _Ctx, ids: list[int], max_new: int, n: int = 1,
                    on_first_token: Callable | None = None, seed: int | None = None) -> list:
    """One server request → `n` Generations. At most `concurrency` of these run at once."""
    seeded = {"seed": seed} if hasattr(ctx.params, "seed") else {}  # per request, never the caller's
    params = replace(ctx.params, max_new_tokens=max_new, n=n, **seeded)
    kwargs = {"on_first_token": on_first_token} if on_first_token is not None else {}
    async with ctx.sem:
        gens = await ctx.client.generate(ids, params, adapter=ctx.adapter, **kwargs)
    if len(gens) != n:
        raise RolloutError(f"asked the server for n={n} samples, got {len(gens)}")
    return gens


def _room(ctx: _Ctx, n_tokens: int) -> int:
    return min(ctx.params.max_new_tokens, ctx.max_seq_tokens - n_tokens)


def _finite_reward(reward) -> float:
    if reward is None:
        raise RolloutError("the env finished the episode without a reward (None)")
    value = float(reward)
    if not math.isfinite(value):
        raise RolloutError(f"the env returned a non-finite reward ({value})")
    return value


def _append_model_turn(ctx: _Ctx, traj: Trajectory, gen, max_new: int, reuse: Reuse) -> None:
    traj.token_ids += gen.output_ids
    traj.completion_mask += [1] * len(gen.output_ids)
    traj.logprobs += list(gen.logprobs)
    traj.messages.append({"role": "assistant", "content": gen.text})
    traj.prompt_tokens += gen.prompt_tokens
    traj.cached_tokens += gen.cached_tokens
    traj.turn_stats.append({"prompt_tokens": gen.prompt_tokens, "cached_tokens": gen.cached_tokens,
                            "reusable_tokens": min(reuse.tokens, max(gen.prompt_tokens - 1, 0)),
                            "submission": reuse.submission, "exact": reuse.exact})
    traj.finish_reasons.append(gen.finish_reason)
    traj.turns += 1
    if gen.finish_reason == "length" and max_new < ctx.params.max_new_tokens:
        traj.truncated = True  # the budget, not max_new_tokens, cut this reply


def _append_env_turn(ctx: _Ctx, traj: Trajectory, new_messages: list[dict], reply_ids: list[int]) -> None:
    try:
        ids, fallback = env_suffix_ids(ctx.tokenizer, traj.token_ids, traj.messages, new_messages, reply_ids)
    except RolloutError:
        raise
    except Exception as e:
        raise TokenizerError(f"the tokenizer failed on the env's messages of task {ctx.task_name!r} after turn "
                             f"{traj.turns}: {type(e).__name__}: {e}") from e
    ctx.fallbacks += fallback
    traj.token_ids += ids
    traj.completion_mask += [0] * len(ids)
    traj.logprobs += [0.0] * len(ids)
    traj.messages += new_messages


def _cut(ctx: _Ctx, traj: Trajectory) -> None:
    """End an episode that has no room for another turn (the env gave no final reward)."""
    n = ctx.max_seq_tokens
    traj.token_ids, traj.completion_mask, traj.logprobs = (
        traj.token_ids[:n], traj.completion_mask[:n], traj.logprobs[:n])
    traj.truncated = True
    if ctx.truncation_reward is None:
        traj.error = f"RolloutError: episode cut at max_seq_tokens={n} before the env finished"
    traj.reward = ctx.truncation_reward


async def _play(ctx: _Ctx, env, traj: Trajectory, first: Awaitable, first_max_new: int,
                index: int, first_reuse: Callable[[Any], Reuse]) -> Trajectory:
    """Play one episode from its (scheduled) first generation; errors end up in `traj.error`."""
    try:
        gen, max_new = await first, first_max_new
        reuse = first_reuse(gen)
        while True:
            _append_model_turn(ctx, traj, gen, max_new, reuse)
            # The server caches this turn's prompt and reply (all but the last sampled token,
            # whose KV it never computed): the next turn's prompt can reuse them.
            reuse = Reuse(len(traj.token_ids) - 1, "own history")
            result = await ctx.env_call("env.step", env.step, gen.text)
            if result.done:
                if not ctx.group_scored:  # else _score_group pays the reward once the group is done
                    traj.reward = _finite_reward(result.reward)
                return traj
            if traj.turns >= ctx.max_turns:
                raise RolloutError(f"the env was not done after max_turns={ctx.max_turns} turns")
            _append_env_turn(ctx, traj, result.messages, gen.output_ids)
            max_new = _room(ctx, len(traj.token_ids))
            if max_new < 1:
                _cut(ctx, traj)
                return traj
            [gen] = await _generate(ctx, traj.token_ids, max_new, seed=ctx.seed(traj.seed, traj.turns, index))
    except Exception as exc:  # a failed rollout is data, not a crash (see module docstring)
        traj.error = f"{type(exc).__name__}: {exc}"
        log.debug("rollout seed=%d failed", traj.seed, exc_info=True)
        return traj


async def _group(ctx: _Ctx, task, seed: int, size: int, schedule: str,
                 release: Release | None, done: Callable[[], None]) -> TrajectoryGroup:
    envs, openings = [], []
    try:
        envs, openings = await ctx.open_envs(task, seed, size)
        prompts = _render_prompts(ctx, openings)
    except Exception as exc:
        if release is not None:
            release.arrive()
        error = f"{type(exc).__name__}: {exc}"
        return TrajectoryGroup(seed, [_failed(ctx, seed, error) for _ in range(size)])
    max_new = _room(ctx, len(prompts[0]))
    if any(p != prompts[0] for p in prompts) or max_new < 1:
        if release is not None:
            release.arrive()  # this group has no leader to wait for
        schedule = "naive"  # members differ: nothing to share
    trajs = [Trajectory(messages=list(m), token_ids=list(p), completion_mask=[0] * len(p),
                        logprobs=[0.0] * len(p), prompt_len=len(p), adapter=ctx.adapter, seed=seed)
             for m, p in zip(openings, prompts)]
    if max_new < 1:
        for t in trajs:
            t.error = (f"RolloutError: the prompt has {len(t.token_ids)} tokens, no room under "
                       f"max_seq_tokens={ctx.max_seq_tokens}")
        return TrajectoryGroup(seed, trajs)
    seeds = [ctx.seed(seed, 0, i) for i in range(size)]  # member i's, whatever the schedule
    firsts, shared = first_turns(functools.partial(_generate, ctx), schedule, prompts[0], max_new, seeds, release)

    async def play(env, traj, first, index):
        reuse = first_reuse(schedule, index, len(prompts[index]), prompts[index] == prompts[0] and size > 1)
        out = await _play(ctx, env, traj, first, max_new, index, reuse)
        done()
        return out

    try:  # a shared request nobody awaits any more (no member started) is cancelled with them
        trajs = await _gather_all(list(map(play, envs, trajs, firsts, range(size))), also=shared)
    finally:  # every member and shared request has ended here, a cancelled one too
        close_unstarted(firsts)
    if ctx.group_scored:
        await _score_group(ctx, task, envs, trajs)
    return TrajectoryGroup(seed, trajs)


async def _gather_all(coros: list[Coroutine], also: Sequence[asyncio.Future] = ()) -> list:
    """asyncio.gather's results, but once one is cancelled (or fails) the others, and the tasks
    `also` (requests they share), are cancelled and waited for before this returns or raises:
    gather alone raises at the first cancelled one, leaving the others' requests closing after the
    rollout has ended. A second cancel of the caller while it waits means "stop waiting": their
    cleanup is then cut short."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        pending = [t for t in (*tasks, *also) if not t.done()]
        for task in pending:
            if not task.cancelling():  # a second cancel would cut its cleanup short
                task.cancel()
        if pending:
            await asyncio.wait(pending)


async def _score_group(ctx: _Ctx, task, envs: list, trajs: list[Trajectory]) -> None:
    """Pay the rewards of a group-scored task: one `task.group_reward` call over the members that
    finished; a failure, or a None/NaN reward, goes to `reward_error` (never raised). A dataset
    task times each reward function itself (naming it); another group_reward is timed whole."""
    done = [i for i, t in enumerate(trajs) if t.error is None and t.reward is None]
    if not done:
        return
    members = ([envs[i] for i in done], [trajs[i] for i in done])
    try:
        if getattr(task, "source", None) is not None:
            rewards = await task.source.score_group(*members, timeout_s=ctx.timeout_s)
        else:
            rewards = await call_task_code(task.group_reward, *members, timeout_s=ctx.timeout_s,
                                           what=f"group_reward of task {ctx.task_name!r}")
        rewards = list(rewards)
        if len(rewards) != len(done):
            raise RolloutError(f"group_reward returned {len(rewards)} rewards for {len(done)} episodes")
    except Exception as exc:
        log.debug("group reward of seed=%d failed", trajs[0].seed, exc_info=True)
        for i in done:
            trajs[i].reward_error = f"{type(exc).__name__}: {exc}"
        return
    for i, r in zip(done, rewards):
        value = None if r is None else float(r)
        if value is None or not math.isfinite(value):
            trajs[i].reward_error = "no reward: every reward function returned None or NaN for this completion"
        else:
            trajs[i].reward = value


def _render_prompts(ctx: _Ctx, openings: list[list[dict]]) -> list[list[int]]:
    """Turn-1 prompt ids per member, rendered once when the openings agree (the usual case:
    tokenising a long prompt G times would delay the group's requests measurably). A failure is a
    TokenizerError naming the task (PromptTextError for text no tokenizer takes)."""
    try:
        first = render_ids(ctx.tokenizer, openings[0], add_generation_prompt=True)
        return [first if m == openings[0] else render_ids(ctx.tokenizer, m, add_generation_prompt=True)
                for m in openings]
    except TokenizerError:
        raise
    except Exception as e:
        raise TokenizerError(f"the tokenizer's chat template failed on the opening messages of task "
                             f"{ctx.task_name!r}: {type(e).__name__}: {e}") from e


def _failed(ctx: _Ctx, seed: int, error: str) -> Trajectory:
    return Trajectory(messages=[], token_ids=[], completion_mask=[], logprobs=[], error=error,
                      adapter=ctx.adapter, seed=seed)


async def collect_groups(client, task, tokenizer, seeds: Sequence[int], group_size: int, params,
                         adapter: str | None = None, concurrency: int = 64, schedule: str = "prefix",
                         max_seq_tokens: int = 4096, truncation_reward: float | None = 0.0,
                         progress: bool = False, sampling_seed_base: int | None = None,
                         task_timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[TrajectoryGroup]:
    """Play `group_size` episodes of `task` per seed; one TrajectoryGroup per seed, in order.

    `params` (client.SamplingParams) applies to every model turn; its `n` is ignored (the
    schedule decides). `concurrency` bounds HTTP requests in flight (an n-sample request counts
    once). `truncation_reward` is the reward of an episode cut by `max_seq_tokens` before the
    env finished (None: record it as failed instead). `sampling_seed_base` seeds every request
    from (base, group seed, turn, member) — see the module docstring; `params.seed` is ignored
    (like `n`), since one seed for every request would make the G samples identical.
    `task_timeout_s` limits each call of the task's own code (RunConfig.reward_timeout_s; 0 or
    None: no limit). Never raises for a failed rollout; refuses a group_size below 1 at once.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if group_size < 1 or concurrency < 1:
        raise ValueError(f"group_size and concurrency must be >= 1 (got {group_size}, {concurrency})")
    ctx = _Ctx(client, tokenizer, params, adapter, asyncio.Semaphore(concurrency), max_seq_tokens,
               truncation_reward, max(1, int(getattr(task, "max_turns", 1) or 1)), seed_base=sampling_seed_base,
               group_scored=getattr(task, "group_reward", None) is not None,
               task_name=str(getattr(task, "name", type(task).__name__)), timeout_s=task_timeout_s)
    release = Release(len(seeds)) if schedule == "prefix_sync" and group_size > 1 else None
    with tqdm(total=len(seeds) * group_size, desc="rollouts", disable=not progress) as bar:
        groups = await _gather_all([_group(ctx, task, seed, group_size, schedule, release, lambda: bar.update(1))
                                    for seed in seeds])
    _log_summary(list(groups), ctx)
    return list(groups)


def _log_summary(groups: list[TrajectoryGroup], ctx: _Ctx) -> None:
    stats = rollout_stats(groups)
    if stats["reward_errors"]:
        first = next(t.reward_error for g in groups for t in g.trajectories if t.reward_error)
        log.warning("%d of %d rollouts have no reward (first: %s)", stats["reward_errors"], stats["trajectories"], first)
    if stats["failed"]:
        first = next(t.error for g in groups for t in g.trajectories if t.error)
        log.warning("%d of %d rollouts failed (first: %s)", stats["failed"], stats["trajectories"], first)
    if ctx.fallbacks:
        log.debug("%d env turns used the text fallback of env_suffix_ids", ctx.fallbacks)
