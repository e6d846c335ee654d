"""The GRPO update over several processes with torch.distributed (gloo on CPU, NCCL on GPUs).

What it does:
  - `ddp_train_step(trainer, groups, rank, world_size)`: the same update as Trainer.train_step,
    data-parallel. Every rank builds the whole batch (advantages need whole groups), keeps a
    contiguous shard of its sequences, and computes grpo.policy_loss on it with the *whole*
    batch's normalisers (`num_sequences` for grpo/dr_grpo, `num_items` = completion tokens for
    dapo), so each rank's loss is its share of the single-process loss and the gradients add
    up: they are all-reduced with SUM (not DDP's mean), then clipped and stepped identically on
    every rank. The LoRA weights are broadcast from rank 0 first, so every rank starts equal.
  - `launch(target, world_size, kwargs, run_dir)`: K worker processes `python -m
    artsg_nb.distributed`, torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
    environment), each in its own process group with a log `<run_dir>/trainer-rank<r>.log`, so a
    notebook kernel can start them and `Workers.stop()` ends them by group; on GPUs rank r sees
    only `gpus[r]` (gpus.GpuPlan.trainer_gpus). `target` is "module:function", called as
    `function(rank, world_size, **kwargs)` after init_process_group.
  - `train_on_groups`: a target that runs one distributed step on pickled groups and has rank 0
    save the adapter (what tests/test_distributed.py compares with one process).

What it does not: keep workers alive across steps (session.py still trains in the kernel: a
`RunConfig.trainer_ranks` wired into GRPORun is the next step, docs/scale-out.md), shard the
model (FSDP), or average metrics other than the loss (the others are rank 0's shard's).
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from . import procs
from .grpo import GRPOConfig, zero_advantage_groups
from .trainer import Batch, Trainer, TrainerConfig

log = logging.getLogger(__name__)


class DistributedError(RuntimeError):
    """A trainer rank exited with an error or did not finish in time (message: its log tail)."""


def shard(n: int, rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s contiguous share of n items (the first n % world_size ranks get one more)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (rank < extra)))


def _take(b: Batch, idx: list[int]) -> Batch:
    return Batch(*(t[idx] for t in (b.input_ids, b.attention_mask, b.completion_mask, b.sampling_logps,
                                    b.advantages, b.rewards, b.group_ids)))


def broadcast_lora(trainer: Trainer, src: int = 0) -> None:
    """Make every rank's trainable (LoRA) weights rank `src`'s."""
    for p in _trainable(trainer):
        dist.broadcast(p.data, src)


def ddp_train_step(trainer: Trainer, groups, rank: int, world_size: int) -> dict:
    """One optimizer step on `groups` (the same on every rank), this rank computing its shard."""
    batch = trainer.make_batch(groups)
    n_seq = batch.input_ids.shape[0]
    n_items = batch.completion_mask.sum().clamp(min=1)
    mine = _take(batch, shard(n_seq, rank, world_size))
    params = _trainable(trainer)
    trainer.model.train()
    local_loss = torch.zeros((), dtype=torch.float64)
    for mb in trainer.micro_batches(mine):
        loss, _, _ = trainer.micro_batch_loss(mb, n_seq, n_items)  # normalised by the whole batch
        loss.backward()
        local_loss += loss.item()
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # one call for all LoRA tensors: the sum is the full gradient
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, trainer.cfg.max_grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.step += 1
    loss_t = local_loss.to(flat.device)
    dist.all_reduce(loss_t, op=dist.ReduceOp.SUM)
    return {"loss": float(loss_t), "grad_norm": float(grad_norm), "sequences": n_seq, "ranks": world_size,
            "zero_adv_groups": zero_advantage_groups(batch.rewards, batch.group_ids),
            "tokens": int(batch.attention_mask.sum()), "completion_tokens": int(n_items)}


def _trainable(trainer: Trainer) -> list[torch.nn.Parameter]:
    return [p for p in trainer.model.parameters() if p.requires_grad]


# ---- worker processes ------------------------------------------------------------------------
@dataclass
class Workers:
    """K started rank processes; `wait()` for them, `stop()` ends their process groups."""
    procs: list = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def wait(self, timeout_s: float = 600.0) -> None:
        """Until every rank exits; raises DistributedError with the first failing rank's log tail."""
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.procs):
            failed = [r for r, p in enumerate(self.procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                self.stop()
                r = failed[0] if failed else 0
                what = f"rank {r} exited with code {self.procs[r].returncode}" if failed else \
                    f"the ranks did not finish within {timeout_s:.0f} s"
                raise DistributedError(f"{what}. Try: read {self.logs[r]}; last lines:\n{_tail(self.logs[r])}")
            time.sleep(0.2)
        bad = [r for r, p in enumerate(self.procs) if p.returncode != 0]
        if bad:
            raise DistributedError(f"rank {bad[0]} exited with code {self.procs[bad[0]].returncode}. "
                                   f"Last lines of {self.logs[bad[0]]}:\n{_tail(self.logs[bad[0]])}")

    def stop(self, timeout_s: float = 5.0) -> None:
        for p in self.procs:
            procs.stop_group(os.getpgid(p.pid) if p.poll() is None else p.pid, timeout_s, proc=p)


def launch(target: str, world_size: int, kwargs: dict, run_dir: str | Path,
           gpus: Sequence[int] = (), backend: str | None = None) -> Workers:
    """Start `world_size` ranks running `target` ("module:function") with `kwargs` (JSON-able).
    `gpus`: one physical GPU index per rank (NCCL); empty runs on CPU with gloo."""
    if gpus and len(gpus) < world_size:
        raise ValueError(f"{world_size} ranks need {world_size} GPUs, got {list(gpus)}")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    backend = backend or ("nccl" if gpus else "gloo")
    port = procs.pick_free_port("127.0.0.1")
    workers = Workers()
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0" if gpus else str(rank),
               "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "ARTSG_DIST_BACKEND": backend, "PYTHONUNBUFFERED": "1"}
        if gpus:
            env.update(CUDA_VISIBLE_DEVICES=str(gpus[rank]), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        cmd = [sys.executable, "-m", "artsg_nb.distributed", target, json.dumps(kwargs)]
        path = run_dir / f"trainer-rank{rank}.log"
        workers.procs.append(procs.spawn(cmd, env, path, f"==== rank {rank}/{world_size} {target}\n"))
        workers.logs.append(path)
    return workers


def train_on_groups(rank: int, world_size: int, trainer_config: dict, groups_path: str, out_dir: str) -> None:
    """One distributed step on the pickled `groups_path`; rank 0 saves the adapter in out_dir."""
    grpo = GRPOConfig(**trainer_config.pop("grpo", {}))
    trainer = Trainer(TrainerConfig(**trainer_config, grpo=grpo))
    broadcast_lora(trainer)
    with open(groups_path, "rb") as f:
        groups = pickle.load(f)
    metrics = ddp_train_step(trainer, groups, rank, world_size)
    if rank == 0:
        trainer.save_adapter(out_dir)
        Path(out_dir, "metrics.json").write_text(json.dumps(metrics))
    dist.barrier()


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return f"(no log at {path})"


def main(argv: list[str] | None = None) -> int:
    """Rank entry point: `python -m artsg_nb.distributed module:function '{json kwargs}'`."""
    target, kwargs = (argv or sys.argv[1:])[:2]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = os.environ.get("ARTSG_DIST_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        module, name = target.split(":")
        getattr(importlib.import_module(module), name)(rank, world, **json.loads(kwargs))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
