"""The n > 1 request shapes on a real SGLang, under an adapter (`bash tools/gpu/validate.sh nshapes`).

Measures what the balanced "n" (a warm-up, then one batch of n single samples) costs against
SGLang's native n > 1 and the other schedules, on one server and one adapter: the same held-out
groups, prefix cache flushed before each batch, `--repeats` batches per shape. Native n goes last,
since it leaves the adapter's reference count below zero; then the adapter's unload is tried with
a short admin timeout, to show the hang (sglang#36894) on this very server. One JSON record.

What it does not do: train beyond the one step that gives the server a trained adapter.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from artsg_nb import GRPORun, RunConfig
from artsg_nb.engines.errors import AdminTimeoutError
from artsg_nb.rollout.trajectory import rollout_stats

SHAPES = ("naive", "prefix", "n", "n_native")
SEEDS = list(range(10_000, 10_016))  # held-out groups, the same for every shape


async def measure(run: GRPORun, shape: str, repeats: int) -> dict:
    if shape == "n_native":  # what the client never sends to this server on its own
        run.client.lora_n_problem = lambda info: None
        run.client._n_problem = None
    walls, stats = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        groups = await run.rollouts(SEEDS[:run.cfg.groups_per_step], schedule="n" if shape == "n_native" else shape)
        walls.append(time.perf_counter() - t0)
        stats.append(rollout_stats(groups))
    tokens = statistics.median(s["completion_tokens"] for s in stats)
    wall = statistics.median(walls)
    return {"shape": shape, "wall_s_median": round(wall, 4), "walls_s": [round(w, 4) for w in walls],
            "completion_tokens": tokens, "tok_per_s": round(tokens / wall, 1),
            "hit_rate": round(statistics.median(s["hit_rate"] or 0.0 for s in stats), 4),
            "failed": sum(s["failed"] for s in stats)}


async def main_async(a) -> dict:
    cfg = RunConfig(model_path=a.model, run_dir=a.run_dir, admin_timeout_s=a.unload_timeout_s)
    run = GRPORun(cfg).start()
    record = {"model": a.model, "groups": cfg.groups_per_step, "group_size": cfg.group_size, "rows": []}
    try:
        await run.step()  # policy-step-1 served: rollouts below run under a trained adapter
        record["adapter"] = run.adapter
        record["sglang_version"] = (await run.client.server_info()).get("version")
        for shape in SHAPES:
            row = await measure(run, shape, a.repeats)
            print(json.dumps(row), flush=True)
            record["rows"].append(row)
        t0 = time.perf_counter()
        try:
            await run.client.unload_adapter(run.adapter)
            record["unload_after_native_n"] = f"answered in {time.perf_counter() - t0:.2f} s"
        except AdminTimeoutError as e:
            record["unload_after_native_n"] = f"hung: {e}"
        print("unload after native n:", record["unload_after_native_n"], flush=True)
    finally:
        run.stop()
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--run-dir", default="/tmp/runs/nshapes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--unload-timeout-s", type=float, default=15.0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    record = asyncio.run(main_async(a))
    Path(a.out).write_text(json.dumps(record, indent=2))
    by = {r["shape"]: r for r in record["rows"]}
    if "n" in by and "n_native" in by:
        print(f"balanced n / native n wall: {by['n']['wall_s_median'] / by['n_native']['wall_s_median']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
