"""What a trainer checkpoint holds on disk besides the adapter: the optimizer state as
safetensors (tensors) plus JSON (param groups, scalars), and the error a corrupt or foreign
checkpoint raises, naming the file and what to do.

What it does not do: decide what is saved when (trainer.py, lora.py).
"""
from __future__ import annotations

from pathlib import Path

import torch


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or from a different configuration."""


def read_checkpoint_file(file: Path, read):
    """`read(file)`, a corrupt file (truncated, garbage: safetensors' "header too large",
    UnicodeDecodeError, bad JSON) turned into a CheckpointError naming it and what to do."""
    try:
        return read(file)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 — safetensors raises its own SafetensorError
        raise CheckpointError(
            f"checkpoint file {file} is corrupt and cannot be read ({type(e).__name__}: {e}). Nothing was "
            f"restored. Try: move {file.parent} out of the run directory and resume again (resume=True "
            "continues from the newest complete checkpoint before it), or start a new run directory.") from e


def optimizer_to_tensors(opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"state.{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_tensors(opt: torch.optim.Optimizer, tensors: dict, meta: dict) -> None:
    state: dict = {}
    for name, v in tensors.items():
        if name.startswith("state."):
            _, pid, k = name.split(".", 2)
            state.setdefault(int(pid), {})[k] = v
    for key, v in meta["scalars"].items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
