"""The LoRA trainer on the tiny model: one step moves only adapter weights, micro-batching does
not change the update, checkpoints restore everything a resumed run needs."""
import math
from types import SimpleNamespace

import pytest
import torch

from artsg_nb.rl.grpo import GRPOConfig
from artsg_nb.rl.trainer import CheckpointError, Trainer, TrainerConfig, _micro_batches
from trainer_groups import groups, traj




@pytest.fixture
def make_trainer(tiny_model_dir):
    def make(**kw):
        cfg = TrainerConfig(model_path=str(tiny_model_dir), learning_rate=1e-2, seed=0, device="cpu",
                            grpo=GRPOConfig(**kw.pop("grpo", {})), **kw)
        return Trainer(cfg)
    return make


def test_step_changes_only_lora_weights(make_trainer):
    tr = make_trainer()
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    # B starts at 0, so the first step moves lora_B; a second moves lora_A too.
    m1 = tr.train_step(groups())
    tr.train_step(groups())
    after = dict(tr.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed, "no weight changed"
    assert all("lora_" in n for n in changed), f"base weights changed: {sorted(n for n in changed if 'lora_' not in n)}"
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)
    assert math.isfinite(m1["loss"]) and m1["sequences"] == 8 and tr.step == 2


def test_micro_batching_gives_the_same_update(make_trainer):
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        ref, small = make_trainer(grpo={"loss_type": loss_type}), make_trainer(grpo={"loss_type": loss_type}, micro_batch_tokens=16)
        assert len(_micro_batches([10] * 8, 16)) > 1
        # SGD, not Adam: Adam's first step is ±lr wherever a gradient is non-zero, so a rounding-level
        # difference in a near-zero gradient would flip a weight by 2·lr. SGD shows the gradients.
        for tr in (ref, small):
            tr.optimizer = torch.optim.SGD([p for p in tr.model.parameters() if p.requires_grad], lr=1.0)
        m_ref, m_small = ref.train_step(groups()), small.train_step(groups())
        assert m_ref["loss"] == pytest.approx(m_small["loss"], rel=1e-5, abs=1e-7)
        for (n, p), (_, q) in zip(ref.model.named_parameters(), small.model.named_parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{loss_type}: {n}")


def test_scores_at_the_sampling_temperature(make_trainer):
    tr = make_trainer(grpo={"temperature": 0.7})
    ids = [5, 9, 11, 7, 20]
    lp = tr.score_tokens(ids)
    logits = tr.model(input_ids=torch.tensor([ids])).logits[0, :-1].float() / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(lp), expected.detach(), rtol=1e-5, atol=1e-5)


def test_checkpoint_roundtrip_and_mismatch(make_trainer, tmp_path):
    a = make_trainer()
    a.train_step(groups())
    a.save_adapter(tmp_path)
    a.save_checkpoint(tmp_path)
    b = make_trainer()
    b.load_checkpoint(tmp_path)
    assert b.step == 1
    ma, mb = a.train_step(groups()), b.train_step(groups())  # same state → same next step
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-6)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(p, q, msg=n)
    with pytest.raises(CheckpointError, match="lora_rank"):
        make_trainer(lora_rank=8).load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="incomplete"):
        make_trainer().load_checkpoint(tmp_path / "nowhere")


def test_no_valid_trajectory_is_a_clear_error(make_trainer):
    g = groups()
    for t in g[0].trajectories + g[1].trajectories:
        t.error = "boom"
    with pytest.raises(ValueError, match="no valid trajectory"):
        make_trainer().train_step(g)


def test_packed_and_padded_give_the_same_loss_and_gradients(make_trainer):
    for loss_type in ("grpo", "dapo"):
        padded = make_trainer(grpo={"loss_type": loss_type}, packing=False, micro_batch_tokens=40)
        packed = make_trainer(grpo={"loss_type": loss_type}, packing=True, micro_batch_tokens=40)
        assert packed.packing and not padded.packing
        for tr in (padded, packed):
            tr.optimizer = torch.optim.SGD([p for p in tr.model.parameters() if p.requires_grad], lr=1.0)
        batch = padded.make_batch(groups())
        lp_pad = padded.score(batch.input_ids, batch.attention_mask)
        lp_pack = packed.score_packed(batch.input_ids, batch.attention_mask)
        valid = (batch.attention_mask[:, 1:] * batch.attention_mask[:, :-1]).bool()
        torch.testing.assert_close(lp_pack[valid], lp_pad[valid], rtol=1e-4, atol=1e-5)
        assert (lp_pack[~valid] == 0).all()
        m_pad, m_pack = padded.train_step(groups()), packed.train_step(groups())
        assert m_pad["loss"] == pytest.approx(m_pack["loss"], rel=1e-4, abs=1e-6)
        for (n, p), (_, q) in zip(padded.model.named_parameters(), packed.model.named_parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"{loss_type}: {n}")


