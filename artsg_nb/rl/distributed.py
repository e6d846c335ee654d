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
    artsg_nb.rl.distributed`, torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
    environment), each in its own process group with a log `<run_dir>/trainer-rank<r>.log`, so a
    notebook kernel can start them and `Workers.stop()` ends them by group; on GPUs rank r sees
    only `gpus[r]` (gpus.GpuPlan.trainer_gpus). `target` is "module:function", called as
    `function(rank, world_size, **kwargs)` after init_process_group.
  - `RankedTrainer` (GRPORun with `RunConfig.trainer_ranks` = K > 1, through `make_trainer`):
    the kernel is rank 0 and keeps its Trainer; K-1 `follow` processes load the model once and
    live across steps, taking rank 0's commands (train on this step's groups, load a checkpoint,
    stop) from the rendezvous store (listening on 127.0.0.1 only: `loopback_store`) as JSON
    signed with a key that only the ranks' environments hold; an unsigned or forged command is
    logged and ignored, never run. The ranks' step statistics travel as JSON in tensors
    (`all_gather_json`): nothing a peer sends is unpickled. A dead rank fails the next step
    with its log's tail; the run resumes from its last step.
  - `train_on_groups`: a target that runs one distributed step on pickled groups and has rank 0
    save the adapter (what tests/test_distributed.py compares with one process).

What it does not: shard the model (FSDP: the LoRA models here fit on one GPU each), or span
machines (the ranks share a file system for checkpoints; rendezvous on 127.0.0.1).
"""
from __future__ import annotations

import hmac
import importlib
import itertools
import json
import logging
import os
import pickle
import secrets
import socket
import sys
import time
from datetime import timedelta
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import torch
import torch.distributed as dist

from ..files import log_tail
from ..serving import procs
from .grpo import GRPOConfig
from .interface import RunTrainer
from .step_stats import StepStats, batch_counts
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
    for p in trainer.trainable:
        dist.broadcast(p.data, src)


def ddp_train_step(trainer: Trainer, groups, rank: int, world_size: int) -> dict:
    """One optimizer step on `groups` (the same on every rank), this rank computing its shard.
    Returns Trainer.train_step's metrics for the whole batch (every rank's part added up)."""
    batch = trainer.make_batch(groups)
    trainer.check_fused()  # before the budget is sized: it depends on whether the fused path stays
    stats = trainer.backward(batch, _take(batch, shard(batch.input_ids.shape[0], rank, world_size)))
    params = trainer.trainable
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # one call for all LoRA tensors: the sum is the full gradient
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    parts = [StepStats.from_dict(d) for d in all_gather_json(stats.to_dict(), world_size)]
    return {**StepStats.merged(parts).result(), "grad_norm": trainer.optimizer_step(), **batch_counts(batch),
            "ranks": world_size}


def all_gather_json(obj, world_size: int) -> list:
    """Every rank's JSON-able `obj`, as bytes in uint8 tensors (lengths first, then padded):
    unlike all_gather_object, nothing a peer sends is unpickled."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64))
    longest = int(max(sizes).item())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return [json.loads(bytes(p[:int(n.item())].tolist())) for p, n in zip(parts, sizes)]


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
                raise DistributedError(f"{what}. Try: read {self.logs[r]}; last lines:\n{log_tail(self.logs[r])}")
            time.sleep(0.2)
        bad = [r for r, p in enumerate(self.procs) if p.returncode != 0]
        if bad:
            raise DistributedError(f"rank {bad[0]} exited with code {self.procs[bad[0]].returncode}. "
                                   f"Last lines of {self.logs[bad[0]]}:\n{log_tail(self.logs[bad[0]])}")

    def stop(self, timeout_s: float = 5.0) -> None:
        for p in self.procs:
            procs.stop_group(os.getpgid(p.pid) if p.poll() is None else p.pid, timeout_s, proc=p)


def launch(target: str, world_size: int, kwargs: dict, run_dir: str | Path,
           gpus: Sequence[int] = (), backend: str | None = None, first_rank: int = 0,
           port: int | None = None, env: dict | None = None) -> Workers:
    """Start ranks `first_rank`..`world_size`-1 running `target` ("module:function") with
    `kwargs` (JSON-able). `gpus`: one physical GPU index per rank (NCCL); empty runs on CPU with
    gloo. `first_rank=1` when this process is rank 0 (RankedTrainer); `env` adds variables."""
    if gpus and len(gpus) < world_size:
        raise ValueError(f"{world_size} ranks need {world_size} GPUs, got {list(gpus)}")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    backend = backend or ("nccl" if gpus else "gloo")
    port = port or procs.pick_free_port("127.0.0.1")
    workers = Workers()
    for rank in range(first_rank, world_size):
        env_r = {**os.environ, **(env or {}), "RANK": str(rank), "LOCAL_RANK": "0" if gpus else str(rank),
                 "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "ARTSG_DIST_BACKEND": backend, "PYTHONUNBUFFERED": "1"}
        if gpus:
            env_r.update(CUDA_VISIBLE_DEVICES=str(gpus[rank]), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        cmd = [sys.executable, "-m", "artsg_nb.rl.distributed", target, json.dumps(kwargs)]
        path = run_dir / f"trainer-rank{rank}.log"
        workers.procs.append(procs.spawn(cmd, env_r, path, f"==== rank {rank}/{world_size} {target}\n"))
        workers.logs.append(path)
    return workers


def train_on_groups(rank: int, world_size: int, trainer_config: dict, groups_path: str, out_dir: str) -> None:
    """One distributed step on the pickled `groups_path`; rank 0 saves the adapter in out_dir."""
    trainer = Trainer(trainer_config_from_json(trainer_config))
    _init(rank, world_size)
    broadcast_lora(trainer)
    with open(groups_path, "rb") as f:
        groups = pickle.load(f)
    metrics = ddp_train_step(trainer, groups, rank, world_size)
    if rank == 0:
        trainer.save_adapter(out_dir)
        Path(out_dir, "metrics.json").write_text(json.dumps(metrics))
    dist.barrier()


# ---- a trainer over K ranks for GRPORun ------------------------------------------------------
def trainer_config_to_json(cfg: TrainerConfig) -> dict:
    return json.loads(json.dumps(asdict(cfg)))


def trainer_config_from_json(d: dict) -> TrainerConfig:
    d = dict(d)
    return TrainerConfig(**{**d, "target_modules": tuple(d.get("target_modules", TrainerConfig.target_modules)),
                            "grpo": GRPOConfig(**d.get("grpo", {}))})


def portable_groups(groups) -> list[dict]:
    """What Trainer.make_batch reads of each trajectory, as JSON (ranks never unpickle commands)."""
    return [{"trajectories": [{"token_ids": list(t.token_ids), "completion_mask": list(t.completion_mask),
                               "logprobs": list(t.logprobs), "reward": t.reward,
                               "error": None if t.error is None else str(t.error)}
                              for t in g.trajectories]} for g in groups]


def _groups_from_json(groups: list[dict]) -> list[SimpleNamespace]:
    return [SimpleNamespace(trajectories=[SimpleNamespace(**t) for t in g["trajectories"]]) for g in groups]


class RankedTrainer:
    """A Trainer over `world_size` ranks, used by GRPORun like a Trainer (RunConfig.trainer_ranks).

    This process (the kernel) is rank 0: its Trainer scores, saves and restores as a single
    trainer does. Ranks 1..K-1 are worker processes (`launch`, logs in
    `<run_dir>/trainer-rank<r>.log`) that load the same model once and then follow rank 0's
    commands: train on a step's groups (each rank its shard, ddp_train_step), load a checkpoint
    (a resume or a rollback), stop. Commands go through the rendezvous store as JSON signed with
    a key only the ranks' environments hold; a rank that dies fails the next step with its log's
    tail. One per process: torch.distributed has one default process group. It implements
    interface.RunTrainer member by member; it has no `optimizer` (a per-call learning rate set on
    rank 0's alone would part the ranks: art.backend refuses it with trainer_ranks > 1).
    """

    def __init__(self, cfg: TrainerConfig, world_size: int, run_dir: str | Path, gpus: Sequence[int] = (),
                 start_timeout_s: float = 600.0, step_timeout_s: float = 1800.0):
        if world_size < 2:
            raise ValueError(f"RankedTrainer needs 2 or more ranks, got {world_size}; use Trainer")
        if dist.is_initialized():
            raise DistributedError("this kernel already runs a process group (another run with trainer_ranks > 1?). "
                                   "Try: stop that run first; one multi-rank trainer per kernel")
        self.world_size, self._n, self._key = world_size, 0, secrets.token_bytes(32)
        self._store = loopback_store(world_size, timedelta(seconds=start_timeout_s))
        port = self._store.port
        self.workers = launch("artsg_nb.rl.distributed:follow", world_size,
                              dict(trainer_config=trainer_config_to_json(cfg), step_timeout_s=step_timeout_s),
                              run_dir, gpus=gpus, first_rank=1, port=port,
                              env={_KEY_ENV: self._key.hex()})
        try:
            self.local = Trainer(cfg)  # loads while the other ranks load theirs
            self._wait_ready(start_timeout_s)
            _init(0, world_size, self._store, step_timeout_s, backend="nccl" if gpus else "gloo")
            broadcast_lora(self.local)
        except BaseException:
            self.close()
            raise

    # ---- interface.RunTrainer: rank 0's Trainer answers what is not the update ------------------
    @property
    def step(self) -> int:
        return self.local.step

    @step.setter
    def step(self, value: int) -> None:
        self.local.step = value

    cfg = property(lambda self: self.local.cfg)
    tokenizer = property(lambda self: self.local.tokenizer)
    device = property(lambda self: self.local.device)
    model = property(lambda self: self.local.model)
    checkpoints = property(lambda self: self.local.checkpoints)
    warm_up_s = property(lambda self: self.local.warm_up_s)

    def score_tokens(self, token_ids: list[int]) -> list[float]:
        return self.local.score_tokens(token_ids)

    def save_adapter(self, path: str | Path) -> None:
        self.local.save_adapter(path)

    def save_checkpoint(self, path: str | Path, wait: bool = True, before=None) -> None:
        """Rank 0 writes it (the ranks hold the same weights); the others read it from disk."""
        self.local.save_checkpoint(path, wait=wait, before=before)

    def wait_for_checkpoint(self) -> None:
        self.local.wait_for_checkpoint()

    def release_cached_memory(self) -> None:
        self.local.release_cached_memory()

    def train_step(self, groups) -> dict:
        self._send({"op": "train", "step": self.local.step, "groups": portable_groups(groups)})
        try:
            return ddp_train_step(self.local, groups, 0, self.world_size)
        except Exception as e:
            raise self._failure(f"the distributed step failed ({e})") from e

    def load_checkpoint(self, path: str | Path) -> None:
        # The other ranks read the checkpoint from disk: one whose background write failed is
        # written now (an error if the disk is still full, before any rank changed its state).
        self.local.checkpoints.persist(path)
        self.local.load_checkpoint(path)  # refused here first if corrupt: the ranks keep their state
        self._send({"op": "load", "path": str(path)})

    def close(self) -> None:
        """Stop the ranks (a stop command, then their process groups), leave the process group, and
        wait for rank 0's checkpoint still being written."""
        try:
            if all(p.poll() is None for p in self.workers.procs):
                self._send({"op": "stop"})
                self.workers.wait(timeout_s=30)
        except Exception as e:
            log.warning("trainer ranks did not stop cleanly (%s); stopping their process groups", e)
        finally:
            self.workers.stop()
            if dist.is_initialized():
                dist.destroy_process_group()
            if "local" in self.__dict__:  # not yet there when its load failed
                self.local.close()  # its checkpoint still being written

    def _send(self, command: dict) -> None:
        dead = [(r + 1, p.returncode) for r, p in enumerate(self.workers.procs) if p.poll() is not None]
        if dead:
            raise self._failure(f"trainer rank {dead[0][0]} is not running (exit code {dead[0][1]})")
        self._n += 1
        body = json.dumps(command).encode()
        self._store.set(f"{_CMD}/{self._n}", hmac.new(self._key, body, "sha256").hexdigest().encode() + b" " + body)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        keys = [f"{_READY}/{r}" for r in range(1, self.world_size)]
        while not self._store.check(keys):
            dead = [r + 1 for r, p in enumerate(self.workers.procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise self._failure(f"trainer rank {dead[0]} exited while loading the model" if dead else
                                    f"the trainer ranks did not load the model within {timeout_s:.0f} s")
            time.sleep(0.1)

    def _failure(self, what: str) -> DistributedError:
        rank = next((r + 1 for r, p in enumerate(self.workers.procs) if p.poll() not in (None, 0)), 1)
        path = self.workers.logs[rank - 1]
        return DistributedError(f"{what}. Try: read {path} (rank {rank}), then start the run again with "
                                f"resume=True; last lines:\n{log_tail(path)}")


def loopback_store(world_size: int, timeout: timedelta) -> dist.TCPStore:
    """A master TCPStore listening on 127.0.0.1 only. TCPStore's own listener binds every
    interface whatever host it is given; here it gets a socket bound to 127.0.0.1. Other machines
    cannot reach it; local users can, so commands are signed (RankedTrainer._send) and peers' data
    is never unpickled (all_gather_json). The store owns the socket's descriptor (libuv closes it
    with the store): the Python socket is detached, so nothing closes that number a second time
    (before, the socket's own close, at any garbage collection, closed whatever file had reused the
    number: a server record written at that moment failed with EBADF)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    fd = listener.detach()
    try:
        return dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        _close_if_ours(fd, port)
        raise


def _close_if_ours(fd: int, port: int) -> None:
    """Close `fd` if it is still the listening socket on `port` (a store that failed to start may
    or may not have closed it already; another file may hold the number since)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        ours = sock.getsockname()[1] == port
    except OSError:
        ours = False
    sock.close() if ours else sock.detach()


def make_trainer(cfg: TrainerConfig, ranks: int, run_dir: str | Path, plan) -> RunTrainer:
    """GRPORun's trainer: a Trainer in this process, or with `ranks` > 1 a RankedTrainer over
    the plan's trainer GPUs (one rank each; on a CPU plan, CPU processes with gloo)."""
    if ranks == 1:
        return Trainer(cfg)
    if plan.mode == "colocated":
        raise ValueError(f"trainer_ranks={ranks} needs {ranks} GPUs for the trainer, but the plan shares one GPU "
                         f"(colocated: {plan.describe()}). Try: trainer_ranks=1, or a box with more GPUs")
    return RankedTrainer(cfg, ranks, run_dir, gpus=plan.trainer_gpus if plan.mode == "split" else ())


_KEY_ENV, _CMD, _READY = "ARTSG_RANK_KEY", "artsg/cmd", "artsg/ready"


def follow(rank: int, world_size: int, trainer_config: dict, step_timeout_s: float = 1800.0,
           poll_s: float = 3600.0) -> None:
    """A RankedTrainer's worker rank: load the model, then run rank 0's commands until "stop"
    (or until rank 0's store is gone: the kernel died)."""
    key = bytes.fromhex(os.environ.pop(_KEY_ENV))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timedelta(seconds=step_timeout_s))
    trainer = Trainer(trainer_config_from_json(trainer_config))
    store.set(f"{_READY}/{rank}", b"1")
    _init(rank, world_size, store, step_timeout_s)
    broadcast_lora(trainer)
    for n in itertools.count(1):
        command = _signed_command(store, key, n, poll_s)
        log.info("command %d: %s", n, command["op"])
        if command["op"] == "stop":
            return
        if command["op"] == "load":
            trainer.load_checkpoint(command["path"])
        elif command["op"] == "train":
            trainer.step = command["step"]
            ddp_train_step(trainer, _groups_from_json(command["groups"]), rank, world_size)


def _signed_command(store: dist.TCPStore, key: bytes, n: int, poll_s: float, retry_s: float = 0.2) -> dict:
    """Command `n`, once its value carries rank 0's signature. Anyone on this machine can write
    the store: a value not signed with the ranks' key is logged and ignored (never parsed beyond
    the signature), and the rank waits for rank 0's, which overwrites it."""
    name, refused = f"{_CMD}/{n}", None
    while True:
        try:  # idle between notebook cells for as long as the user likes
            store.wait([name], timedelta(seconds=poll_s))
        except dist.DistStoreError as e:
            if "timeout" not in str(e).lower():
                raise
            continue
        value = store.get(name)
        signature, _, body = value.partition(b" ")
        if hmac.compare_digest(signature, hmac.new(key, body, "sha256").hexdigest().encode()):
            return json.loads(body)
        if value != refused:
            log.warning("command %d is not signed by rank 0: refused (%d bytes ignored)", n, len(value))
            refused = value
        time.sleep(retry_s)


def main(argv: list[str] | None = None) -> int:
    """Rank entry point: `python -m artsg_nb.rl.distributed module:function '{json kwargs}'`."""
    target, kwargs = (argv or sys.argv[1:])[:2]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("ARTSG_DIST_BACKEND") == "nccl":
        torch.cuda.set_device(0)
    try:
        module, name = target.split(":")
        getattr(importlib.import_module(module), name)(rank, world, **json.loads(kwargs))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _init(rank: int, world_size: int, store: dist.Store | None = None, timeout_s: float = 1800.0,
          backend: str | None = None) -> None:
    """Join the process group (torchrun's environment; `store` when given, else env://)."""
    backend = backend or os.environ.get("ARTSG_DIST_BACKEND", "gloo")
    dist.init_process_group(backend, rank=rank, world_size=world_size, store=store,
                            timeout=timedelta(seconds=timeout_s))


if __name__ == "__main__":
    raise SystemExit(main())
