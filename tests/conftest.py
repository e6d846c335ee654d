"""Shared pytest fixtures and hooks.

What it does: the tiny model the tests run against (the build shipped in the repository,
artsg_nb/models/shipped/tiny-s0-p800, so every machine tests the same weights; ARTSG_TINY_MODEL points
at another, e.g. one built with another seed to check that tests do not lean on its samples),
skipping of tests marked `gpu` where no NVIDIA GPU is visible (markers are declared in
pyproject.toml). The check for processes a test session left running is the repository's
conftest.py (it covers the notebooks suite too).

What it does not do: start servers or touch the network. A fixture used by one test file belongs
in that file.
"""
import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The shipped tiny model (tiny_model.default_model_dir(); ARTSG_TINY_MODEL points at another)."""
    if os.environ.get("ARTSG_TINY_MODEL"):
        return Path(os.environ["ARTSG_TINY_MODEL"])
    from artsg_nb.models.tiny import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@functools.cache
def nvidia_gpu_missing() -> str | None:
    """Why no NVIDIA GPU is usable here, or None when `nvidia-smi -L` lists one."""
    if shutil.which("nvidia-smi") is None:
        return "needs an NVIDIA GPU: nvidia-smi is not on PATH; run on the GPU host"
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"needs an NVIDIA GPU: `nvidia-smi -L` failed ({e}); run on the GPU host"
    if out.returncode != 0 or "GPU" not in out.stdout:
        detail = (out.stderr or out.stdout).strip()[:200]
        return f"needs an NVIDIA GPU: `nvidia-smi -L` lists none (rc={out.returncode}: {detail}); run on the GPU host"
    return None


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped, with the reason, where no NVIDIA GPU answers nvidia-smi."""
    gpu_tests = [item for item in items if "gpu" in item.keywords]
    reason = nvidia_gpu_missing() if gpu_tests else None
    for item in gpu_tests if reason else []:
        item.add_marker(pytest.mark.skip(reason=reason))