def test_save_adapter_writes_what_save_pretrained_writes(make_trainer, tmp_path):
    """After each update, a rollback (load_checkpoint) and a parameter given new storage: the
    adapter's state dict is built once and reused (trainer._adapter_state), and must still hold
    the live weights."""
    import json
    from safetensors.torch import load_file
    tr = make_trainer()

    def assert_saved_as_peft_does(name):
        tr.save_adapter(tmp_path / name)
        tr.model.save_pretrained(str(tmp_path / f"{name}-peft"), safe_serialization=True)
        fast = load_file(tmp_path / name / "adapter_model.safetensors")
        ref = load_file(tmp_path / f"{name}-peft" / "adapter_model.safetensors")
        assert fast.keys() == ref.keys() and all(torch.equal(fast[k], ref[k]) for k in ref), name
        assert (json.loads((tmp_path / name / "adapter_config.json").read_text())
                == json.loads((tmp_path / f"{name}-peft" / "adapter_config.json").read_text()))
        return fast

    tr.train_step(groups())
    first = assert_saved_as_peft_does("step1")
    assert tr._adapter_views is not None, "the state dict is kept for the next save"
    tr.save_checkpoint(tmp_path / "step1")
    tr.train_step(groups())
    assert_saved_as_peft_does("step2")
    tr.load_checkpoint(tmp_path / "step1")
    rolled_back = assert_saved_as_peft_does("rolled-back")
    assert all(torch.equal(first[k], rolled_back[k]) for k in first)
    lora = next(p for p in tr.model.parameters() if p.requires_grad)
    lora.data = lora.data + 1.0  # new storage: the reused state dict would still show the old one
    assert_saved_as_peft_does("new-storage")
    assert tr.model.peft_config["default"].inference_mode is False  # training mode restored


def test_auto_keeps_unsloth_off_the_narrow_heads_it_was_seen_to_get_wrong(tmp_path, tiny_model_dir):
    """On the H200 Unsloth trained the tiny model (head_dim 16) into an adapter the server scored
    5.5 nats away from it; the models it serves correctly have head_dim 64."""
    import json

    from artsg_nb.rl.trainer import unsloth_fits

    assert not unsloth_fits(str(tiny_model_dir))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576, "num_attention_heads": 9}))
    assert unsloth_fits(str(tmp_path))  # SmolLM2-135M's shape
    assert unsloth_fits("HuggingFaceTB/SmolLM2-135M-Instruct")  # no local config: Unsloth decides


# ---- fused logprobs (rl/logprobs.py), length-sorted micro-batches, the GPU budget --------------
from artsg_nb.rl import logprobs as lp_mod  # noqa: E402
from artsg_nb.rl.trainer import GPU_MICRO_BATCH_TOKENS, auto_micro_batch_tokens  # noqa: E402


def _sgd(tr):
    tr.optimizer = torch.optim.SGD([p for p in tr.model.parameters() if p.requires_grad], lr=1.0)
    return tr


