"""MultiTrainer on the tiny model: one base model, an adapter and an optimizer per experiment.

Each experiment's update is what a lone Trainer of the same seed computes; updating one leaves
every other adapter and optimizer bit-identical; forward_backward + optim_step is train_step; the
token losses are Tinker's sums; a LoRA shape the runtime was not started for is refused naming both."""

import pytest
import torch

from artsg_nb.multi.losses import Datum
from artsg_nb.multi.trainer import LoraMismatchError, LoraSpec, MultiTrainer, peft_name
from artsg_nb.rl.trainer import Trainer, TrainerConfig
from trainer_groups import groups, traj

LR = 1e-2




def _lora_state(model, name):
    key = name if name == "default" else peft_name(name)
    return {n.replace(f".{key}.", "."): p.detach().clone() for n, p in model.named_parameters()
            if f".{key}." in n and "lora_" in n}


def _opt_state(opt):
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in opt.state.values()]


@pytest.fixture(scope="module")
def multi(tiny_model_dir):
    mt = MultiTrainer(str(tiny_model_dir), LoraSpec(rank=16), device="cpu")
    yield mt
    mt.close()


def _fresh(multi, name, **kw):
    if name in multi.names:
        multi.remove(name)
    multi.add(name, LoraSpec(rank=kw.pop("rank", 16)), learning_rate=kw.pop("lr", LR), seed=kw.pop("seed", 0), **kw)


def test_an_experiments_update_is_a_lone_trainers(multi, tiny_model_dir):
    _fresh(multi, "a", seed=3)
    lone = Trainer(TrainerConfig(model_path=str(tiny_model_dir), learning_rate=LR, seed=3, device="cpu", warm_up=False))
    assert all(torch.equal(v, _lora_state(lone.model, "default")[k]) for k, v in _lora_state(multi.model, "a").items())
    for step in range(2):
        mine, theirs = multi.train_step("a", groups(step)), lone.train_step(groups(step))
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-7)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-6)
    ours, lones = _lora_state(multi.model, "a"), _lora_state(lone.model, "default")
    assert ours.keys() == lones.keys() and len(ours) > 0
    for k in ours:
        torch.testing.assert_close(ours[k], lones[k], rtol=1e-6, atol=1e-7, msg=k)
    assert multi.step_of("a") == 2


def test_updating_one_experiment_leaves_the_others_bit_identical(multi):
    _fresh(multi, "a", seed=1)
    _fresh(multi, "b", seed=2, lr=5e-3)
    multi.train_step("b", groups(7))  # b has optimizer state of its own
    with multi.using("b") as tb:
        b_opt = _opt_state(tb.optimizer)
    b_before, base_before = _lora_state(multi.model, "b"), {n: p.detach().clone() for n, p in
                                                             multi.model.named_parameters() if "lora_" not in n}
    a_before = _lora_state(multi.model, "a")
    multi.train_step("a", groups(0))
    multi.train_step("a", groups(1))
    assert any(not torch.equal(v, _lora_state(multi.model, "a")[k]) for k, v in a_before.items()), "a did not move"
    b_after = _lora_state(multi.model, "b")
    assert all(torch.equal(v, b_after[k]) for k, v in b_before.items()), "updating a changed b's weights"
    with multi.using("b") as tb:
        after = _opt_state(tb.optimizer)
    assert len(after) == len(b_opt) and all(
        torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for x, y in zip(b_opt, after) for k in x)
    assert all(torch.equal(p, base_before[n]) for n, p in multi.model.named_parameters() if "lora_" not in n)
    assert multi.step_of("b") == 1 and multi.step_of("a") == 2


