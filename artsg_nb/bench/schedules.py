"""Submission schedules compared on a live training run: per-turn hit rates of one batch each.

What it does: `compare_schedules(run, schedules)` plays one batch of held-out seeds per schedule
from a started GRPORun's server under its current adapter (GRPORun.rollouts: nothing is trained
on them), the prefix cache flushed before each so every schedule starts equally cold, and
tabulates each batch's per-turn hit rates (metrics.turn_hit_rates) with its wall time.

What it does not do: start or stop the run (session.py), or the synthetic-workload benchmark
(bench.run), which measures throughput on a server of its own.
"""
from __future__ import annotations

import time
from typing import Sequence

import pandas as pd

from ..serving.metrics import TURN_COLUMNS, turn_hit_rates

HELD_OUT_SEED = 1_000_000
"""First env seed of the batches played here: away from the training seeds' usual range."""


def held_out_seeds(run, n_groups: int | None = None) -> list[int]:
    """`n_groups` (default: the run's groups_per_step) env seeds from HELD_OUT_SEED on."""
    return list(range(HELD_OUT_SEED, HELD_OUT_SEED + (n_groups or run.cfg.groups_per_step)))


async def compare_schedules(run, schedules: Sequence[str] = ("naive", "prefix"),
                            n_groups: int | None = None) -> pd.DataFrame:
    """`turn_hit_rates` of one batch per schedule, same seeds, cache flushed before each;
    with the batch's wall time in `rollout_s`."""
    tables = []
    for schedule in schedules:
        t0 = time.perf_counter()
        groups = await run.rollouts(held_out_seeds(run, n_groups), schedule=schedule)
        rollout_s = time.perf_counter() - t0
        tables.append(turn_hit_rates(groups).assign(schedule=schedule, rollout_s=rollout_s))
    return pd.concat(tables, ignore_index=True)[["schedule", *TURN_COLUMNS, "rollout_s"]]
