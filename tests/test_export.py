"""Export: the served adapter as a PEFT adapter naming the user's base model, a merged model that
transformers loads with the adapter-on model's outputs (and server.check_model_path accepts), and
adapter retention (keep_adapters / keep_every) that still resumes."""
import asyncio
import json
from dataclasses import replace

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from artsg_nb.run.retention import steps_to_delete
from artsg_nb.serving.server import check_model_path
from artsg_nb.run.session import GRPORun, RunConfig
from scripted_tasks import ADDITION_WITH_SIGNAL


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A run of three steps keeping the newest version and every second one; stopped afterwards.
    The reward is scripted, so every step trains and publishes (the adapter is not the zero one)."""
    cfg = RunConfig(task=ADDITION_WITH_SIGNAL, engine="cpu", model_path=str(tiny_model_dir),
                    run_dir=str(tmp_path_factory.mktemp("export") / "run"), group_size=4, groups_per_step=2,
                    verify_adapter=False, verbose=False, keep_adapters=1, keep_every=2)
    out = tmp_path_factory.mktemp("exported")
    with GRPORun(cfg) as run:
        asyncio.run(run.run(3))
        kept = sorted(p.name for p in (run.run_dir / "adapters").glob("policy-step-*"))
        served = run.publisher.current.path
        adapter_dir, merged_dir = run.export(out / "adapter"), run.export(out / "merged", merge=True)
    return cfg, kept, served, adapter_dir, merged_dir


def test_export_writes_a_peft_adapter_naming_the_users_base_model(trained, tiny_model_dir):
    _, _, served, adapter_dir, _ = trained
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    assert (adapter_dir / "adapter_model.safetensors").read_bytes() == (served / "adapter_model.safetensors").read_bytes()
    assert not (adapter_dir / "optimizer.safetensors").exists() and (adapter_dir / "tokenizer_config.json").exists()


def test_merged_model_loads_and_matches_the_adapter_on_model(trained, tiny_model_dir):
    _, _, _, adapter_dir, merged_dir = trained
    check_model_path(str(merged_dir))  # a plain model directory: SGLang / vLLM would load it
    assert not (merged_dir / "adapter_config.json").exists()
    tok = AutoTokenizer.from_pretrained(merged_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        want, got = adapted(ids).logits, merged(ids).logits
        assert (want - base_logits).abs().max() > 1e-4, "the adapter should have moved the model"
        assert torch.allclose(got, want, atol=1e-4)
        gen = dict(max_new_tokens=8, do_sample=False)
        assert torch.equal(merged.generate(ids, **gen), adapted.generate(ids, **gen))


def test_retention_keeps_newest_every_mth_and_resume_works(trained):
    cfg, kept, _, _, _ = trained
    # 0..3 saved; the newest (3, also served) and every 2nd (0, 2) kept, 1 deleted.
    assert kept == ["policy-step-0", "policy-step-2", "policy-step-3"]
    assert steps_to_delete(range(10), keep_last=2, keep_every=4, protect=[5]) == [1, 2, 3, 6, 7]
    assert steps_to_delete(range(10), keep_last=0, keep_every=0, protect=[]) == []
    with GRPORun(replace(cfg, resume=True)) as run:
        assert run.trainer.step == 3
        row = asyncio.run(run.step())
    assert row["step"] == 4
