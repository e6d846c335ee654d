"""A model build as a cache entry: written whole into a temporary directory next to its place,
marked complete, and renamed into place, so a reader finds a finished build or none.

What it does: `is_complete(out_dir, marker)` (a `.complete` record, equal to `marker` when
given) and `build_into(out_dir, marker, write, what)`: `write(tmp)` fills a private temporary
directory, made readable by all (a cache is shared), marked, then renamed to `out_dir`; when
another process finished the same build first, its build stands.

What it does not do: decide what a build holds or where the cache is (tiny.py, pretrained.py).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

MARKER = ".complete"


def is_complete(out_dir: Path, marker: dict | None = None) -> bool:
    """A finished build (with this record, when `marker` is given) is in `out_dir`."""
    path = Path(out_dir) / MARKER
    if not path.is_file():
        return False
    try:
        return marker is None or json.loads(path.read_text()) == marker
    except ValueError:
        return False


def build_into(out_dir: Path, marker: dict, write: Callable[[Path], None], what: str) -> Path:
    """`write(tmp)`, then `tmp` renamed to `out_dir` whole, with `marker` as its record."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write(tmp)
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp makes the directory private; a cache is shared
            path.chmod(0o755 if path.is_dir() else 0o644)
        (tmp / MARKER).write_text(json.dumps(marker))
        try:
            os.rename(tmp, out_dir)
        except OSError:  # another process finished the same build first
            if not is_complete(out_dir, marker):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built %s in %s (%.1f s)", what, out_dir, time.perf_counter() - t0)
    return out_dir
