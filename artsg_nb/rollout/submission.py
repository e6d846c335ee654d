"""The order in which one group's turn-1 requests go to the server (`schedule`), and what the
prefix cache can reach of each request by how it went.

The lever on the prefix-cache hit rate. SGLang's radix cache reuses a prompt only once its prefill
has finished: G identical prompts in one prefill batch are all computed (measured on an H200: hit
rate 0.28 instead of (G-1)/G = 0.875).
  "naive"        every request at once (the baseline the others are measured against).
  "prefix"       per group a leader first; the G-1 followers are sent when the leader's first
                 token streams back (its prompt is cached by then). Leaders of all groups go
                 out together, so they share prefill batches.
  "prefix_sync"  as "prefix", but followers of all groups are released together once every
                 leader has its first token: one follower prefill batch, lock-step decoding.
  "prefix_n"     as "prefix", but the followers go as one request with n = G-1.
  "n"            one request with n = G per group (engine-native parallel sampling; SGLang
                 primes the cache with a prefill-only copy first, vLLM shares blocks). Under an
                 adapter on an SGLang with the n > 1 reference bug (sglang#36894, every release
                 so far) the client sends the same work as that warm-up plus one batch of G
                 n = 1 samples, whose references balance (engines/sglang.py).
Only turn 1 is scheduled; later turns extend each episode's own history.

What it does: `first_turns` returns one coroutine per group member for its first Generation,
sent in the schedule's order through the `generate` it is handed (one server request), and
`first_reuse` says per member how much of its prompt the cache can serve (`Reuse`, summed by
serving.metrics.reachable_hit_rate).

What it does not do: play episodes, call the task's code or score groups (groups.py), or talk
HTTP (engines/).
"""
from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Protocol

SCHEDULES = ("naive", "prefix", "prefix_sync", "prefix_n", "n")
"""Turn-1 submission orders accepted by `collect_groups` (see the module docstring)."""


class Generate(Protocol):
    """One server request of a rollout (groups.py's): `n` Generations of `ids`."""

    def __call__(self, ids: list[int], max_new: int, n: int = 1, on_first_token: Callable | None = None,
                 seed: int | None = None) -> Awaitable[list]: ...


@dataclass(frozen=True)
class Reuse:
    """What the prefix cache can serve of one request's prompt, by how it was submitted
    (serving.metrics.reachable_hit_rate sums these): `tokens` (at most the prompt less its last
    token, which engines always recompute for its logits), `submission` (how), and `exact`:
    False where the order the server sees is not ours to know (every request at once), so
    `tokens` is the most the cache could serve, not what it can."""

    tokens: int
    submission: str
    exact: bool = True


def first_reuse(schedule: str, index: int, prompt_len: int, shared_prompt: bool) -> Callable[[Any], Reuse]:
    """How much of a group member's turn-1 prompt the cache can serve, given its Generation:
    the group's prompt is computed by a leader, a warm-up, or the engine's own prefill copy
    before the others read it (`Generation.submission`); copies prefilled together read nothing."""
    whole = max(prompt_len - 1, 0)
    if not shared_prompt:
        return lambda gen: Reuse(0, "own prompt")
    if schedule == "naive":
        return lambda gen: Reuse(whole if index else 0, "unordered", exact=False)
    if schedule == "n":
        def by_engine(gen) -> Reuse:
            how = getattr(gen, "submission", None)
            if how is None:  # an engine that says nothing of how it ran n samples: a bound
                return Reuse(whole if index else 0, "engine n", exact=False)
            return Reuse(whole if how in ("warm-up first", "after first copy") else 0, how)
        return by_engine
    return lambda gen: Reuse(whole, "after leader") if index else Reuse(0, "leader")


class Release:
    """Followers wait on this; it opens after `count` leaders have produced a first token
    (or finished, failed included)."""

    def __init__(self, count: int):
        self.left, self.event = count, asyncio.Event()

    def arrive(self, *_: Any) -> None:
        self.left -= 1
        if self.left <= 0:
            self.event.set()


async def _lead(generate: Generate, ids: list[int], max_new: int, release: Release, seed: int | None) -> Any:
    arrived = False

    def first_token(*_: Any) -> None:
        nonlocal arrived
        if not arrived:
            arrived = True
            release.arrive()

    try:
        [gen] = await generate(ids, max_new, on_first_token=first_token, seed=seed)
        return gen
    finally:
        first_token()  # a leader that fails (or never streamed) still releases its followers


async def _follow(generate: Generate, ids: list[int], max_new: int, release: Release, seed: int | None,
                  n: int = 1) -> list:
    await release.event.wait()
    return await generate(ids, max_new, n=n, seed=seed)


async def _follow_one(generate: Generate, ids: list[int], max_new: int, release: Release, seed: int | None) -> Any:
    [gen] = await _follow(generate, ids, max_new, release, seed)
    return gen


async def _pick(shared: asyncio.Future, i: int) -> Any:
    return (await shared)[i]


async def _single(generate: Generate, ids: list[int], max_new: int, seed: int | None) -> Any:
    [gen] = await generate(ids, max_new, seed=seed)
    return gen


def first_turns(generate: Generate, schedule: str, ids: list[int], max_new: int, seeds: list[int | None],
                release: Release | None) -> tuple[list[Coroutine], list[asyncio.Future]]:
    """(one coroutine of its first Generation per group member, submitted in `schedule`'s order;
    the requests they share, already submitted: an n-sample request's task). `seeds`: each
    member's sampling seed; `release`: the leaders all groups' followers wait for ("prefix_sync"),
    None: this group's leader."""
    size = len(seeds)
    if schedule == "naive" or size == 1:
        return [_single(generate, ids, max_new, seeds[i]) for i in range(size)], []
    if schedule == "n":
        shared = asyncio.ensure_future(generate(ids, max_new, n=size, seed=seeds[0]))
        return [_pick(shared, i) for i in range(size)], [shared]
    release = release or Release(1)  # "prefix"/"prefix_n": this group's leader only
    leader = _lead(generate, ids, max_new, release, seeds[0])
    if schedule == "prefix_n":
        shared = asyncio.ensure_future(_follow(generate, ids, max_new, release, seeds[1], n=size - 1))
        return [leader] + [_pick(shared, i) for i in range(size - 1)], [shared]
    return [leader] + [_follow_one(generate, ids, max_new, release, seeds[i]) for i in range(1, size)], []


def close_unstarted(firsts: list[Coroutine]) -> None:
    """Close the first turns of members cancelled before they started (never awaited: closed, no
    "never awaited" warning); a no-op for those that ran."""
    for first in firsts:
        if inspect.getcoroutinestate(first) == inspect.CORO_CREATED:
            first.close()
