"""The data-parallel GRPO update (artsg_nb/distributed.py) equals the single-process one.

Two gloo ranks, launched as worker processes the way a notebook would (own process groups,
torchrun-style environment), each take half of the same batch; rank 0 saves the adapter. Its
LoRA weights must match Trainer.train_step's on the whole batch, for each loss normalisation
(dapo divides by the batch's completion tokens, grpo and dr_grpo by its sequences), which holds
only if every rank normalises by the whole batch and the gradients are summed, not averaged.
Marked slow (~30 s: two ranks load the tiny model per loss type).
"""
import json
import pickle
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from artsg_nb.distributed import launch, shard
from artsg_nb.grpo import GRPOConfig
from artsg_nb.trainer import Trainer, TrainerConfig


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
    workers = launch("artsg_nb.distributed:train_on_groups", 2,
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
