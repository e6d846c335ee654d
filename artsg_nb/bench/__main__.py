"""The benchmark's command line: `python -m artsg_nb.bench --engine cpu --groups 4 ...`.

Parses the flags into a BenchConfig (one flag per field), runs bench.run_bench, prints the
summary table. `--help` lists the flags; benchmarks/README.md shows typical invocations.
"""
from __future__ import annotations

import argparse
import logging
import shlex
import sys
from typing import Sequence

import pandas as pd

from ..rollout import SCHEDULES
from .results import summary_table
from .run import BenchConfig, run_bench

DESCRIPTION = ("Benchmarks shaped like GRPO rollouts: throughput, latency, prefix-cache hit rate, "
               "reload time.")


def parse_args(argv: Sequence[str]) -> BenchConfig:
    """BenchConfig from command-line flags (the command line itself goes into `flags`)."""
    p = argparse.ArgumentParser(prog="python -m artsg_nb.bench", description=DESCRIPTION)
    p.add_argument("--engine", choices=("cpu", "sglang", "vllm"), default="cpu")
    p.add_argument("--model", dest="model_path")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--turns", type=int, default=1)
    p.add_argument("--env-tokens", type=int, default=32)
    p.add_argument("--schedule", default="naive,prefix", help=f"comma list of {', '.join(SCHEDULES)}")
    p.add_argument("--radix", default="on", help="on, off, or on,off (one server each)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-raw", dest="raw", action="store_false")
    p.add_argument("--no-reload", dest="reload", action="store_false")
    p.add_argument("--no-stream-all", dest="stream_all", action="store_false",
                   help="stream only the schedule's leaders (TTFT only for those)")
    p.add_argument("--server-url")
    p.add_argument("--run-dir", default="runs/bench")
    p.add_argument("--extra-args", default="", help="extra server arguments, one quoted string")
    p.add_argument("--out")
    p.add_argument("--workload", help="a short label for this shape, e.g. A (kept in every row)")
    a = p.parse_args(argv)
    radix = tuple({"on": True, "off": False}[r.strip()] for r in a.radix.split(","))
    return BenchConfig(
        engine=a.engine, model_path=a.model_path, groups=a.groups, group_size=a.group_size,
        prompt_tokens=a.prompt_tokens, new_tokens=a.new_tokens, turns=a.turns, env_tokens=a.env_tokens,
        schedules=tuple(s.strip() for s in a.schedule.split(",")), radix=radix, raw=a.raw,
        stream_all=a.stream_all, reload=a.reload, repeats=a.repeats, warmup=a.warmup,
        temperature=a.temperature, concurrency=a.concurrency, server_url=a.server_url, run_dir=a.run_dir,
        extra_args=tuple(shlex.split(a.extra_args)), out=a.out, flags=" ".join(argv),
        workload=a.workload)


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    """Run the benchmark the flags describe and print its summary table."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    cfg = parse_args(sys.argv[1:] if argv is None else list(argv))
    df = run_bench(cfg)
    print(summary_table(df))
    return df


if __name__ == "__main__":
    main()
