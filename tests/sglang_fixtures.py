"""Where the responses recorded from a real SGLang 0.5.14 server live (../shared in CI).

Read when a test runs, never at import: a host without ../shared (the H200, which gets only the
checkout) still collects every module, and `-m "gpu or sglang"` picks its tests from all of them."""
import functools
import json
import os
from pathlib import Path


@functools.cache
def fixtures_dir() -> Path:
    shared = Path(os.environ.get("ARTSG_SHARED") or Path(__file__).resolve().parents[1] / ".." / "shared")
    path = shared / "fixtures" / "sglang-0.5.14"
    if not path.is_dir():
        raise FileNotFoundError(
            f"SGLang fixtures not found at {path}: set ARTSG_SHARED to the shared/ directory "
            "(CI checks it out beside the repo as ../shared)")
    return path


def fixture(name: str):
    """One recorded response: the text of a .txt (the /metrics exposition), else the JSON
    {"status": int, "body": ...} as recorded."""
    text = (fixtures_dir() / name).read_text()
    return text if name.endswith(".txt") else json.loads(text)
