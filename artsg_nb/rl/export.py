"""Taking a trained adapter out of a run: a PEFT adapter, or a merged model any engine loads.

What it does: `export_adapter(adapter_dir, out, base_model, tokenizer)` copies a saved adapter
version (adapter_config.json + adapter_model.safetensors, without the optimizer state) to `out`,
with `base_model_name_or_path` set to the base model the user named (RunConfig.model_path, or the
tiny model's directory), and saves the tokenizer beside it: `PeftModel.from_pretrained(base,
out)` loads it. `export_merged(...)` loads the base model on the CPU, applies the adapter, merges
it into the weights (PEFT merge_and_unload) and saves a plain model directory (config.json,
*.safetensors, tokenizer files): transformers, SGLang and vLLM load it as a model of its own.

What it does not do: touch the trainer's model (merging happens on a fresh copy loaded from
disk, so training can go on) or the server. `prune_adapters` (which versions a long run keeps)
lives in retention.py.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""What a PEFT adapter is made of; the run's checkpoint files (optimizer, trainer state) stay behind."""


class ExportError(RuntimeError):
    """The adapter to export is missing or incomplete, or the target is not a usable folder."""


def export_adapter(adapter_dir: str | Path, out: str | Path, base_model: str, tokenizer) -> Path:
    """Copy the PEFT adapter in `adapter_dir` to `out` (created; files there are replaced),
    naming `base_model` as its base, and save `tokenizer` there. Returns `out`."""
    adapter_dir, out = Path(adapter_dir), Path(out)
    missing = [name for name in ADAPTER_FILES if not (adapter_dir / name).exists()]
    if missing:
        raise ExportError(f"{adapter_dir} is not a saved adapter (missing {', '.join(missing)}); "
                          "export the run's served adapter (run.export) or a policy-step-N folder of it")
    if out.exists() and not out.is_dir():
        raise ExportError(f"export target {out} is a file; give a folder path")
    out.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        shutil.copyfile(adapter_dir / name, out / name)
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_model
    config_path.write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out))
    log.info("exported adapter %s to %s (base %s)", adapter_dir.name, out, base_model)
    return out


def export_merged(adapter_dir: str | Path, out: str | Path, base_model: str, tokenizer,
                  dtype: str | torch.dtype = "auto", load_from: str | Path | None = None) -> Path:
    """Merge the adapter in `adapter_dir` into `base_model` and save the result at `out` as a
    plain model directory with the tokenizer. Loads the base model again on the CPU (its memory
    for a moment) from `load_from` when given (the local build a run trained on: `base_model`
    may be a hub id, named in the export but not downloaded), else from `base_model`; `dtype`
    "auto" keeps the base model's saved precision."""
    from peft import PeftModel  # where used: see trainer.py (Unsloth must patch these first on a GPU)
    from transformers import AutoModelForCausalLM

    adapter_dir, out = Path(adapter_dir), Path(out)
    if not (adapter_dir / "adapter_config.json").exists():
        raise ExportError(f"{adapter_dir} is not a saved adapter (no adapter_config.json)")
    base = AutoModelForCausalLM.from_pretrained(str(load_from or base_model), dtype=dtype)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    log.info("merged adapter %s into %s at %s", adapter_dir.name, base_model, out)
    return out
