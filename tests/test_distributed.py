"""The data-parallel GRPO update (artsg_nb/rl/distributed.py) equals the single-process one.

Two gloo ranks, launched as worker processes the way a notebook would (own process groups,
torchrun-style environment), each take half of the same batch; rank 0 saves the adapter. Its
LoRA weights must match Trainer.train_step's on the whole batch, for each loss normalisation
(dapo divides by the batch's completion tokens, grpo and dr_grpo by its sequences), which holds
only if every rank normalises by the whole batch and the gradients are summed, not averaged.
Marked slow (~1 min for the file on 2 cores: two ranks load the tiny model per loss type); its own
suite, `make test-ranks` (tools/run_tests.sh).
"""
import json
import pickle
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from artsg_nb.rl.distributed import launch, shard
from artsg_nb.rl.grpo import GRPOConfig
from artsg_nb.rl.trainer import Trainer, TrainerConfig


def _groups(vocab=50):
    """Three groups of uneven lengths (so shards differ in tokens: a mean of rank means would be wrong)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for gi in range(3):
        prompt = torch.randint(5, vocab, (5 + gi,), generator=g).tolist()
        trajs = []
        for i in range(3):
            ids = prompt + torch.randint(5, vocab, (2 + 3 * i + gi,), generator=g).tolist()
            mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
            trajs.append(SimpleNamespace(token_ids=ids, completion_mask=mask, logprobs=[-2.0 if m else 0.0 for m in mask],
                                         reward=float((i + gi) % 2), error=None))
        out.append(SimpleNamespace(trajectories=trajs))
    return out


def test_both_trainers_implement_the_declared_interface_themselves(tiny_model_dir):
    """A run holds its trainer as an rl.interface.RunTrainer: the one-process Trainer and the
    RankedTrainer of several ranks have every member of it written out (RankedTrainer forwarded
    through __getattr__ before)."""
    from artsg_nb.rl.distributed import RankedTrainer
    from artsg_nb.rl.interface import TRAINER_MEMBERS, RunTrainer

    assert "__getattr__" not in dir(RankedTrainer)
    missing = [name for name in TRAINER_MEMBERS if not hasattr(RankedTrainer, name)]  # its properties too
    assert not missing, missing
    trainer = Trainer(TrainerConfig(model_path=str(tiny_model_dir), lora_rank=4, lora_alpha=8, warm_up=False))
    try:
        assert isinstance(trainer, RunTrainer) and all(hasattr(trainer, name) for name in TRAINER_MEMBERS)
    finally:
        trainer.close()
    assert set(TRAINER_MEMBERS) == {n for n in dir(RunTrainer) if not n.startswith("_")} | set(RunTrainer.__annotations__)


def test_shard_covers_every_item_once():
    assert [shard(5, r, 2) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert sum((shard(7, r, 3) for r in range(3)), []) == list(range(7))
    assert shard(1, 1, 2) == []


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_gloo_ranks_update_the_lora_like_one_process(tiny_model_dir, tmp_path, loss_type):
    groups = _groups()
    (tmp_path / "groups.pkl").write_bytes(pickle.dumps(groups))
    cfg = dict(model_path=str(tiny_model_dir), learning_rate=1e-2, seed=0, device="cpu", use_unsloth=False,
               micro_batch_tokens=40, grpo={"loss_type": loss_type})  # micro-batches within each rank too
    workers = launch("artsg_nb.rl.distributed:train_on_groups", 2,
                     dict(trainer_config=cfg, groups_path=str(tmp_path / "groups.pkl"), out_dir=str(tmp_path / "ddp")),
                     tmp_path / "logs")
    workers.wait(timeout_s=300)

    one = Trainer(TrainerConfig(**{**cfg, "grpo": GRPOConfig(loss_type=loss_type)}))
    before = {k: v.detach().clone() for k, v in one.model.named_parameters() if v.requires_grad}
    single = one.train_step(groups)
    one.save_adapter(tmp_path / "single")

    a, b = load_file(tmp_path / "single" / "adapter_model.safetensors"), load_file(tmp_path / "ddp" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    moved = max((p - before[k]).abs().max().item() for k, p in one.model.named_parameters() if p.requires_grad)
    assert moved > 1e-4, "the step did not move the LoRA weights: the comparison would prove nothing"
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-4, f"DDP update differs from one process by {worst:.2e}"
    metrics = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    assert metrics["ranks"] == 2 and metrics["loss"] == pytest.approx(single["loss"], rel=1e-4, abs=1e-6)


# ---- RunConfig(trainer_ranks=2): the kernel is rank 0, one worker process is rank 1 --------------
def _run_config(tiny_model_dir, run_dir, **kw):
    from artsg_nb.run.session import RunConfig
    from scripted_tasks import ADDITION_WITH_SIGNAL  # every step trains: its loss and adapter are compared
    return RunConfig(task=ADDITION_WITH_SIGNAL, engine="cpu", model_path=str(tiny_model_dir), run_dir=str(run_dir),
                     group_size=4, groups_per_step=4, verbose=False, **kw)


@pytest.mark.slow
def test_a_run_with_two_trainer_ranks_trains_like_one(tiny_model_dir, tmp_path):
    """Same seed, same rollouts: two trainer ranks give the one-rank run's step-1 adapter and loss,
    the rank process lives across steps and is gone after stop()."""
    import asyncio

    from artsg_nb.rl.distributed import RankedTrainer
    from artsg_nb.run.session import GRPORun

    rows = {}
    for ranks in (1, 2):
        with GRPORun(_run_config(tiny_model_dir, tmp_path / f"r{ranks}", trainer_ranks=ranks)) as run:
            assert isinstance(run.trainer, RankedTrainer) == (ranks == 2)
            rows[ranks] = [asyncio.run(run.step()) for _ in range(2)]
            if ranks == 2:
                worker = run.trainer.workers.procs[0]
                assert worker.poll() is None, "the rank process did not live across steps"
        if ranks == 2:
            assert worker.poll() is not None, "the rank process outlived run.stop()"
            rank_log = (tmp_path / "r2" / "trainer-rank1.log").read_text()
            assert "command 2: train" in rank_log and "command 3: stop" in rank_log
    one, two = rows[1][0], rows[2][0]
    assert two["trainer_ranks"] == 2 and "trainer_ranks" not in one
    assert two["reward_mean"] == one["reward_mean"], "the rollouts differ: the comparison would prove nothing"
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-3)
    assert two["is_raw_ratio_mean"] == pytest.approx(one["is_raw_ratio_mean"], abs=1e-4)
    a = load_file(tmp_path / "r1" / "adapters" / "policy-step-1" / "adapter_model.safetensors")
    b = load_file(tmp_path / "r2" / "adapters" / "policy-step-1" / "adapter_model.safetensors")
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-4, f"two ranks' step-1 adapter differs from one rank's by {worst:.2e}"


@pytest.mark.slow
def test_a_dead_trainer_rank_fails_the_step_with_its_log_and_a_resume_continues(tiny_model_dir, tmp_path):
    import asyncio
    import os
    import signal

    from artsg_nb.rl.distributed import DistributedError
    from artsg_nb.run.session import GRPORun

    run = GRPORun(_run_config(tiny_model_dir, tmp_path / "run", trainer_ranks=2)).start()
    try:
        asyncio.run(run.step())
        worker = run.trainer.workers.procs[0]
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        with pytest.raises(DistributedError, match=r"rank 1 .*trainer-rank1\.log"):
            asyncio.run(run.step())
    finally:
        run.stop()
    # Nothing lost: step 1 stays, and a resumed run (rank 1 loads the checkpoint too) goes on.
    with GRPORun(_run_config(tiny_model_dir, tmp_path / "run", trainer_ranks=2, resume=True)) as run:
        assert run.trainer.step == 1
        row = asyncio.run(run.step())
        assert row["step"] == 2 and row["trainer_ranks"] == 2
        assert list(run.history.df["step"]) == [1, 2]
    assert "command 1: load" in (tmp_path / "run" / "trainer-rank1.log").read_text()


@pytest.mark.slow
def test_a_rollback_to_a_checkpoint_only_in_memory_reaches_every_rank(tiny_model_dir, tmp_path, monkeypatch):
    """Rank 0 keeps the snapshot of a checkpoint whose background write failed; the other ranks
    read checkpoints from disk, so a rollback writes it first, or fails before any rank moves."""
    import errno

    from artsg_nb.rl import checkpoint as checkpoint_module
    from artsg_nb.rl.checkpoint import CheckpointError, is_complete
    from artsg_nb.rl.distributed import RankedTrainer

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    cfg = TrainerConfig(model_path=str(tiny_model_dir), learning_rate=1e-2, seed=0, device="cpu", use_unsloth=False,
                        warm_up=False)
    trainer, groups, version = RankedTrainer(cfg, 2, tmp_path / "ranks"), _groups(), tmp_path / "policy-step-1"
    try:
        trainer.train_step(groups)
        trainer.save_adapter(version)
        real_save = checkpoint_module.save_tensors
        monkeypatch.setattr(checkpoint_module, "save_tensors", disk_full)
        trainer.save_checkpoint(version, wait=False)
        trainer.wait_for_checkpoint()
        assert not is_complete(version)
        trainer.train_step(groups)  # step 2, whose adapter then cannot be saved: back to step 1
        with pytest.raises(CheckpointError, match="only in memory.*free disk space"):
            trainer.load_checkpoint(version)  # the disk still full: no rank has moved
        assert trainer.step == 2 and trainer.train_step(groups)["ranks"] == 2
        monkeypatch.setattr(checkpoint_module, "save_tensors", real_save)
        trainer.load_checkpoint(version)  # written now, then read by every rank
        assert is_complete(version) and trainer.step == 1
        assert trainer.train_step(groups)["ranks"] == 2  # rank 1 is alive and in step
    finally:
        trainer.close()
