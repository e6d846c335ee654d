"""The raw-engine baseline: a toolkit run's token payloads replayed with plain httpx.

What it does: `raw_plans(groups)` takes from each valid trajectory its turn-1 prompt and the env
tokens between its replies; `replay_raw` sends them to the server with plain httpx and minimal
parsing (no toolkit client, no chat template, no rollout bookkeeping) under the same submission
schedule (RAW_SCHEDULES), keeping each sample's tokens, cached tokens, TTFT and latency. The
toolkit's throughput is reported as a fraction of it (`raw_fraction`).

What it does not do: the toolkit-side measurement (bench.run) or build tables (bench.results).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Sequence

import httpx

from .. import engines
from ..rollout.trajectory import TrajectoryGroup

RAW_SCHEDULES = ("naive", "prefix", "n")
"""Schedules the raw baseline implements (the others are toolkit-only variants)."""


@dataclass
class RawSample:
    """What the raw baseline keeps of one sample."""

    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    e2e_s: float
    ttft_s: float | None


@dataclass
class RawPlan:
    """One trajectory's payloads: the turn-1 prompt and the env tokens after each reply."""

    prompt: list[int]
    env_segments: list[list[int]]


def raw_plans(groups: Sequence[TrajectoryGroup]) -> list[list[RawPlan]]:
    """Per group, per valid trajectory: its turn-1 prompt and the env tokens between replies."""
    plans = []
    for group in groups:
        members = []
        for t in group.trajectories:
            if t.error is not None or not t.completion_mask:
                continue
            segments = t.model_segments()
            envs = [t.token_ids[end:segments[k + 1][0]] for k, (_, end) in enumerate(segments[:-1])]
            members.append(RawPlan(t.token_ids[:segments[0][0]], envs))
        if members:
            plans.append(members)
    return plans


class RawEngine:
    """Plain httpx posts of the payloads the toolkit client sends (each engine's RawDialect, in
    engines/); no parsing beyond ids and counts."""

    def __init__(self, engine: str, base_url: str, model: str, params, stream: bool, headers: dict | None = None):
        self.dialect, self.model, self.params, self.stream = engines.get(engine).raw, model, params, stream
        self.http = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), headers=headers or {},
                                      limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))
        self.samples: list[RawSample] = []

    async def generate(self, ids: list[int], n: int = 1, on_first=None) -> list[RawSample]:
        path, body = self.dialect.payload(ids, n, self.params, self.model)
        t0 = time.perf_counter()
        if self.stream or on_first is not None:
            answer, ttft = await self._streamed(path, body, on_first, t0)
        else:
            resp = await self.http.post(path, json=body)
            resp.raise_for_status()
            answer, ttft = resp.json(), None
        e2e_s = time.perf_counter() - t0
        samples = [RawSample(out, prompt, cached, e2e_s, ttft) for out, prompt, cached in self.dialect.samples(answer, len(ids))]
        self.samples += samples
        return samples

    async def _streamed(self, path: str, body: dict, on_first, t0: float):
        body = {**body, **self.dialect.stream_fields, "stream": True}
        chunks, ttft = [], None
        async with self.http.stream("POST", path, json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                chunks.append(json.loads(line[5:]))
                if ttft is None:
                    ttft = time.perf_counter() - t0
                    if on_first is not None:
                        on_first()
        return self.dialect.merge_chunks(chunks), ttft

    async def aclose(self) -> None:
        await self.http.aclose()


async def _raw_episode(raw: RawEngine, plan: RawPlan, first: RawSample) -> None:
    ids, sample = list(plan.prompt), first
    for env in plan.env_segments:
        ids = ids + sample.output_ids + env
        [sample] = await raw.generate(ids)


async def _raw_group(raw: RawEngine, members: list[RawPlan], schedule: str) -> None:
    """Turn 1 in `schedule`'s order (as rollout.py), then each member's later turns."""
    prompt = members[0].prompt
    if schedule == "n":
        firsts = await raw.generate(prompt, n=len(members))
        await asyncio.gather(*(_raw_episode(raw, p, s) for p, s in zip(members, firsts)))
        return
    released = asyncio.Event()

    async def play(i: int, plan: RawPlan) -> None:
        if schedule == "prefix" and i > 0:
            await released.wait()
        lead = schedule == "prefix" and i == 0  # only a leader streams (as in rollout.py)
        try:
            [first] = await raw.generate(prompt, on_first=released.set if lead else None)
        finally:
            released.set()
        await _raw_episode(raw, plan, first)

    await asyncio.gather(*(play(i, p) for i, p in enumerate(members)))


async def replay_raw(engine: str, base_url: str, model: str, plans: list[list[RawPlan]], params,
                     schedule: str, stream: bool, headers: dict | None = None) -> tuple[float, list[RawSample]]:
    """Send `plans` under `schedule` with plain httpx (`headers`: the server's Authorization);
    (wall seconds, samples)."""
    if schedule not in RAW_SCHEDULES:
        raise ValueError(f"the raw baseline implements {RAW_SCHEDULES}, not {schedule!r}")
    raw = RawEngine(engine, base_url, model, params, stream, headers)
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(_raw_group(raw, members, schedule) for members in plans))
        return time.perf_counter() - t0, raw.samples
    finally:
        await raw.aclose()
