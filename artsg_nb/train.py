"""Headless GRPO: `python -m artsg_nb.train --task NAME --steps N [--engine ...] [--run-dir D]`.

The same code path as the notebooks (session.GRPORun), for clusters and for checks. Prints one
line per step and leaves adapters, checkpoints, history.jsonl, the server log and a plot of the
curves in the run directory. `--list-tasks` prints one task per line, its name first. A user
error (unknown task, no server environment, no GPU, bad model path, busy port, lost server, ...)
prints its message, which says what to try, without a traceback and exits with status 1.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace

from .engines import AdapterRankError, MemorySaverError
from .gpus import CudaAlreadyInitializedError, NoGpuError
from .grpo import GRPOConfig
from .lora import AdapterSaveError
from .plots import save_training_plot
from .server import ServerError
from .server_env import ServerEnvNotFoundError
from .session import GRPORun, RunConfig, ServerLostError
from .tasks import UnknownTaskError, list_tasks
from .trainer import CheckpointError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m artsg_nb.train", description=__doc__.splitlines()[0])
    p.add_argument("--task", default="addition", help="task name (see --list-tasks)")
    p.add_argument("--steps", type=int, default=10, help="GRPO steps to run")
    p.add_argument("--engine", default="auto", choices=["auto", "cpu", "sglang", "vllm"])
    p.add_argument("--run-dir", default=None, help="output directory (default runs/<task>)")
    p.add_argument("--model", default=None, help="base model directory (default: the offline tiny model)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default RunConfig's)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--loss", default="dapo", choices=["grpo", "dr_grpo", "dapo"])
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient to the adapter-disabled model")
    p.add_argument("--is-mode", default=None,
                   choices=["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
    p.add_argument("--schedule", default="prefix", choices=["prefix", "naive", "n"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    p.add_argument("--max-restarts", type=int, default=2)
    p.add_argument("--release-memory", default="off", choices=["off", "on", "auto"],
                   help="release the server's GPU memory around each training step (auto: one shared GPU)")
    p.add_argument("--servers", type=int, default=1,
                   help="inference servers; above 1 behind sglang-router (RunConfig.num_servers)")
    p.add_argument("--list-tasks", action="store_true", help="print the tasks and exit")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> RunConfig:
    cfg = RunConfig(task=a.task, engine=a.engine, model_path=a.model, run_dir=a.run_dir or f"runs/{a.task}",
                    group_size=a.group_size, groups_per_step=a.groups_per_step, lora_rank=a.lora_rank,
                    lora_alpha=2 * a.lora_rank, schedule=a.schedule, seed=a.seed, resume=a.resume,
                    max_restarts=a.max_restarts, num_servers=a.servers,
                    release_memory={"off": False, "on": True}.get(a.release_memory, a.release_memory),
                    grpo=GRPOConfig(loss_type=a.loss, beta=a.beta, is_mode=a.is_mode))
    return replace(cfg, learning_rate=a.lr) if a.lr is not None else cfg


async def _train(run: GRPORun, steps: int) -> None:
    await run.run(steps)


def user_errors() -> tuple[type[Exception], ...]:
    """Errors whose message already says what happened and what to try: no traceback for them."""
    return (UnknownTaskError, ServerEnvNotFoundError, NoGpuError, CudaAlreadyInitializedError, ServerError,
            ServerLostError, AdapterSaveError, AdapterRankError, CheckpointError, MemorySaverError)


def main(argv=None) -> int:
    try:
        return _main(argv)
    except user_errors() as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _main(argv=None) -> int:
    a = parse_args(argv)
    if a.list_tasks:
        for t in list_tasks():
            print(f"{t.name}\t{t.description}")
        return 0
    cfg = config_from_args(a)
    t0 = time.perf_counter()
    with GRPORun(cfg) as run:
        asyncio.run(_train(run, a.steps))
        df = run.history.df
    save_training_plot(df, run.run_dir / "training.png")
    first, last = df["reward_mean"].iloc[0], df["reward_mean"].iloc[-1]
    print(f"done: {len(df)} steps in {time.perf_counter() - t0:.1f} s | reward {first:.3f} -> {last:.3f} | "
          f"history {run.run_dir / 'history.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
