"""The benchmark's command line: `python -m artsg_nb.bench --engine cpu --groups 4 ...`.

Parses the flags into a BenchConfig (generated from its fields by tyro), runs bench.run_bench, prints the
summary table. `--help` lists the flags; benchmarks/README.md shows typical invocations.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import replace
from typing import Sequence

import pandas as pd
import tyro

from ..run.config import glue_flag_values, split_flags
from .results import summary_table
from .run import BenchConfig, run_bench

DESCRIPTION = ("Benchmarks shaped like GRPO rollouts: throughput, latency, prefix-cache hit rate, "
               "reload time.")


def parse_args(argv: Sequence[str]) -> BenchConfig:
    """BenchConfig from command-line flags generated from its fields (tyro; `--help` lists them);
    the command line itself goes into `flags`. `--extra-args` takes the server flags as one
    quoted string ("--attention-backend triton")."""
    argv = list(argv)
    cfg = tyro.cli(BenchConfig, args=glue_flag_values(argv, ["--extra-args"]), prog="python -m artsg_nb.bench",
                   description=DESCRIPTION)
    return replace(cfg, extra_args=split_flags(cfg.extra_args), flags=" ".join(argv))


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
