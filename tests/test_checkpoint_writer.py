"""Issue 26, off the step's critical path: the trainer's warm-up while the server starts, and the
optimizer state written in the background while the step reloads and the next one rolls out.

Checked by behaviour: a warm trainer trains exactly like a cold one; the checkpoint on disk is the
state at the step it was taken, whatever the trainer did meanwhile; a failed background write is
logged, leaves no half checkpoint and still rolls back; a GRPO step returns while its checkpoint
is still being written, and the checkpoint lands afterwards.
"""
import asyncio
import errno
import logging
import random
import threading
from types import SimpleNamespace

import pytest
import torch

from artsg_nb.rl import checkpoint as checkpoint_module
from artsg_nb.rl import trainer as trainer_module
from artsg_nb.rl.trainer import WARM_UP_SHAPES, Trainer, TrainerConfig
from artsg_nb.rl import lora as lora_module
from artsg_nb.rl.lora import latest_checkpoint, load_version
from artsg_nb.run.session import GRPORun, RunConfig
from scripted_tasks import ADDITION_WITH_SIGNAL
from waiting import poll_until


def _groups():
    g = torch.Generator().manual_seed(1)
    out = []
    for gi in range(2):
        prompt = torch.randint(5, 50, (6,), generator=g).tolist()
        trajs = []
        for i in range(4):
            ids = prompt + torch.randint(5, 50, (3 + i,), generator=g).tolist()
            mask = [0] * 6 + [1] * (len(ids) - 6)
            trajs.append(SimpleNamespace(token_ids=ids, completion_mask=mask, reward=float(i % 2), error=None,
                                         logprobs=[-2.0 if m else 0.0 for m in mask]))
        out.append(SimpleNamespace(trajectories=trajs))
    return out


@pytest.fixture
def make_trainer(tiny_model_dir):
    def make(**kw):
        return Trainer(TrainerConfig(model_path=str(tiny_model_dir), learning_rate=1e-2, seed=0, device="cpu", **kw))
    return make


def _lora(tr):
    return {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}


def _optimizer_tensors(tr):
    return {k: v.clone() for k, v in checkpoint_module.optimizer_state(tr.optimizer)[0].items()}


# ---- warm-up ---------------------------------------------------------------------------------
def test_a_warm_trainer_trains_exactly_like_a_cold_one(make_trainer):
    cold = make_trainer(warm_up=False)
    cold_rng = (torch.get_rng_state(), random.getstate())
    warm = make_trainer(warm_up=True)
    warm_rng = (torch.get_rng_state(), random.getstate())
    assert cold.warm_up_s is None and warm.warm_up_s > 0
    assert torch.equal(cold_rng[0], warm_rng[0]) and cold_rng[1] == warm_rng[1]
    assert all(p.grad is None for p in warm.model.parameters()) and not warm.optimizer.state and warm.step == 0
    before = _lora(cold)
    assert all(torch.equal(before[n], p) for n, p in _lora(warm).items())
    m_cold, m_warm = cold.train_step(_groups()), warm.train_step(_groups())
    assert m_cold["loss"] == m_warm["loss"] and m_cold["grad_norm"] == m_warm["grad_norm"]
    after_cold = _lora(cold)
    assert all(torch.equal(after_cold[n], p) for n, p in _lora(warm).items())


def test_warm_up_runs_the_updates_code_on_two_shapes_and_puts_every_draw_back(make_trainer, monkeypatch):
    tr = make_trainer(warm_up=False)
    seen, real = [], tr.micro_batch_loss

    def drawing_loss(mb, n_seq, n_items):  # a model with dropout draws from the RNG in its forward
        seen.append(tuple(mb.input_ids.shape))
        torch.rand(3), random.random()
        return real(mb, n_seq, n_items)

    monkeypatch.setattr(tr, "micro_batch_loss", drawing_loss)
    scored = []
    monkeypatch.setattr(tr, "score_tokens", lambda ids, real=tr.score_tokens: scored.append(len(ids)) or real(ids))
    rng, py = torch.get_rng_state(), random.getstate()
    tr.warm_up()
    assert seen == list(WARM_UP_SHAPES) and len({r for r, _ in seen}) == len({n for _, n in seen}) == 2
    assert scored == [WARM_UP_SHAPES[0][1]]
    assert torch.equal(torch.get_rng_state(), rng) and random.getstate() == py
    assert all(p.grad is None for p in tr.model.parameters())


# ---- checkpoints written in the background ------------------------------------------------------
@pytest.fixture
def held_writes(monkeypatch):
    """write_checkpoint waits until `release` is set (at most 30 s): a write still under way."""
    release, started = threading.Event(), threading.Event()
    real = checkpoint_module.write_checkpoint

    def held(snapshot, path, before=None):
        started.set()
        release.wait(30)
        return real(snapshot, path, before)

    monkeypatch.setattr(checkpoint_module, "write_checkpoint", held)
    return SimpleNamespace(release=release, started=started)


