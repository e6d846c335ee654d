"""What a run wrote, read for the charts: per-sample rollouts and a run's history, read-only.

`load_rollouts(run_dir)` reads `<run_dir>/rollouts/step-N.jsonl` (one JSON line per trajectory:
step, group seed, reward, prompt and completion text, finish_reason, prompt/completion tokens) into
one DataFrame; an absent directory gives an empty frame, so every chart falls back to the
history's mean ± std. `sample_table` shows a step's samples as a styled table (prompt,
completion, reward, finish reason). `read_history` reads `<run_dir>/history.jsonl` without
touching the file (History.load trims a cut-off last line; a chart must never write).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pandas as pd

logger = logging.getLogger(__name__)

ROLLOUTS_DIR = "rollouts"
HISTORY_FILE = "history.jsonl"
SAMPLE_COLUMNS = ("step", "seed", "reward", "finish_reason", "prompt", "completion",
                  "prompt_tokens", "completion_tokens")
_ALIASES = {"group_seed": "seed", "completion_text": "completion", "prompt_text": "prompt",
            "text": "completion"}
_STEP_FILE = re.compile(r"step-(\d+)\.jsonl$")


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file; a line that does not parse (cut off by a crash) is skipped."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s line %d is not JSON (cut off?); skipped", path, number)
    return rows


def read_history(run_dir: str | Path) -> pd.DataFrame:
    """`<run_dir>/history.jsonl` as a DataFrame (empty when absent); the file is not modified."""
    path = Path(run_dir) / HISTORY_FILE
    return pd.DataFrame(read_jsonl(path)) if path.exists() else pd.DataFrame()


def load_rollouts(run_dir: str | Path | None, steps=None) -> pd.DataFrame:
    """Every sample of `<run_dir>/rollouts/step-N.jsonl` (only `steps` when given), one row each,
    with SAMPLE_COLUMNS first; empty when the run wrote no rollouts files."""
    folder = Path(run_dir) / ROLLOUTS_DIR if run_dir is not None else None
    if folder is None or not folder.is_dir():
        return pd.DataFrame(columns=list(SAMPLE_COLUMNS))
    wanted = None if steps is None else {int(s) for s in steps}
    rows = []
    for path in sorted(folder.glob("step-*.jsonl"), key=_step_of):
        step = _step_of(path)
        if wanted is not None and step not in wanted:
            continue
        for row in read_jsonl(path):
            row = {_ALIASES.get(k, k): v for k, v in row.items()}
            row.setdefault("step", step)
            rows.append(row)
    df = pd.DataFrame(rows)
    for name in SAMPLE_COLUMNS:
        if name not in df:
            df[name] = None
    df["reward"] = pd.to_numeric(df["reward"], errors="coerce")
    df["completion_tokens"] = pd.to_numeric(df["completion_tokens"], errors="coerce")
    return df[list(SAMPLE_COLUMNS) + [c for c in df if c not in SAMPLE_COLUMNS]]


def sample_table(run_dir: str | Path, step: int | None = None, n: int = 8, max_chars: int = 160):
    """Up to `n` samples of `step` (default: the newest step with rollouts), best reward first:
    prompt, completion, reward, finish reason, as a pandas Styler (rewards shaded, long text cut
    to `max_chars`). Raises FileNotFoundError, saying where it looked, when there are none."""
    samples = load_rollouts(run_dir)
    if len(samples) == 0:
        raise FileNotFoundError(f"no rollouts files in {Path(run_dir) / ROLLOUTS_DIR} (step-N.jsonl): "
                                "this run did not record its samples")
    step = int(samples["step"].max()) if step is None else int(step)
    rows = samples[samples["step"] == step]
    if len(rows) == 0:
        raise FileNotFoundError(f"no samples of step {step} in {Path(run_dir) / ROLLOUTS_DIR}; "
                                f"steps recorded: {sorted(samples['step'].unique().tolist())}")
    rows = rows.sort_values("reward", ascending=False).head(n)
    table = pd.DataFrame({
        "seed": rows["seed"], "reward": rows["reward"], "finish": rows["finish_reason"],
        "tokens": rows["completion_tokens"],
        "prompt": rows["prompt"].map(lambda t: _cut(t, max_chars)),
        "completion": rows["completion"].map(lambda t: _cut(t, max_chars)),
    }).reset_index(drop=True)
    return (table.style.format({"reward": "{:.3f}", "tokens": "{:.0f}"}, na_rep="—")
            .background_gradient(subset=["reward"], cmap="RdYlGn", vmin=0.0, vmax=1.0)
            .set_properties(subset=["prompt", "completion"],
                            **{"text-align": "left", "white-space": "pre-wrap", "font-family": "monospace"})
            .set_caption(f"step {step}: {len(rows)} of {int((samples['step'] == step).sum())} samples, "
                         "best reward first"))


def _cut(text, max_chars: int) -> str:
    text = "" if text is None or (isinstance(text, float) and text != text) else str(text)
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def _step_of(path: Path) -> int:
    match = _STEP_FILE.search(path.name)
    return int(match.group(1)) if match else -1
