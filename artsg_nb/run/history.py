"""One row of training metrics per GRPO step, kept in memory and on disk.

`History` is what the training loop appends to and what the plots and the progress line read.
Every row is also written as one JSON line to `<run_dir>/history.jsonl`, whole or not at all (a
write that fails, e.g. ENOSPC, is cut back off the file), so a crashed kernel loses at most the step
it was in; `History.load(run_dir)` resumes from that file, drops a last line cut off mid-write and
refuses a damaged line before the last, naming it. A row's reward statistics are float64 and
recorded as null when not finite, never an overflow that loses the row (run/row.py builds rows).

It does not define or build the row (run/row.py: `StepRow`, the one schema, and `step_row`),
compute metrics (the training step does) or draw anything (see plots.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import pandas as pd

from ..files import write_atomic
from ..serving.metrics import reachable_text
from .row import COLUMNS, TEXT_COLUMNS, step_row  # noqa: F401  (step_row re-exported: multi/ imports it here)

logger = logging.getLogger(__name__)

HISTORY_FILE = "history.jsonl"


class History:
    """Per-step metrics of one run, mirrored to `<run_dir>/history.jsonl`.

    `History(run_dir)` starts an empty history; if that directory already holds a non-empty
    history file it is moved aside (`history.<timestamp>.jsonl`, logged) rather than mixed with
    the new run. To continue a run use `History.load(run_dir)`.
    """

    COLUMNS = COLUMNS

    def __init__(self, run_dir: str | Path, rows: list[dict] | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / HISTORY_FILE
        self._rows: list[dict] = list(rows or [])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if rows is None:
            _move_aside_if_present(self.path)

    @classmethod
    def load(cls, run_dir: str | Path) -> History:
        """Resume from `<run_dir>/history.jsonl` (an absent file gives an empty history).

        A last line cut off by a crash is dropped and trimmed from the file, so the next
        `append` starts on a clean line.
        """
        path = Path(run_dir) / HISTORY_FILE
        rows = _read_rows(path) if path.exists() else []
        return cls(run_dir, rows=rows)

    def append(self, row: dict[str, Any]) -> dict:
        """Add one step's row (missing `step` = previous step + 1) and write it to disk now."""
        row = {key: _plain(value) for key, value in row.items()}
        if row.get("step") is None:
            row["step"] = self._rows[-1]["step"] + 1 if self._rows else 0
        row = {"step": row.pop("step"), **row}
        _append_whole_line(self.path, (json.dumps(row, allow_nan=False) + "\n").encode("utf-8"))
        self._rows.append(row)
        return row

    def truncate(self, last_step: int) -> int:
        """Drop rows after `last_step` (resuming from an earlier checkpoint); returns how many.

        The file is rewritten to match, atomically (a temporary file, then a rename).
        """
        kept = [row for row in self._rows if row["step"] <= last_step]
        dropped = len(self._rows) - len(kept)
        if dropped:
            write_atomic(self.path, "".join(json.dumps(row) + "\n" for row in kept))
            logger.info("%s: dropped %d row(s) after step %d", self.path, dropped, last_step)
        self._rows = kept
        return dropped

    @property
    def df(self) -> pd.DataFrame:
        """One row per step with StepRow's columns first; absent values are NaN."""
        extra = [k for row in self._rows for k in row if k not in COLUMNS]  # rows of older versions, hand-made rows
        columns = list(COLUMNS) + list(dict.fromkeys(extra))
        df = pd.DataFrame(self._rows, columns=columns)
        for column in COLUMNS:
            if column not in TEXT_COLUMNS:  # None -> NaN, bools -> 0/1, so plots get floats
                df[column] = pd.to_numeric(df[column], errors="coerce").astype(float)
        df["step"] = df["step"].astype("int64")  # append() always sets it
        return df

    @property
    def rows(self) -> list[dict]:
        """The rows so far, oldest first (a new list; the rows themselves are not copied)."""
        return list(self._rows)

    @property
    def last(self) -> dict | None:
        """The most recent row, or None before the first step."""
        return dict(self._rows[-1]) if self._rows else None

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"History({str(self.run_dir)!r}, steps={len(self)})"

    @staticmethod
    def format_row(row: dict[str, Any]) -> str:
        """One progress line, e.g. `step 12 | reward 0.41 ± 0.10 | loss 0.012 | hit 0.86 | ...`.

        Fields that are absent or NaN are left out; failed rollouts appear only when non-zero.
        """
        parts = [f"step {row.get('step', '?')}"]
        reward, reward_std = row.get("reward_mean"), row.get("reward_std")
        if _present(reward):
            spread = f" ± {reward_std:.2f}" if _present(reward_std) else ""
            parts.append(f"reward {reward:.2f}{spread}")
        if _present(row.get("loss")):
            parts.append(f"loss {row['loss']:.3g}")
        if _present(row.get("hit_rate")):
            parts.append(f"hit {row['hit_rate']:.2f}" + reachable_text(
                row.get("hit_rate_reachable"), row.get("hit_rate_path"), row.get("hit_rate_shared")))
        for key in ("rollout_s", "release_s", "train_s", "resume_s", "reload_s"):
            if _present(row.get(key)):
                parts.append(f"{key[:-2]} {_format_seconds(row[key])}")
        if _present(row.get("failed_rollouts")) and row["failed_rollouts"] > 0:
            parts.append(f"failed {int(row['failed_rollouts'])}")
        if _present(row.get("zero_adv_groups")) and row["zero_adv_groups"] > 0:
            of = f"/{int(row['groups'])}" if _present(row.get("groups")) else ""
            parts.append(f"zero-adv {int(row['zero_adv_groups'])}{of}")
        if row.get("update_skipped"):
            parts.append("no update (no signal)")
        if _present(row.get("eval_reward")):
            parts.append(f"eval {row['eval_reward']:.2f}")
            if _present(row.get("eval_pass_at_k")):
                parts[-1] += f" pass {row['eval_pass_at_k']:.2f}"
        if _present(row.get("reward_errors")) and row["reward_errors"] > 0:
            parts.append(f"no reward {int(row['reward_errors'])}")
        return " | ".join(parts)