def test_the_background_checkpoint_is_the_state_it_was_taken_at(make_trainer, tmp_path, held_writes):
    a = make_trainer(warm_up=False)
    a.train_step(_groups())
    a.save_adapter(tmp_path)
    at_step_1 = _optimizer_tensors(a)
    a.save_checkpoint(tmp_path, wait=False)
    assert held_writes.started.wait(10) and not (tmp_path / "trainer" / "trainer_state.json").exists()
    a.train_step(_groups())  # moves the optimizer state while the write waits
    held_writes.release.set()
    a.wait_for_checkpoint()
    b = make_trainer(warm_up=False)
    b.load_checkpoint(tmp_path)
    assert b.step == 1
    loaded = _optimizer_tensors(b)
    assert loaded.keys() == at_step_1.keys() and all(torch.equal(loaded[k], at_step_1[k]) for k in at_step_1)


def test_the_next_update_waits_until_the_writer_has_copied_the_optimizer(make_trainer, tmp_path, monkeypatch):
    """The optimizer state is copied in the writer's thread, off the reload's path; an update
    that moved it first would put the next step's state into this step's checkpoint."""
    a = make_trainer(warm_up=False)
    a.train_step(_groups())
    a.save_adapter(tmp_path)
    at_step_1, lr_at_step_1 = _optimizer_tensors(a), a.optimizer.param_groups[0]["lr"]
    copying, release, stepped_before_release = threading.Event(), threading.Event(), []
    real_copies, real_step = trainer_module.host_copies, a.optimizer.step

    def held_copies(named):
        copying.set()
        release.wait(30)
        return real_copies(named)

    def recording_step(*args, **kwargs):
        stepped_before_release.append(not release.is_set())
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "host_copies", held_copies)
    monkeypatch.setattr(a.optimizer, "step", recording_step)
    a.save_checkpoint(tmp_path, wait=False)
    assert copying.wait(10), "the copy is made in the writer's thread"
    a.optimizer.param_groups[0]["lr"] = 0.5  # e.g. an override restored after the step (art.backend)
    update = threading.Thread(target=a.train_step, args=(_groups(),))
    update.start()
    # time for an update that nothing holds to reach its optimizer step
    poll_until(lambda: stepped_before_release or not update.is_alive(), timeout_s=5, poll_s=0.1)
    release.set()
    update.join(60)
    assert stepped_before_release == [False], "the update stepped the optimizer before the copy was made"
    a.wait_for_checkpoint()
    b = make_trainer(warm_up=False)
    b.load_checkpoint(tmp_path)
    loaded = _optimizer_tensors(b)
    assert b.step == 1 and all(torch.equal(loaded[k], at_step_1[k]) for k in at_step_1)
    assert b.optimizer.param_groups[0]["lr"] == lr_at_step_1, "the checkpoint holds the lr of its own step"


def test_a_failed_copy_is_raised_before_the_next_update_moves_anything(make_trainer, tmp_path, monkeypatch):
    tr = make_trainer(warm_up=False)
    tr.train_step(_groups())
    tr.save_adapter(tmp_path)
    before = _optimizer_tensors(tr)

    def out_of_memory(named):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(trainer_module, "host_copies", out_of_memory)
    tr.save_checkpoint(tmp_path, wait=False)
    with pytest.raises(RuntimeError, match="simulated"):
        tr.train_step(_groups())
    assert tr.step == 1 and all(torch.equal(v, before[k]) for k, v in _optimizer_tensors(tr).items())
    assert not checkpoint_module.is_complete(tmp_path)


def test_a_closed_writer_refuses_new_checkpoints(make_trainer, tmp_path):
    tr = make_trainer(warm_up=False)
    tr.close()
    with pytest.raises(checkpoint_module.CheckpointError, match="closed"):
        tr.save_checkpoint(tmp_path, wait=False)


