"""export(merge=True) of a run whose model was given by a registered name (built offline).

The run names the hub id in what it exports but must load its local build, never the hub (an
offline box cannot reach it). The registered model is stood in for by the tiny model's build
under the hub id HuggingFaceTB/SmolLM2-135M-Instruct; every AutoModelForCausalLM.from_pretrained
call is recorded, and one that is not a local directory fails as it would offline (before:
export loaded the hub id).
"""
from __future__ import annotations

import json
from pathlib import Path

import transformers

from artsg_nb.run import session
from artsg_nb.run.session import GRPORun, RunConfig
from scripted_tasks import SCRIPTED

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_merged_export_names_the_hub_id_and_loads_the_local_build(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(session, "built_model_dir", lambda spec: str(tiny_model_dir))
    monkeypatch.setattr(session, "base_model_id", lambda spec: HUB_ID)
    loaded = []
    original = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def from_pretrained(cls, path, *args, **kwargs):
        loaded.append(str(path))
        if not Path(path).is_dir():
            raise OSError(f"offline: cannot download {path}")
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(from_pretrained))
    cfg = RunConfig(task=SCRIPTED, engine="cpu", model_path="smollm2-135m", run_dir=str(tmp_path / "run"),
                    group_size=2, groups_per_step=1, lora_rank=4, lora_alpha=8, verbose=False)
    with GRPORun(cfg) as run:
        loaded.clear()  # the trainer's own load
        merged = run.export(tmp_path / "merged", merge=True)
        adapter = run.export(tmp_path / "adapter")
    assert loaded == [str(tiny_model_dir)] and (merged / "model.safetensors").exists()
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == HUB_ID
