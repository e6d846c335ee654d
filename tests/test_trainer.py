"""The LoRA trainer on the tiny model: one step moves only adapter weights, micro-batching does
not change the update, checkpoints restore everything a resumed run needs."""
import math
from types import SimpleNamespace

import pytest
import torch

from artsg_nb.rl.grpo import GRPOConfig
from artsg_nb.rl.trainer import CheckpointError, Trainer, TrainerConfig, _micro_batches


def _traj(ids, n_prompt, reward, logp=-2.0):
    mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
    return SimpleNamespace(token_ids=ids, completion_mask=mask, logprobs=[logp if m else 0.0 for m in mask],
                           reward=reward, error=None)


def _groups(vocab=50):
    g = torch.Generator().manual_seed(0)
    out = []
    for gi in range(2):
        prompt = torch.randint(5, vocab, (6,), generator=g).tolist()
        trajs = [_traj(prompt + torch.randint(5, vocab, (3 + i,), generator=g).tolist(), 6, float(i % 2))
                 for i in range(4)]
        out.append(SimpleNamespace(trajectories=trajs))
    return out


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
    m1 = tr.train_step(_groups())
    tr.train_step(_groups())
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
        m_ref, m_small = ref.train_step(_groups()), small.train_step(_groups())
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
    a.train_step(_groups())
    a.save_adapter(tmp_path)
    a.save_checkpoint(tmp_path)
    b = make_trainer()
    b.load_checkpoint(tmp_path)
    assert b.step == 1
    ma, mb = a.train_step(_groups()), b.train_step(_groups())  # same state → same next step
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-6)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(p, q, msg=n)
    with pytest.raises(CheckpointError, match="lora_rank"):
        make_trainer(lora_rank=8).load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="incomplete"):
        make_trainer().load_checkpoint(tmp_path / "nowhere")


def test_no_valid_trajectory_is_a_clear_error(make_trainer):
    g = _groups()
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
        batch = padded.make_batch(_groups())
        lp_pad = padded.score(batch.input_ids, batch.attention_mask)
        lp_pack = packed.score_packed(batch.input_ids, batch.attention_mask)
        valid = (batch.attention_mask[:, 1:] * batch.attention_mask[:, :-1]).bool()
        torch.testing.assert_close(lp_pack[valid], lp_pad[valid], rtol=1e-4, atol=1e-5)
        assert (lp_pack[~valid] == 0).all()
        m_pad, m_pack = padded.train_step(_groups()), packed.train_step(_groups())
        assert m_pad["loss"] == pytest.approx(m_pack["loss"], rel=1e-4, abs=1e-6)
        for (n, p), (_, q) in zip(padded.model.named_parameters(), packed.model.named_parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"{loss_type}: {n}")


def test_save_adapter_writes_what_save_pretrained_writes(make_trainer, tmp_path):
    import json
    from safetensors.torch import load_file
    tr = make_trainer()
    tr.train_step(_groups())
    tr.save_adapter(tmp_path / "fast")
    tr.model.save_pretrained(str(tmp_path / "peft"), safe_serialization=True)
    fast, ref = load_file(tmp_path / "fast/adapter_model.safetensors"), load_file(tmp_path / "peft/adapter_model.safetensors")
    assert fast.keys() == ref.keys() and all(torch.equal(fast[k], ref[k]) for k in ref)
    assert (json.loads((tmp_path / "fast/adapter_config.json").read_text())
            == json.loads((tmp_path / "peft/adapter_config.json").read_text()))
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