def test_a_failed_background_write_is_logged_leaves_no_half_checkpoint_and_still_rolls_back(
        make_trainer, tmp_path, monkeypatch, caplog):
    tr = make_trainer(warm_up=False)
    tr.train_step(_groups())
    tr.save_adapter(tmp_path)
    weights, optimizer = _lora(tr), _optimizer_tensors(tr)
    real_save = checkpoint_module.save_tensors

    def disk_full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 64)  # half written
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "save_tensors", disk_full)
    with caplog.at_level(logging.WARNING, logger="artsg_nb.rl.checkpoint"):
        tr.save_checkpoint(tmp_path, wait=False)
        tr.wait_for_checkpoint()
    assert "could not be written" in caplog.text and "No space left" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "trainer"]
    assert not list((tmp_path / "trainer").iterdir()) and not checkpoint_module.is_complete(tmp_path)
    for _ in range(2):  # the next update, whose adapter then cannot be saved: roll back (twice: a redo fails too)
        tr.train_step(_groups())
        tr.load_checkpoint(tmp_path)
        assert tr.step == 1
        assert all(torch.equal(weights[n], p) for n, p in _lora(tr).items())
        assert all(torch.equal(optimizer[k], v) for k, v in _optimizer_tensors(tr).items())
    monkeypatch.setattr(checkpoint_module, "save_tensors", real_save)
    tr.checkpoints.persist(tmp_path)  # space again: written now, for readers of the disk
    assert checkpoint_module.is_complete(tmp_path) and tr.checkpoints.unwritten(tmp_path) is None


def test_a_bug_in_the_background_write_is_raised_not_logged(make_trainer, tmp_path, monkeypatch):
    tr = make_trainer(warm_up=False)
    tr.save_adapter(tmp_path)
    monkeypatch.setattr(checkpoint_module, "save_tensors", lambda *a, **k: 1 / 0)
    tr.save_checkpoint(tmp_path, wait=False)
    with pytest.raises(ZeroDivisionError):
        tr.wait_for_checkpoint()


def test_a_version_folder_shows_the_server_only_the_adapter_and_old_runs_still_load(make_trainer, tmp_path):
    """SGLang reads every *.safetensors file at the top of an adapter folder as weights (its
    DefaultModelLoader globs them): the optimizer state lives in trainer/, and a half-written one
    can never reach a load. A run saved before (checkpoint beside the adapter) still resumes."""
    tr = make_trainer(warm_up=False)
    tr.train_step(_groups())
    tr.save_adapter(tmp_path / "new")
    tr.save_checkpoint(tmp_path / "new")
    assert [f.name for f in (tmp_path / "new").glob("*.safetensors")] == ["adapter_model.safetensors"]
    assert checkpoint_module.is_complete(tmp_path / "new")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for f in (tmp_path / "new").glob("*.*"):
        (legacy / f.name).write_bytes(f.read_bytes())
    for f in (tmp_path / "new" / "trainer").iterdir():
        (legacy / f.name).write_bytes(f.read_bytes())
    assert checkpoint_module.checkpoint_dir(legacy) == legacy and checkpoint_module.is_complete(legacy)
    other = make_trainer(warm_up=False)
    other.load_checkpoint(legacy)
    assert other.step == 1
    mine, theirs = _optimizer_tensors(tr), _optimizer_tensors(other)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_step_returns_while_its_checkpoint_is_written_and_it_lands_after(tiny_model_dir, tmp_path, held_writes):
    cfg = RunConfig(task=ADDITION_WITH_SIGNAL, engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"),
                    group_size=4, groups_per_step=2, verify_adapter=False, verbose=False, keep_adapters=1)
    with GRPORun(cfg) as run:  # policy-step-0 is written at start, synchronously
        row = asyncio.run(run.step())
        version = run.run_dir / "adapters" / f"policy-step-{row['step']}"
        assert not row.get("update_skipped") and run.adapter == version.name
        assert held_writes.started.wait(10) and not checkpoint_module.is_complete(version)
        # keep_adapters=1 pruned what it could, but not the newest complete checkpoint: a kernel
        # killed now resumes from it
        assert latest_checkpoint(run.run_dir / "adapters", row["step"]).step == 0
        held_writes.release.set()
        run.trainer.wait_for_checkpoint()
        assert checkpoint_module.is_complete(version)
        assert (version / "trainer" / "optimizer.safetensors").exists()
        assert load_version(run.run_dir / "adapters", row["step"]).sha256  # sealed before the checkpoint
        asyncio.run(run.step())  # step 1's write is done now: step 0 is no longer needed and goes
        kept = {p.name for p in (run.run_dir / "adapters").glob("policy-step-*")}
        assert "policy-step-0" not in kept and "policy-step-2" in kept and kept <= {"policy-step-1", "policy-step-2"}
        run.trainer.wait_for_checkpoint()
        assert latest_checkpoint(run.run_dir / "adapters", 2).step == 2