def test_forward_backward_then_optim_step_is_train_step(multi):
    _fresh(multi, "a", seed=4)
    _fresh(multi, "b", seed=4)
    whole = multi.train_step("a", groups(2))
    parts = multi.forward_backward("b", groups(2), loss_fn="grpo")
    with multi.using("a") as ta:  # b's gradients stay on b: a has none after its own step
        assert all(p.grad is None for p in ta.trainable)
    stepped = multi.optim_step("b")
    assert parts["loss"] == pytest.approx(whole["loss"], abs=1e-7)
    assert stepped["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-6)
    a, b = _lora_state(multi.model, "a"), _lora_state(multi.model, "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_optim_step_takes_new_adam_settings(multi):
    _fresh(multi, "a")
    multi.forward_backward("a", groups(0))
    out = multi.optim_step("a", learning_rate=1e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01)
    with multi.using("a") as ta:
        g = ta.optimizer.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (1e-3, (0.8, 0.9), 1e-6, 0.01)
    assert out["learning_rate"] == 1e-3 and out["step"] == 1


def test_token_losses_are_tinkers_sums(multi):
    _fresh(multi, "a", seed=5)
    multi.train_step("a", groups(0))  # B off zero: logprobs that depend on the adapter
    seq = [5, 9, 11, 7, 20, 13]
    lp = multi.score("a", seq)  # log p(seq[t+1] | seq[:t+1])
    weights = [0, 0, 1, 1, 1]
    ce = multi.forward_backward("a", [Datum(seq[:-1], seq[1:], weights=weights)], loss_fn="cross_entropy")
    assert ce["loss"] == pytest.approx(-sum(w * x for w, x in zip(weights, lp)), rel=1e-5)
    assert ce["logprobs"][0] == pytest.approx(lp, abs=1e-5)
    adv = [0.0, 0.0, 1.0, -0.5, 2.0]
    is_ = multi.forward_backward("a", [Datum(seq[:-1], seq[1:], logprobs=lp, advantages=adv),
                                       Datum(seq[:3], seq[1:4], logprobs=lp[:3], advantages=[0.0, 1.0, 1.0])],
                                 loss_fn="importance_sampling")
    assert is_["loss"] == pytest.approx(-sum(adv) - 2.0, abs=1e-4)  # q = p: every ratio is 1
    assert len(is_["logprobs"][1]) == 3
    with multi.using("a") as ta:
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in ta.trainable)
    multi.optim_step("a")


def test_a_datum_that_does_not_fit_its_loss_is_refused(multi):
    _fresh(multi, "a")
    with pytest.raises(ValueError, match="needs weights"):
        multi.forward_backward("a", [Datum([5, 9], [9, 11])], loss_fn="cross_entropy")
    with pytest.raises(ValueError, match="shifted by one"):
        multi.forward_backward("a", [Datum([5, 9], [7, 11], weights=[1, 1])], loss_fn="cross_entropy")
    with pytest.raises(ValueError, match="loss_fn='ppo'"):
        multi.forward_backward("a", [], loss_fn="ppo")


def test_a_lora_shape_the_runtime_was_not_started_for_names_both(multi):
    with pytest.raises(LoraMismatchError, match=r"rank 32 on .*runtime was started with rank 16 on"):
        multi.add("big", LoraSpec(rank=32), learning_rate=LR, seed=0)
    with pytest.raises(LoraMismatchError, match=r"target modules \['lm_head'\] outside the runtime's"):
        multi.add("odd", LoraSpec(rank=8, target_modules=("q_proj", "lm_head")), learning_rate=LR, seed=0)
    assert "big" not in multi.names and "odd" not in multi.names
    multi.add("small", LoraSpec(rank=8, target_modules=("q_proj", "v_proj")), learning_rate=LR, seed=0)
    multi.train_step("small", groups(0))
    multi.remove("small")


def test_saved_adapter_is_a_lone_trainers_format(multi, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    _fresh(multi, "a", seed=0)
    multi.train_step("a", groups(0))
    path = multi.save_adapter("a", tmp_path / "a")
    lone = Trainer(TrainerConfig(model_path=str(tiny_model_dir), learning_rate=LR, seed=0, device="cpu", warm_up=False))
    lone.save_adapter(tmp_path / "lone")
    mine, theirs = load_file(path / "adapter_model.safetensors"), load_file(tmp_path / "lone" / "adapter_model.safetensors")
    assert mine.keys() == theirs.keys()
    assert (path / "adapter_config.json").exists()


def test_remove_and_unknown_names(multi):
    _fresh(multi, "gone")
    multi.remove("gone")
    assert "gone" not in multi.names and peft_name("gone") not in multi.model.peft_config
    with pytest.raises(KeyError, match="no experiment 'gone'"):
        multi.train_step("gone", groups(0))
    with pytest.raises(ValueError, match="experiment name"):
        multi.add("bad.name", LoraSpec(), learning_rate=LR, seed=0)