def test_fused_path_scores_only_the_wanted_tokens_and_trains_as_the_logits_do(make_trainer):
    """The fused code path (run here through TorchLogProb, the kernel's plain-torch twin) gives the
    logits path's logprobs where wanted, 0 elsewhere, and the same update."""
    plain, fused = _sgd(make_trainer(grpo={"temperature": 0.8})), _sgd(make_trainer(grpo={"temperature": 0.8}))
    assert plain.logprob_kernel is None  # no CUDA here: the trainer scores with the logits
    fused.logprob_kernel, fused._fused_checked = lp_mod.TorchLogProb, False  # as a GPU trainer starts
    batch = plain.make_batch(groups())
    wanted = batch.completion_mask.bool()
    a = plain.score(batch.input_ids, batch.attention_mask, wanted)
    b = fused.score(batch.input_ids, batch.attention_mask, wanted)
    torch.testing.assert_close(b[wanted], a[wanted], rtol=1e-5, atol=1e-5)
    assert (a[~wanted] == 0).all() and (b[~wanted] == 0).all() and (a[wanted] < 0).all()
    m_plain, m_fused = plain.train_step(groups()), fused.train_step(groups())
    assert m_plain["loss"] == pytest.approx(m_fused["loss"], rel=1e-5, abs=1e-7)
    for (n, p), (_, q) in zip(plain.model.named_parameters(), fused.model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    assert fused.logprob_kernel is lp_mod.TorchLogProb  # it passed its check and stayed


def test_a_fused_kernel_that_disagrees_is_dropped_for_the_logits(make_trainer, caplog):
    class Wrong(lp_mod.TorchLogProb):
        @staticmethod
        def apply(*args):
            out = lp_mod.TorchLogProb.apply(*args)
            return (out[0] - 1.0, *out[1:])  # one nat off on every token

    tr = make_trainer()
    tr.logprob_kernel, tr._fused_checked = Wrong, False
    with caplog.at_level("WARNING"):
        m = tr.train_step(groups())
    assert tr.logprob_kernel is None and "scoring with the logits instead" in caplog.text
    ref = make_trainer().train_step(groups())
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-6)  # the update used the logits


def test_micro_batches_group_similar_lengths_within_the_budget():
    lengths = [30, 5, 28, 6, 31, 4, 29, 7]
    micro_batches = _micro_batches(lengths, 64)
    assert sorted(i for g in micro_batches for i in g) == list(range(8))  # each sequence once
    assert all(len(g) * max(lengths[i] for i in g) <= 64 for g in micro_batches)
    assert all(g == sorted(g) for g in micro_batches)
    padded = sum(len(g) * max(lengths[i] for i in g) for g in micro_batches)
    consecutive = [[0, 1], [2, 3], [4, 5], [6, 7]]  # what taking them in order gave (each pair fits 64)
    assert padded < sum(len(g) * max(lengths[i] for i in g) for g in consecutive)
    assert _micro_batches([10], 4) == [[0]]  # one sequence over the budget still trains, alone


def test_auto_budget_follows_free_memory_the_models_shape_and_the_logits():
    small = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152)
    big = SimpleNamespace(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, vocab_size=152064)
    gib = 1 << 30
    lo, hi = GPU_MICRO_BATCH_TOKENS
    assert auto_micro_batch_tokens(small, 80 * gib, fused=True) == hi
    assert lo <= auto_micro_batch_tokens(small, 4 * gib, fused=True) < hi
    assert auto_micro_batch_tokens(small, 8 * gib, fused=False) < auto_micro_batch_tokens(small, 8 * gib, fused=True)
    assert auto_micro_batch_tokens(big, 20 * gib, fused=True) < auto_micro_batch_tokens(small, 20 * gib, fused=True)
    assert auto_micro_batch_tokens(big, 0, fused=False) == lo
    assert all(auto_micro_batch_tokens(small, f * gib, True) % 1024 == 0 for f in (1, 3, 7, 11))


def test_out_of_gpu_memory_redoes_the_update_with_half_the_budget(make_trainer, caplog):
    """A micro-batch over 2048 tokens "runs out of memory" after part of its backward: the update is
    redone from zero gradients in smaller micro-batches and equals one made that way from the start."""
    batch = [SimpleNamespace(trajectories=[traj(list(range(5, 5 + n)), 4, float(i % 2))
                                            for i, n in enumerate([300, 290, 280, 270, 260, 250, 240, 230, 220, 210])])]
    ref = _sgd(make_trainer(micro_batch_tokens=2048))
    tr = _sgd(make_trainer(micro_batch_tokens=4096))
    real = tr.micro_batch_loss

    def limited(mb, n_seq, n_items):
        loss, metrics, logps = real(mb, n_seq, n_items)
        if mb.input_ids.numel() > 2048:
            loss.backward(retain_graph=True)  # gradients half-accumulated when it fails
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return loss, metrics, logps

    tr.micro_batch_loss = limited
    with caplog.at_level("WARNING"):
        m = tr.train_step(batch)
    assert m["micro_batch_tokens"] == 2048 and "redoing the update with 2048" in caplog.text
    m_ref = ref.train_step(batch)
    assert m["loss"] == pytest.approx(m_ref["loss"], rel=1e-5)
    for (n, p), (_, q) in zip(ref.model.named_parameters(), tr.model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
    assert tr.micro_batch_tokens() == 2048  # later updates stay below the budget that failed
    tr.micro_batch_loss = lambda *a: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("still"))
    with pytest.raises(torch.cuda.OutOfMemoryError):  # at the floor it gives up, saying so
        tr.train_step(batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or lp_mod.fused_kernel() is None,
                    reason="needs a CUDA GPU and TRL's fused logprob kernel (Triton)")
