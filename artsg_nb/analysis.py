"""Tables and charts the notebooks show that no other module owns: per-turn prefix-cache hit
rates of a rollout batch, schedule comparisons on a live run, and benchmark result files.

What it does
- `turn_hit_rates(groups)`: one row per model turn (1, 2, ...) with the prompt tokens the server
  processed, how many it served from the prefix cache, the hit rate, and the theoretical
  maximum (see `_turn_theory`). Turn 1 reuses the prompt the episodes share (the guess_number
  system prompt); a later turn reuses its own episode's history up to the end of the last reply.
- `collect_batch(run, schedule)` / `compare_schedules(run, schedules)`: rollouts from a started
  `GRPORun`'s server under its current adapter, outside training (nothing is trained on them),
  with the prefix cache flushed first so schedules start equally cold.
- `engine_availability`, `bench_engines`: which engines this machine can benchmark, and the
  benchmark (bench.run_bench) on each of them.
- `load_results(dir)`, `latest_results(df)`, `result_sources(df)`, `results_table(df)`: committed
  benchmark CSVs (bench.COLUMNS; `gpu` is accepted for `hardware`) with the file each row came
  from and a `workload` label per shape (`label_workloads`), the newest file per engine and
  workload, where each file comes from, and the toolkit rows averaged over repeats.
- `plot_turn_hit_rates(table)`: the per-turn table as bars, one colour per schedule.

What it does not do: play episodes itself (rollout.py), run servers (server.py, bench.py), or
draw training curves (plots.py).
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .bench_workloads import model_segments
from .plots import new_figure

TURN_COLUMNS = ["turn", "episodes", "prompt_tokens", "cached_tokens", "computed_tokens", "hit_rate",
                "theoretical"]
"""Columns of `turn_hit_rates` (plus "schedule" and "rollout_s" from `compare_schedules`)."""
SHAPE_COLUMNS = ["groups", "group_size", "prompt_tokens", "new_tokens", "turns", "stream_all"]
"""Benchmark columns that make two rows comparable (besides engine, schedule and radix)."""
SCHEDULE_COLORS = {"naive": "tab:orange", "prefix": "tab:blue", "prefix_sync": "tab:cyan",
                   "prefix_n": "tab:green", "n": "tab:purple"}


# ---------------------------------------------------------------------------- per-turn hit rates

def turn_hit_rates(groups) -> pd.DataFrame:
    """Prompt / cached tokens per model turn, summed over every episode that played that turn."""
    rows: dict[int, dict] = {}
    for traj in (t for g in groups for t in g.trajectories):
        for turn, stats in enumerate(traj.turn_stats, start=1):
            row = rows.setdefault(turn, {"turn": turn, "episodes": 0, "prompt_tokens": 0, "cached_tokens": 0})
            row["episodes"] += 1
            row["prompt_tokens"] += stats["prompt_tokens"]
            row["cached_tokens"] += stats["cached_tokens"]
    table = pd.DataFrame(sorted(rows.values(), key=lambda r: r["turn"]),
                         columns=["turn", "episodes", "prompt_tokens", "cached_tokens"])
    table["computed_tokens"] = table["prompt_tokens"] - table["cached_tokens"]
    table["hit_rate"] = table["cached_tokens"] / table["prompt_tokens"].where(table["prompt_tokens"] > 0)
    theory = _turn_theory(groups)
    table["theoretical"] = [theory.get(turn, np.nan) for turn in table["turn"]]
    return table[TURN_COLUMNS]


def _turn_theory(groups) -> dict[int, float]:
    """Hit rate per turn if the cache reused everything reusable in this batch: at turn 1 every
    copy of an opening prompt but the first (across groups too: identical prompts share), at
    turn k > 1 the episode's history up to the end of reply k-1. An upper bound up to one token
    per request (engines recompute the last prompt token to get its logits)."""
    prompt: dict[int, int] = {}
    cacheable: dict[int, int] = {}
    seen: set[tuple[int, ...]] = set()
    for traj in (t for g in groups for t in g.trajectories if t.error is None):
        segments = model_segments(traj)
        for turn, (start, _) in enumerate(segments, start=1):
            if turn == 1:
                opening = tuple(traj.token_ids[:start])
                reused = start if opening in seen else 0
                seen.add(opening)
            else:
                reused = segments[turn - 2][1]
            prompt[turn] = prompt.get(turn, 0) + start
            cacheable[turn] = cacheable.get(turn, 0) + reused
    return {turn: cacheable[turn] / prompt[turn] for turn in prompt if prompt[turn]}


def plot_turn_hit_rates(table: pd.DataFrame, ax: Axes | None = None) -> Figure:
    """Hit rate per turn as bars (grouped by `schedule` when the table has one), the theoretical
    maximum as a dashed tick over each bar."""
    if ax is None:
        fig = new_figure((8, 3.6))
        ax = fig.subplots()
        fig.subplots_adjust(left=0.09, right=0.8, bottom=0.14, top=0.9)
    table = table if "schedule" in table else table.assign(schedule="")
    schedules = list(dict.fromkeys(table["schedule"]))
    width = 0.8 / max(len(schedules), 1)
    for i, schedule in enumerate(schedules):
        rows = table[table["schedule"] == schedule]
        x = rows["turn"].to_numpy(dtype=float) - 0.4 + width * (i + 0.5)
        bars = ax.bar(x, rows["hit_rate"].fillna(0), width, label=schedule or None,
                      color=SCHEDULE_COLORS.get(schedule, "tab:blue"))
        ax.bar_label(bars, fmt="%.2f", fontsize="x-small", padding=2)
        ax.hlines(rows["theoretical"], x - width / 2, x + width / 2, colors="black", linestyles="--")
    ax.plot([], [], color="black", linestyle="--", label="theoretical")
    ax.set_xticks(sorted(table["turn"].unique()))
    ax.set(xlabel="turn", ylabel="hit rate", ylim=(0, 1.12), title="prefix-cache hit rate per turn")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return ax.figure


# ---------------------------------------------------------------------------- rollouts on a live run

async def collect_batch(run, schedule: str = "prefix", n_groups: int | None = None,
                        first_seed: int = 1_000_000, flush: bool = True) -> list:
    """One batch of groups from `run`'s server under its current adapter (not trained on).

    `n_groups` defaults to the run's groups_per_step; seeds start at `first_seed` (away from the
    training seeds). With `flush`, the prefix cache is emptied first, so that what is cached was
    cached by this batch.
    """
    from .client import SamplingParams
    from .rollout import collect_groups

    cfg = run.cfg
    if flush:
        await run.client.flush_cache(timeout_s=30)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens or run.task.max_new_tokens,
                            temperature=cfg.temperature)
    seeds = range(first_seed, first_seed + (n_groups or cfg.groups_per_step))
    return await collect_groups(run.client, run.task, run.trainer.tokenizer, list(seeds), cfg.group_size,
                                params, adapter=run.adapter, concurrency=cfg.concurrency, schedule=schedule,
                                max_seq_tokens=cfg.max_seq_tokens)


async def compare_schedules(run, schedules: Sequence[str] = ("naive", "prefix"),
                            n_groups: int | None = None) -> pd.DataFrame:
    """`turn_hit_rates` of one batch per schedule, same seeds, cache flushed before each;
    with the batch's wall time in `rollout_s`."""
    tables = []
    for schedule in schedules:
        t0 = time.perf_counter()
        groups = await collect_batch(run, schedule, n_groups)
        rollout_s = time.perf_counter() - t0
        tables.append(turn_hit_rates(groups).assign(schedule=schedule, rollout_s=rollout_s))
    return pd.concat(tables, ignore_index=True)[["schedule", *TURN_COLUMNS, "rollout_s"]]


