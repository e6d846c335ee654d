"""Bench: N experiments together on one server and trainer against the same N one after another.

    python -m artsg_nb.multi.bench --model smollm2-135m-instruct --task addition_chat \\
        --experiments 4 --steps 10 --out /tmp/sweep-bench.json

What it does: starts one Sweep (runtime.py) with N experiments (an lr sweep: the model's default
learning rate times 0.5, 1, 2, 4, ...; experiment i has seed i), warms the server and the trainer
up with `--warm-steps` steps of a throwaway experiment, then runs two phases on it, each on N new experiments (untrained
adapters, the same seeds; `--order`: together first by default, so any cost the warm-up left is
charged to the claim, not the baseline):

  together            `Sweep.run(steps)`, every experiment at its own pace; `--lockstep` instead
                      takes `Sweep.step()` steps (all rollouts together, then the updates in turn)
  one after another   each experiment alone for `--steps` steps (the others idle)

and prints, and writes as JSON to `--out`: total steps per second of each phase and their ratio,
the seconds summed over the experiments' rows (rollout, train, reload, waiting for the trainer),
and each experiment's rewards step by step in both phases (the first step must be equal: same
seeds, same untrained adapter). Timings are of steps only; start-up is left out.

What it does not do: draw anything, or compare with GRPORun (one run per server, Unsloth's trainer
on a GPU, where the MultiTrainer uses transformers + PEFT: time a single GRPORun separately).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..models.pretrained import built_model_dir
from ..run.config import RunConfig, learning_rate
from .runtime import Sweep, SweepConfig
from .trainer import LoraSpec

log = logging.getLogger(__name__)

SPLIT = ("rollout_s", "train_s", "reload_s", "trainer_wait_s")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m artsg_nb.multi.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="registered model name or model directory (default: the tiny model)")
    p.add_argument("--task", default="addition")
    p.add_argument("--experiments", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=None,
                   help="the sweep's middle learning rate (experiment i: x 2^(i-1)); default: RunConfig's for the model")
    p.add_argument("--engine", default="auto")
    p.add_argument("--lockstep", action="store_true", help="together: Sweep.step() steps instead of Sweep.run()")
    p.add_argument("--warm-steps", type=int, default=2, help="steps of a throwaway experiment before timing")
    p.add_argument("--order", choices=("together-first", "alone-first"), default="together-first",
                   help="which phase runs first (the first pays what the warm-up step left; default: together)")
    p.add_argument("--run-dir", default="/tmp/runs/multi-bench")
    p.add_argument("--out", default=None, help="JSON results path (default: <run-dir>/bench.json)")
    return p.parse_args(argv)


def experiment_configs(args, learning_rate: float, prefix: str) -> dict[str, RunConfig]:
    """N RunConfigs of an lr sweep around `learning_rate` (x 0.5, 1, 2, 4, ...), experiment i with seed i."""
    base = RunConfig(task=args.task, group_size=args.group_size, groups_per_step=args.groups_per_step,
                     max_new_tokens=args.max_new_tokens, lora_rank=args.lora_rank, verbose=False)
    return {f"{prefix}{i}": replace(base, learning_rate=learning_rate * 2.0 ** (i - 1), seed=i)
            for i in range(args.experiments)}


async def bench(args) -> dict:
    cfg = SweepConfig(run_dir=args.run_dir, model_path=args.model, engine=args.engine,
                      lora=LoraSpec(rank=args.lora_rank))
    model_dir = built_model_dir(args.model)
    lr = learning_rate(args.learning_rate, model_dir)
    first, second = ("together", "alone") if args.order == "together-first" else ("alone", "together")
    configs = experiment_configs(args, lr, first)
    sweep = Sweep(cfg, {"warm": replace(next(iter(configs.values())), seed=1000), **configs}).start()
    try:
        for _ in range(args.warm_steps):  # first-call costs (compiles, CUDA graphs, allocator growth) paid here
            await sweep.step(names=["warm"])
        await sweep.remove("warm")
        phases = {first: await PHASES[first](sweep, args)}
        for name in list(sweep.experiments):
            await sweep.remove(name)
        for name, c in experiment_configs(args, lr, second).items():
            sweep.add(name, c)  # untrained adapters again, the same seeds
        phases[second] = await PHASES[second](sweep, args)
        return _report(args, sweep, phases["alone"], phases["together"], lr)
    finally:
        sweep.stop()


async def _one_after_another(sweep: Sweep, args) -> dict:
    names = list(sweep.experiments)
    t0 = time.perf_counter()
    for name in names:
        for _ in range(args.steps):
            await sweep.step(names=[name])
    return _phase(sweep, names, time.perf_counter() - t0)


async def _together(sweep: Sweep, args) -> dict:
    names = list(sweep.experiments)
    t0 = time.perf_counter()
    if args.lockstep:
        for _ in range(args.steps):
            await sweep.step()
    else:
        await sweep.run(args.steps)
    return _phase(sweep, names, time.perf_counter() - t0)


PHASES = {"alone": _one_after_another, "together": _together}


def _phase(sweep: Sweep, names: list[str], wall_s: float) -> dict:
    exps = [sweep.experiments[n] for n in names]
    rows = [r for e in exps for r in e.history.rows]
    return {"wall_s": wall_s, "steps": len(rows), "steps_per_s": len(rows) / wall_s if wall_s > 0 else None,
            "split_s": {k: sum(r.get(k) or 0.0 for r in rows) for k in SPLIT},
            "errors": {e.name: e.error for e in exps if e.error},
            "rewards": [[r.get("reward_mean") for r in e.history.rows] for e in exps]}


def _report(args, sweep: Sweep, alone: dict, together: dict, lr: float) -> dict:
    firsts = [(a[0] if a else None, t[0] if t else None) for a, t in zip(alone["rewards"], together["rewards"])]
    speedup = (together["steps_per_s"] / alone["steps_per_s"]
               if together["steps_per_s"] and alone["steps_per_s"] else None)
    gpus = sweep.plan.gpus if sweep.plan is not None else ()
    return {"model": args.model or "tiny", "task": args.task, "experiments": args.experiments, "steps": args.steps,
            "group_size": args.group_size, "groups_per_step": args.groups_per_step, "lora_rank": args.lora_rank,
            "base_learning_rate": lr, "mode": "lockstep" if args.lockstep else "run", "order": args.order,
            "engine": sweep.server.config.engine, "device": [getattr(g, "name", str(g)) for g in gpus] or "cpu",
            "commit": _commit(), "one_after_another": alone, "together": together, "speedup": speedup,
            "first_step_rewards_equal": all(a == t for a, t in firsts), "first_step_rewards": firsts}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def summary(result: dict) -> str:
    a, t = result["one_after_another"], result["together"]

    def split(p):
        return ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in p["split_s"].items())
    return (f"{result['experiments']} experiments x {result['steps']} steps on {result['device']} ({result['engine']}): "
            f"together {t['steps_per_s']:.3f} steps/s in {t['wall_s']:.1f} s vs one after another "
            f"{a['steps_per_s']:.3f} steps/s in {a['wall_s']:.1f} s -> {result['speedup']:.2f}x\n"
            f"  together:          {split(t)}\n  one after another: {split(a)}\n"
            f"  first-step rewards equal: {result['first_step_rewards_equal']} {result['first_step_rewards']}"
            + (f"\n  errors: {a['errors']} {t['errors']}" if a["errors"] or t["errors"] else ""))


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    result = asyncio.run(bench(args))
    out = Path(args.out or Path(args.run_dir) / "bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(summary(result))
    print(f"results: {out}")
    return 0 if not (result["one_after_another"]["errors"] or result["together"]["errors"]) else 1


if __name__ == "__main__":
    sys.exit(main())
