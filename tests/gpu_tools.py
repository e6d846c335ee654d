"""The scripts under tools/gpu as modules, for the tests that run them here on the CPU engine
(tests/ is on sys.path, like scripted_tasks.py)."""
import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "gpu"


def load_gpu_tool(name: str):
    """tools/gpu/<name>.py, imported under `name` (registered first: its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
