"""What a run wrote, read for the charts: per-sample rollouts and a run's history, read-only.

`load_rollouts(run_dir)` reads `<run_dir>/rollouts/step-N.jsonl` (written by samples.py, read by
its `read_rollouts`) into one DataFrame; an absent directory gives an empty frame, so every chart falls back to the
history's mean ± std. `sample_table` shows a step's samples as a styled table (prompt,
completion, reward, finish reason). `read_history` reads `<run_dir>/history.jsonl` without
touching the file (History.load trims a cut-off last line; a chart must never write).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ...rollout.samples import ROLLOUTS_DIR, read_jsonl, read_rollouts

HISTORY_FILE = "history.jsonl"


def read_history(run_dir: str | Path) -> pd.DataFrame:
    """`<run_dir>/history.jsonl` as a DataFrame (empty when absent); the file is not modified."""
    path = Path(run_dir) / HISTORY_FILE
    return pd.DataFrame(read_jsonl(path)) if path.exists() else pd.DataFrame()


def load_rollouts(run_dir: str | Path | None, steps=None) -> pd.DataFrame:
    """Every sample of `<run_dir>/rollouts/step-N.jsonl` (only `steps` when given), one row each
    (samples.read_rollouts); empty when the run wrote no rollouts files."""
    return read_rollouts(run_dir, steps)


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