def test_trls_fused_kernel_on_the_gpu_agrees_with_the_logits_and_trains_alike(tiny_model_dir):
    """On the GPU the trainer picks TRL's kernel, keeps it after its check, and one update with it
    moves the adapter as the logits path's update does (bf16: loose tolerances)."""
    def make(fused):
        return _sgd(Trainer(TrainerConfig(model_path=str(tiny_model_dir), learning_rate=1e-2, seed=0, device="cuda",
                                          use_unsloth=False, fused_logprobs=fused, warm_up=False)))
    fused, plain = make(True), make(False)
    assert fused.check_fused() and fused.logprob_kernel is lp_mod.fused_kernel() and plain.logprob_kernel is None
    batch = plain.make_batch(groups())
    wanted = batch.completion_mask.bool().cuda()
    a = plain.score(batch.input_ids.cuda(), batch.attention_mask.cuda(), wanted)
    b = fused.score(batch.input_ids.cuda(), batch.attention_mask.cuda(), wanted)
    assert (b[wanted] - a[wanted]).abs().mean().item() < 0.02 and (b[~wanted] == 0).all()
    start = [p.detach().clone() for p in plain.model.parameters() if p.requires_grad]
    m_plain, m_fused = plain.train_step(groups()), fused.train_step(groups())
    assert m_fused["loss"] == pytest.approx(m_plain["loss"], rel=0.05, abs=1e-3)
    lora = lambda tr: [p.detach() for p in tr.model.parameters() if p.requires_grad]  # noqa: E731
    d_plain = torch.cat([(p - s0).flatten().float() for p, s0 in zip(lora(plain), start)])
    d_fused = torch.cat([(p - s0).flatten().float() for p, s0 in zip(lora(fused), start)])
    assert d_plain.norm() > 0 and (d_fused - d_plain).norm() / d_plain.norm() < 0.1


def test_a_slow_update_is_reported_with_where_its_time_went(make_trainer, monkeypatch, caplog):
    """Each update's split is kept (Trainer.last_update); one well above the run's median is logged
    with it (update_timing.py), so a step that swings says why."""
    import logging
    from artsg_nb.rl import update_timing
    tr = make_trainer()
    tr.train_step(groups())
    assert tr.last_update is not None and tr.last_update.wall_s > 0 and tr.last_update.thread_cpu_s > 0
    monkeypatch.setattr(update_timing, "SLOW_MIN_S", 0.0)
    tr._slow_updates.walls = [1e-6] * 3  # a run whose updates took a microsecond: this one stands out
    with caplog.at_level(logging.WARNING, logger="artsg_nb.rl.trainer"):
        tr.train_step(groups())
    assert "the run's median update" in caplog.text and "this thread's CPU" in caplog.text


def test_the_trainers_forward_never_takes_cudnn_attention(make_trainer, monkeypatch):
    """cuDNN's attention builds a plan per new (batch, length) shape given a padding mask: 2.2 s
    updates among 0.03 s ones on an H100. The trainer's forwards run with it off, and the flag is
    put back after."""
    tr = make_trainer()
    seen = []
    forward = tr.model.get_base_model().model.forward

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return forward(*args, **kwargs)

    monkeypatch.setattr(tr.model.get_base_model().model, "forward", recording)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU's path, on a CPU
    assert torch.backends.cuda.cudnn_sdp_enabled()
    tr.train_step(groups())
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()