def _append_whole_line(path: Path, line: bytes) -> None:
    """Append `line` whole or not at all: unbuffered writes (a short write is continued), and on
    any failure (ENOSPC, an interrupt) the file is cut back to its size before, so a retry never
    leaves a torn line in the middle of the file."""
    with open(path, "ab", buffering=0) as f:
        size = f.seek(0, os.SEEK_END)
        try:
            written = 0
            while written < len(line):
                written += f.write(line[written:])
        except BaseException:
            try:
                os.ftruncate(f.fileno(), size)
            except OSError as e:  # the load drops a torn last line; say why it may find one
                logger.error("%s: could not cut a partly written row back (%s)", path, e)
            raise


def _read_rows(path: Path) -> list[dict]:
    """Parse a history file; drop (and trim from the file) a torn last line (a write cut short by
    a crash); a line that cannot be read before the last is refused, naming it."""
    data = path.read_bytes()
    rows: list[dict] = []
    good_bytes = 0
    for line in data.splitlines(keepends=True):
        try:
            rows.append(json.loads(line))
        except ValueError:  # JSONDecodeError, or a UTF-8 sequence cut in two
            if good_bytes + len(line) < len(data):
                raise ValueError(f"{path}: unreadable line {len(rows) + 1} in the middle of the "
                                 f"file: {line[:80]!r}. Only a last line can be torn by a crash: this one was "
                                 "changed or damaged. Fix or remove that line, then load again.") from None
            logger.warning("%s: dropping a truncated last line (%d bytes)", path, len(line))
            with open(path, "r+b") as f:
                f.truncate(good_bytes)
            break
        good_bytes += len(line)
    if rows and not data[:good_bytes].endswith(b"\n"):
        with open(path, "ab") as f:  # a complete last row without its newline
            f.write(b"\n")
    return rows


def _move_aside_if_present(path: Path) -> None:
    """Keep an earlier run's history instead of appending a new run to it."""
    if path.exists() and path.stat().st_size > 0:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = path.with_name(f"history.{stamp}.jsonl")
        n = 1
        while aside.exists():  # two runs started within one second
            aside, n = path.with_name(f"history.{stamp}-{n}.jsonl"), n + 1
        path.rename(aside)
        logger.warning("%s held an earlier run; moved it to %s (use History.load to resume)",
                       path, aside.name)


def _plain(value: Any) -> Any:
    """A JSON-safe scalar: numpy/torch scalars unwrapped, NaN and inf stored as null."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _present(value: Any) -> bool:
    return isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value))


def _format_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 1 else f"{seconds:.1f} s"
