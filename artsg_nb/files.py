"""Files as the rest of the package writes and reads them: a file replaced whole (a reader sees
the old text or the new, never half of one), a file or directory flushed to disk, and the last
lines of a process's log.

What it does not do: move directories. An adapter version (rl/lora.py) and a model build
(models/build.py) are directories moved into place whole, each by its own owner.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

TAIL_BYTES = 256 * 1024
"""How much of a log's end `log_tail` reads: the last lines, not a multi-GB log."""


def write_atomic(path: Path, text: str, private: bool = False, durable: bool = False) -> None:
    """Write `text` to `path` through a temporary file renamed over it. `private`: mode 0600 from
    the first byte, whatever the umask, in a directory created 0700 when missing (records that
    hold pids and keys); `durable`: fsync before the rename (it survives a crash of the machine)."""
    path = Path(path)
    path.parent.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    try:
        if private:
            os.fchmod(fd, 0o600)  # O_CREAT's mode is masked by the umask; an old tmp keeps its mode
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (so a rename in it survives a crash of the machine); a path
    that cannot be opened for it (a filesystem that refuses directories) is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def log_tail(path: Path, n: int = 20, since: int = 0, keep: Callable[[str], bool] | None = None) -> str:
    """The last `n` lines of the log at `path` written after byte `since` (where this start of the
    process began writing), without the lines `keep` rejects; a note when there is no log."""
    try:
        with open(path, "rb") as f:
            f.seek(max(since, f.seek(0, 2) - TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return f"(no log at {path})"
    if keep is not None:
        lines = [ln for ln in lines if keep(ln)]
    return "\n".join(lines[-n:])
