"""Benchmarks shaped like GRPO rollouts: throughput, latency, prefix-cache hit rate, reload time.

P prompts x G samples x T turns of synthetic text go through the toolkit's own collect_groups
against each engine (radix cache on/off, every submission schedule), are replayed with plain
httpx as the raw-engine baseline, and come back as one DataFrame row per run, saved to CSV with
date, hardware, engine version and flags.

    python -m artsg_nb.bench --engine cpu --groups 2 --group-size 4 --prompt-tokens 256 \\
        --new-tokens 16 --schedules naive prefix n

Modules, one responsibility each:
    run         BenchConfig, run_bench (servers, runs, measurements), bench_engines,
                engine_availability
    workloads   SyntheticTask, the synthetic prompts and env turns
    raw         the raw-httpx replay of a run's token payloads (the baseline)
    results     COLUMNS, the CSV files, and the tables made from them (load_results, ...)
    schedules   compare_schedules: per-turn hit rates of each schedule on a live GRPORun
                (held_out_seeds: the env seeds it plays, away from training's)
    checks      check_rows: value checks on a run's history rows (the GPU smoke's gate)
    __main__    the command line

What it does not do: plot (plots.plot_engine_comparison, plots.plot_turn_hit_rates), compute hit
rates (metrics.py), or decide anything; it reports.
"""
from .results import (COLUMNS, label_workloads, latest_results, load_results, load_step_results, result_sources,
                      results_table, step_ratios, summary_table)
from .run import BenchConfig, bench_engines, engine_availability, run_bench
from .schedules import compare_schedules, held_out_seeds
from .workloads import SyntheticTask

__all__ = ["COLUMNS", "BenchConfig", "SyntheticTask", "bench_engines", "compare_schedules", "engine_availability",
           "held_out_seeds", "label_workloads", "latest_results", "load_results", "load_step_results", "result_sources",
           "results_table", "run_bench", "step_ratios", "summary_table"]