# ---------------------------------------------------------------------------- benchmarks

def engine_availability(plan) -> pd.DataFrame:
    """Which engines can run here: the CPU engine without a GPU; SGLang and vLLM with one, when
    their server environment is found (envs.find_server_env). One row per engine considered."""
    from .envs import ServerEnvNotFoundError, find_server_env

    rows = []
    for engine in (["cpu"] if plan.mode == "cpu" else ["sglang", "vllm"]):
        try:
            env = find_server_env(engine)
            rows.append({"engine": engine, "available": True, "version": env.version, "where": env.source or env.python})
        except ServerEnvNotFoundError as e:
            rows.append({"engine": engine, "available": False, "version": None, "where": str(e).splitlines()[0]})
    return pd.DataFrame(rows, columns=["engine", "available", "version", "where"])


def bench_engines(cfg, engines: Sequence[str]) -> pd.DataFrame:
    """bench.run_bench(cfg) once per engine; each CSV goes to `<cfg.run_dir>/bench-<engine>.csv`.

    Server flags: cfg.extra_args, else $ARTSG_SGLANG_ARGS / $ARTSG_VLLM_ARGS (server.with_env_args)."""
    from .bench import COLUMNS, run_bench

    frames = [pd.DataFrame(columns=COLUMNS)]  # no engine: an empty table, not an error
    for engine in engines:
        out = Path(cfg.run_dir) / f"bench-{engine}.csv"
        frames.append(run_bench(replace(cfg, engine=engine, out=str(out))))
    return pd.concat(frames, ignore_index=True)