def test_a_seal_that_fails_for_want_of_disk_leaves_the_version_served_and_not_resumable(
        tiny_model_dir, tmp_path, monkeypatch, caplog):
    """The adapter's checksum and flush run in the checkpoint writer's thread; a full disk there is a
    failed checkpoint (logged, the run goes on serving the adapter), never a version that a resume
    would take without its checksum."""
    cfg = RunConfig(task=ADDITION_WITH_SIGNAL, engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"),
                    group_size=4, groups_per_step=2, verify_adapter=False, verbose=False)

    def disk_full(folder):
        raise OSError(errno.ENOSPC, "No space left on device")

    with GRPORun(cfg) as run:
        monkeypatch.setattr(lora_module, "_write_checksum", disk_full)
        with caplog.at_level(logging.WARNING, logger="artsg_nb.rl.checkpoint"):
            row = asyncio.run(run.step())
            run.trainer.wait_for_checkpoint()
        version = run.run_dir / "adapters" / f"policy-step-{row['step']}"
        assert run.adapter == version.name and (version / "adapter_model.safetensors").exists()
        assert "could not be written" in caplog.text and "No space left" in caplog.text
        assert not checkpoint_module.is_complete(version) and not (version / "sha256.txt").exists()
        assert latest_checkpoint(run.run_dir / "adapters", row["step"]).step == 0
        monkeypatch.undo()
        row = asyncio.run(run.step())  # space again: the next version is sealed and complete
        run.trainer.wait_for_checkpoint()
        assert latest_checkpoint(run.run_dir / "adapters", row["step"]).step == row["step"]


# ---- the saved adapter ----------------------------------------------------------------------
def test_the_saved_adapter_holds_peft_state_dict(make_trainer, tmp_path):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    tr = make_trainer(warm_up=False)
    tr.train_step(_groups())
    tr.save_adapter(tmp_path / "v")
    saved = load_file(str(tmp_path / "v" / "adapter_model.safetensors"))
    state = get_peft_model_state_dict(tr.model)
    assert saved.keys() == state.keys() and all(torch.equal(saved[k], state[k]) for k in state)


# ---- a version whose seal is pending or failed ----------------------------------------------
def _unsealed_version(tr, adapters, step, seal):
    """Save `tr`'s adapter as version `step` the way a GRPO step does, with `seal` as its seal."""
    from artsg_nb.rl.lora import save_adapter_atomic
    v = save_adapter_atomic(tr.save_adapter, adapters, step, durable=False)
    tr.save_checkpoint(v.path, wait=False, before=lambda: seal(v))
    return v


def test_a_pipelined_rollback_works_while_the_seal_is_pending_or_after_it_failed(make_trainer, tmp_path, monkeypatch):
    from artsg_nb.run.clock import PhaseClock
    from artsg_nb.run.versions import AdapterVersions, VerifyPolicy
    tr = make_trainer(warm_up=False)
    tr.train_step(_groups())
    weights, optimizer = _lora(tr), _optimizer_tensors(tr)
    release = threading.Event()

    def slow_then_full(v):
        release.wait(10)
        raise OSError(errno.ENOSPC, "No space left on device")
    v = _unsealed_version(tr, tmp_path / "adapters", 1, slow_then_full)
    tr.train_step(_groups())  # the next update, cancelled: rolled back while the seal still runs
    versions = AdapterVersions(tr, tmp_path, supervisor=None, clock=PhaseClock(), scrape=None, policy=VerifyPolicy())
    threading.Timer(0.2, release.set).start()
    versions.roll_back(1)
    assert not (v.path / "sha256.txt").exists() and tr.step == 1
    assert all(torch.equal(weights[n], p) for n, p in _lora(tr).items())
    assert all(torch.equal(optimizer[k], x) for k, x in _optimizer_tensors(tr).items())


def test_persist_seals_the_adapter_before_its_checkpoint(make_trainer, tmp_path):
    from artsg_nb.rl.lora import seal_version
    tr = make_trainer(warm_up=False)
    tr.train_step(_groups())
    tries = []

    def full_once(v):
        tries.append(1)
        if len(tries) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        seal_version(v)
    v = _unsealed_version(tr, tmp_path / "adapters", 1, full_once)
    tr.wait_for_checkpoint()
    assert not checkpoint_module.is_complete(v.path) and not (v.path / "sha256.txt").exists()
    tr.checkpoints.persist(v.path)  # space again (RankedTrainer's other ranks read the disk)
    assert checkpoint_module.is_complete(v.path) and load_version(tmp_path / "adapters", 1).sha256
    assert latest_checkpoint(tmp_path / "adapters", 1).step == 1


def test_resume_skips_a_complete_checkpoint_whose_adapter_has_no_checksum(make_trainer, tmp_path):
    from artsg_nb.rl.lora import save_adapter_atomic
    tr = make_trainer(warm_up=False)
    v1 = save_adapter_atomic(tr.save_adapter, tmp_path / "adapters", 1)
    tr.save_checkpoint(v1.path)
    v2 = save_adapter_atomic(tr.save_adapter, tmp_path / "adapters", 2, durable=False)
    tr.save_checkpoint(v2.path)  # a checkpoint written without the seal (never by the package itself)
    assert checkpoint_module.is_complete(v2.path)
    assert latest_checkpoint(tmp_path / "adapters", 2).step == 1
