"""The responses recorded from a real SGLang 0.5.14 server, carried in tests/fixtures/.

How they were recorded: tests/fixtures/sglang-0.5.14/README.md. Read when a test runs, never at
import, so a test module that uses one still collects if a file is missing."""
import functools
import json
from pathlib import Path


@functools.cache
def fixtures_dir() -> Path:
    path = Path(__file__).resolve().parent / "fixtures" / "sglang-0.5.14"
    if not path.is_dir():
        raise FileNotFoundError(f"SGLang fixtures not found at {path}: they are part of the repository "
                                "(git checkout tests/fixtures)")
    return path


def fixture(name: str):
    """One recorded response: the text of a .txt (the /metrics exposition), else the JSON
    {"status": int, "body": ...} as recorded."""
    text = (fixtures_dir() / name).read_text()
    return text if name.endswith(".txt") else json.loads(text)
