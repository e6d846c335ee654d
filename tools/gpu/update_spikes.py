"""Which updates of a run on defaults stand out, and where their seconds went (`validate.sh update-spikes`).

A GRPORun on RunConfig defaults (the CI tiny model, SGLang), `--steps` steps; per step the update's
wall seconds and its split as the trainer gives it (`Trainer.last_update`, rl/update_timing.py),
with the CUDA caching allocator's new segments over the step. Prints one line per step and a
summary (updates over 3x the median after the first); `--out` writes the JSON. Run it under
different environments (e.g. CUDA_MODULE_LOADING=EAGER) to tell one-off kernel loads from the rest.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--run-dir", default="/tmp/runs/update-spikes")
    p.add_argument("--label", default=os.environ.get("CUDA_MODULE_LOADING", "default"))
    p.add_argument("--out")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over each step: its top operators by their own CPU time, and the GPU's kernel time")
    a = p.parse_args(argv)
    import torch
    from artsg_nb import GRPORun, RunConfig

    segments_now = lambda: torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0  # noqa: E731
    run = GRPORun(RunConfig(model_path=a.model, run_dir=a.run_dir, verbose=False)).start()
    kernel = getattr(run.trainer, "logprob_kernel", None)
    print(f"{a.label}: scoring with {getattr(kernel, '__name__', None) or 'the logits (no fused kernel)'}", flush=True)
    steps = []
    try:
        for _ in range(a.steps):
            segments = segments_now()
            prof = _profiler(a.profile)
            with prof:
                row = asyncio.run(run.step())
            timing = run.trainer.last_update
            step = {"step": row["step"], "train_s": row.get("train_s"), "tokens": row.get("tokens"),
                    "completion_tokens": row.get("completion_tokens"),
                    "new_segments": segments_now() - segments,
                    "trl_triton_kernels": _trl_kernels(), "top_ops": _top_ops(prof) if a.profile else None,
                    "timing": asdict(timing) if timing else None}
            steps.append(step)
            print(json.dumps(step), flush=True)
    finally:
        run.stop()
    later = [s["train_s"] for s in steps[1:] if s["train_s"]]
    median = statistics.median(later) if later else 0
    spikes = [s for s in steps[1:] if s["train_s"] and s["train_s"] > 3 * median]
    print(f"{a.label}: {len(steps)} steps, update median {median:.4f} s after the first, "
          f"{len(spikes)} over 3x: {[(s['step'], round(s['train_s'], 3)) for s in spikes]}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"label": a.label, "median_s": median, "steps": steps}, indent=1))
    return 0


def _profiler(on: bool):
    import contextlib
    if not on:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _top_ops(prof, top: int = 8) -> dict:
    """The step's operators with the most CPU time of their own, and the GPU's total kernel time."""
    events = prof.key_averages()
    device = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events) / 1e6
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return {"gpu_kernels_s": round(device, 4),
            "cpu": [(e.key[:60], e.count, round(e.self_cpu_time_total / 1e6, 4)) for e in ranked]}


def _trl_kernels():
    """Compiled variants of TRL's fused logprob kernels held in memory (Triton's per-device caches)."""
    try:
        from trl.kernels import chunked_logprob as m
        return sum(len(cache[0]) for k in (m._forward_kernel, m._backward_kernel) for cache in k.device_caches.values())
    except Exception as e:  # noqa: BLE001 — another Triton version's layout: say so
        return repr(e)[:80]


if __name__ == "__main__":
    sys.exit(main())
