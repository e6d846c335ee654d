"""The rendezvous store of a RankedTrainer (trainer_ranks > 1) against other users of the machine.

Two gloo ranks on the tiny model (this process is rank 0, as in a notebook). Checked:
  - the store listens on 127.0.0.1 only: no socket on another interface, and a connection to
    this host's non-loopback address is refused (before: torch's TCPStore listened on all
    interfaces, so every command could be read from another machine);
  - a command written by someone without the ranks' key — unsigned, or with a forged
    signature, or a pickle — is refused and logged by rank 1, which keeps running and takes
    rank 0's real command next (before: one forged key made rank 1 exit, and the step failed);
  - the ranks' per-step statistics travel as tensors of JSON, never pickles: rank 0 trains a
    step with every unpickler disabled (before: dist.all_gather_object unpickled what peers sent).
"""
from __future__ import annotations

import json
import pickle
import socket
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from artsg_nb.rl.distributed import RankedTrainer
from artsg_nb.rl.trainer import TrainerConfig
from test_distributed import _groups
from waiting import wait_until


def listening_ips(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN" and c.laddr.port == port}


def other_ips() -> list[str]:
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")]


class PickleRefused(Exception):
    pass


def refuse(*args, **kwargs):
    raise PickleRefused("something was unpickled")


@pytest.fixture
def ranked(tiny_model_dir, tmp_path):
    if dist.is_initialized():  # a process group another test of this pytest process left behind
        dist.destroy_process_group()
    trainer = RankedTrainer(TrainerConfig(model_path=str(tiny_model_dir), lora_rank=4, lora_alpha=8, seed=0), 2, tmp_path)
    yield trainer, tmp_path
    trainer.close()


@pytest.mark.slow
def test_rank_store_is_loopback_only_and_refuses_forged_commands(ranked, monkeypatch):
    trainer, run_dir = ranked
    port = trainer._store.port
    assert listening_ips(port) == {"127.0.0.1"}
    for ip in other_ips():
        with pytest.raises(OSError):
            socket.create_connection((ip, port), timeout=2).close()

    intruder = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=5))
    rank1_log = run_dir / "trainer-rank1.log"
    refused = lambda: rank1_log.read_text().count("not signed by rank 0") if rank1_log.exists() else 0  # noqa: E731
    forged = [json.dumps({"op": "stop"}).encode(),  # unsigned
              b"0" * 64 + b" " + json.dumps({"op": "stop"}).encode(),  # forged signature
              pickle.dumps({"op": "stop"})]
    for n, value in enumerate(forged, 1):  # each one read by rank 1 (and refused) before the next
        intruder.set("artsg/cmd/1", value)
        wait_until(lambda: refused() >= n, timeout_s=30, what=f"rank 1 refusing forged command {n}")
    worker = trainer.workers.procs[0]
    assert worker.poll() is None, "a forged command stopped rank 1"

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(c10d, "_unpickler", refuse)
    metrics = trainer.train_step(_groups())
    assert metrics["ranks"] == 2 and trainer.step == 1
    assert worker.poll() is None
    log = (run_dir / "trainer-rank1.log").read_text()
    assert "not signed by rank 0" in log and "command 1: train" in log


def test_the_stores_descriptor_is_closed_once(tmp_path, monkeypatch):
    """The store's listening descriptor is the store's alone: once the store and whatever
    loopback_store returned are gone, a file put at that descriptor's number stays open (before,
    the socket kept beside the store closed the number again at a garbage collection: in CI a
    server record being written at that moment failed with "Bad file descriptor")."""
    import gc
    import os

    from artsg_nb.rl import distributed

    detached = []
    real_detach = socket.socket.detach
    monkeypatch.setattr(socket.socket, "detach", lambda self: detached.append(real_detach(self)) or detached[-1])
    made = distributed.loopback_store(2, timedelta(seconds=5))
    store, rest = (made[0], made[1:]) if isinstance(made, tuple) else (made, ())
    number = rest[0].fileno() if rest else detached[-1]  # the listening socket's descriptor
    assert store.port and listening_ips(store.port) == {"127.0.0.1"}
    del store, made
    gc.collect()
    def closed() -> bool:  # the store's event loop closes its socket on its own thread, soon after
        try:
            os.fstat(number)
        except OSError:
            return True
        return False

    wait_until(closed, timeout_s=10, what="the store kept its listening socket open after it was dropped")
    probe = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT, 0o600)
    if probe != number:  # the number now names this file, whatever held it
        os.dup2(probe, number)
        os.close(probe)
    try:
        del rest
        gc.collect()
        os.write(number, b"still open")
    finally:
        os.close(number)
    assert (tmp_path / "probe").read_text() == "still open"
