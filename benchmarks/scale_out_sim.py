"""GRPO steps with N = 1, 2, 3 engines behind sglang-router: step time and hit rate against N.

    .venv/bin/python benchmarks/scale_out_sim.py [--servers 1 2 3] [--steps 3] [--groups 8]
        [--group-size 8] [--engine cpu] [--model DIR] [--csv PATH]

What it measures: for each N, one GRPORun (RunConfig(num_servers=N)) from the same seed runs
`--steps` GRPO steps plus one warm-up step that is not counted (the first adapter load and the
engines' first requests). Printed per N: median step time and its parts (rollout_s, train_s,
reload_s), rollout throughput (completion tokens per rollout second), the step's hit rate
(Σcached / Σprompt over the workers), the theoretical hit rate of the same batches
(metrics.theoretical_hit_rate) and each worker's share of the prompt tokens (is the router
spreading the load?). With --csv every counted step is also written as one row.

On the CPU box (2 cores shared) N engines compete for the same cores, so rollouts cannot get
faster with N: what this shows there is that routing keeps the hit rate and spreads the work.
On a GPU (benchmarks/scale_out_gpu.py: N SGLang servers on one H200, 0.70 / N of its memory
each) it is the throughput comparison.

What it does not: start engines on other nodes, or train over several ranks (distributed.py).
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import statistics
import sys
import tempfile
import time
from pathlib import Path

from artsg_nb.run.session import GRPORun, RunConfig


def run_n(n: int, a, root: Path) -> list[dict]:
    cfg = RunConfig(task=a.task, engine=a.engine, model_path=a.model, run_dir=str(root / f"n{n}"),
                    group_size=a.group_size, groups_per_step=a.groups, num_servers=n, seed=a.seed,
                    verify_adapter=False, verbose=False, max_new_tokens=a.max_new_tokens)
    rows = []
    with GRPORun(cfg) as run:
        for k in range(a.steps + 1):
            t0 = time.perf_counter()
            row = asyncio.run(run.step())
            row["step_s"] = time.perf_counter() - t0
            row["rollout_tok_s"] = row["completion_tokens"] / row["rollout_s"]
            row["num_servers"] = n
            if k > 0:  # the first step warms up the engines and loads the first adapter
                rows.append(row)
            print(f"  N={n} step {row['step']}: {row['step_s']:.1f} s, hit {row['hit_rate']:.3f}, "
                  f"workers {row.get('worker_prompt_tokens', '-')}", file=sys.stderr, flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    tokens = [sum(x or 0 for x in col) for col in zip(*(r.get("worker_prompt_tokens") or [0] for r in rows))]
    share = "/".join(f"{t / sum(tokens):.2f}" for t in tokens) if sum(tokens) else "1.00"  # N=1: no per-worker columns
    return {"N": rows[0]["num_servers"], "step_s": med("step_s"), "rollout_s": med("rollout_s"),
            "train_s": med("train_s"), "reload_s": med("reload_s"), "rollout_tok_s": med("rollout_tok_s"),
            "hit_rate": med("hit_rate"), "theoretical": med("theoretical_hit_rate"), "prompt_share": share}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--servers", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=3, help="counted steps per N (after one warm-up step)")
    p.add_argument("--groups", type=int, default=8, help="groups (prompts) per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--task", default="addition")
    p.add_argument("--engine", default="cpu", choices=["cpu", "sglang", "vllm"])
    p.add_argument("--model", default=None, help="base model directory (default: the offline tiny model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", type=Path, default=None, help="write every counted step here")
    a = p.parse_args(argv)
    all_rows = []
    with tempfile.TemporaryDirectory(prefix="scale-out-") as tmp:
        for n in a.servers:
            all_rows += run_n(n, a, Path(tmp))
    table = [summary([r for r in all_rows if r["num_servers"] == n]) for n in a.servers]
    print("| N | step s | rollout s | train s | reload s | rollout tok/s | hit rate | theoretical | prompt tokens per worker |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['N']} | {t['step_s']:.2f} | {t['rollout_s']:.2f} | {t['train_s']:.2f} | {t['reload_s']:.2f} | "
              f"{t['rollout_tok_s']:.0f} | {t['hit_rate']:.3f} | {t['theoretical']:.3f} | {t['prompt_share']} |")
    if a.csv:
        a.csv.parent.mkdir(parents=True, exist_ok=True)
        keys = ["num_servers", "step", "step_s", "rollout_s", "train_s", "reload_s", "rollout_tok_s", "hit_rate",
                "theoretical_hit_rate", "worker_hit_rates", "worker_prompt_tokens", "reward_mean", "restarts"]
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(all_rows)
        print(f"wrote {a.csv}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