def load_results(results_dir: str | os.PathLike, gpu: str | None = None) -> pd.DataFrame:
    """Every `*.csv` in `results_dir` as one frame, `source` = the file name and `workload` labelled
    (`label_workloads`); empty, with those columns, when there is none. `gpu` keeps rows whose
    gpu/hardware contains it (case-insensitive), e.g. "H200"."""
    from .bench import COLUMNS

    files = sorted(Path(results_dir).glob("*.csv"))
    if not files:
        return pd.DataFrame(columns=["source", "gpu", *COLUMNS])
    df = pd.concat([pd.read_csv(f).assign(source=f.name) for f in files], ignore_index=True)
    if "gpu" not in df:
        df["gpu"] = df.get("hardware")
    if "hardware" not in df:
        df["hardware"] = df["gpu"]
    df["date"] = pd.to_datetime(df.get("date"), errors="coerce")
    if gpu:
        df = df[df["gpu"].astype(str).str.contains(gpu, case=False, regex=False)]
    return label_workloads(df).reset_index(drop=True)


def label_workloads(df: pd.DataFrame) -> pd.DataFrame:
    """`workload` = the row's own label, if any, and its shape, e.g. "A: 8x8, 1500-token prompts,
    128 new tokens, 1 turn": rows of different shapes must not be averaged together."""
    df = df.copy()
    shape = [f"{_int(r.groups)}x{_int(r.group_size)}, {_int(r.prompt_tokens)}-token prompts, "
             f"{_int(r.new_tokens)} new tokens, {_int(r.turns)} turn{'' if _int(r.turns) == '1' else 's'}"
             + ("" if str(r.stream_all).lower() != "false" else ", leaders stream")
             for r in df.reindex(columns=SHAPE_COLUMNS).itertuples()]
    given = df["workload"] if "workload" in df else pd.Series(np.nan, index=df.index)
    df["workload"] = [s if pd.isna(g) or not str(g).strip() else f"{g}: {s}" for g, s in zip(given, shape)]
    return df


def latest_results(df: pd.DataFrame) -> pd.DataFrame:
    """Per (engine, gpu, workload), only the rows of the newest file that has it: older runs stay
    committed for the record, the comparison shows the current one."""
    if df.empty:
        return df
    key = ["engine", "gpu", "workload"]
    dates = df.groupby([*key, "source"], dropna=False)["date"].max().reset_index()
    newest = dates.sort_values("date", na_position="first").groupby(key, dropna=False).tail(1)
    return df.merge(newest[[*key, "source"]], on=[*key, "source"])


def result_sources(df: pd.DataFrame) -> pd.DataFrame:
    """Where each result comes from: one row per file with its date, GPU, engines and versions,
    workloads and flags."""
    def join(values):
        return ", ".join(dict.fromkeys(str(v) for v in values if pd.notna(v)))

    return df.groupby("source").agg(date=("date", "min"), gpu=("gpu", join), engines=("engine", join),
                                    engine_version=("engine_version", join), workloads=("workload", "nunique"),
                                    flags=("flags", join), rows=("mode", "size"))


def results_table(df: pd.DataFrame) -> pd.DataFrame:
    """Toolkit rows averaged over repeats, one row per workload, engine, radix and schedule;
    `hit_rate` from the server's counters, else the per-request counts. Rows without a
    `workload` (bench.run_bench's) are labelled first."""
    df = df[df["mode"] == "toolkit"] if "mode" in df else pd.DataFrame(columns=["workload"])
    df = df.copy() if "workload" in df else label_workloads(df)
    df["hit_rate"] = df.get("hit_rate_server", pd.Series(dtype=float)).fillna(df.get("hit_rate_requests"))
    metrics = ["out_tok_s", "ttft_p50_s", "e2e_p50_s", "hit_rate", "hit_rate_theoretical", "raw_fraction", "reload_s"]
    df = df.reindex(columns=["workload", "engine", "radix", "schedule", *metrics])
    df[metrics] = df[metrics].apply(pd.to_numeric, errors="coerce")
    return df.groupby(["workload", "engine", "radix", "schedule"], sort=False, dropna=False)[metrics].mean()


def _int(value) -> str:
    return str(int(value)) if pd.notna(value) else "?"
