"""Where the responses recorded from a real SGLang 0.5.14 server live (../shared in CI)."""
import os
from pathlib import Path


def fixtures_dir() -> Path:
    shared = Path(os.environ.get("ARTSG_SHARED") or Path(__file__).resolve().parents[1] / ".." / "shared")
    path = shared / "fixtures" / "sglang-0.5.14"
    if not path.is_dir():
        raise FileNotFoundError(
            f"SGLang fixtures not found at {path}: set ARTSG_SHARED to the shared/ directory "
            "(CI checks it out beside the repo as ../shared)")
    return path
