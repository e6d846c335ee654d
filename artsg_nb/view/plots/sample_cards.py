"""What the model wrote, read whole: sample cards and a samples table that shows every cell in full.

`sample_cards(samples, k)` picks k samples of one step (best reward first, or worst) and shows
each as a card: prompt, the full completion, the reward and each reward function's part when the
samples carry them, the finish reason and token counts. A `SampleCards` is HTML in a notebook
(`_repr_html_`) and plain text elsewhere (`str()`); `show_samples` displays it either way.
`FullTextFrame` is a DataFrame whose display does not cut text at pandas' 50 characters
(`display.max_colwidth`), with the `messages` column shown as a count: what `run.samples()` returns.

What it does not: read or write files (rollout/samples.py), or compute rewards (tasks/).
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass

import pandas as pd

PART_PREFIXES = ("rewards/", "reward/")
"""Columns holding one reward function's value each (`rewards/<fn>`), shown as the reward's parts."""


class FullTextFrame(pd.DataFrame):
    """A DataFrame shown with every text cell whole; a conversation (`messages`) as its length."""

    @property
    def _constructor(self):
        return FullTextFrame

    def _shown(self) -> pd.DataFrame:
        shown = pd.DataFrame(self)
        if "messages" in shown.columns:
            shown["messages"] = shown["messages"].map(lambda m: f"{len(m)} messages" if isinstance(m, list) else m)
        return shown

    def __repr__(self) -> str:  # outside a notebook: every column too, wrapped to the terminal's width
        with pd.option_context("display.max_colwidth", None, "display.max_columns", None):
            return repr(self._shown())

    def _repr_html_(self) -> str | None:
        with pd.option_context("display.max_colwidth", None):
            return self._shown()._repr_html_()


def full_text(df: pd.DataFrame) -> FullTextFrame:
    """`df` as a FullTextFrame (same data; only its display differs)."""
    return FullTextFrame(df)


@dataclass(frozen=True)
class SampleCards:
    """k samples of one step, each shown whole; HTML in a notebook, plain text in `str()`."""
    step: int | None
    rows: list[dict]
    of: int
    """How many samples the step has."""
    order: str

    def __str__(self) -> str:
        head = f"step {self.step}: {len(self.rows)} of {self.of} samples, {self.order} reward first"
        return "\n\n".join([head, *(_card_text(r) for r in self.rows)])

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        head = (f"<b>step {self.step}</b>: {len(self.rows)} of {self.of} samples, {self.order} reward first")
        return f"<div>{head}{''.join(_card_html(r) for r in self.rows)}</div>"


def sample_cards(samples: pd.DataFrame, k: int = 4, worst: bool = False) -> SampleCards:
    """k samples of `samples` (one step's, as run.samples() gives them), best reward first (worst
    first with `worst`); samples without a reward (failed) come last."""
    rows = samples.sort_values("reward", ascending=worst, na_position="last").head(k)
    step = int(samples["step"].iloc[0]) if "step" in samples.columns and len(samples) else None
    return SampleCards(step, rows.to_dict("records"), len(samples), "worst" if worst else "best")


def show_samples(samples: pd.DataFrame, k: int = 4, worst: bool = False) -> None:
    """Display `sample_cards(samples, k, worst)`: as HTML in a notebook, printed elsewhere."""
    cards = sample_cards(samples, k, worst)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # no IPython: plain text
        get_ipython = display = None
    if get_ipython is not None and type(get_ipython()).__name__ == "ZMQInteractiveShell":
        display(cards)
    else:
        print(cards)


def reward_parts(row: dict) -> dict[str, float | None]:
    """Each reward function's value in `row`: a `reward_parts` dict, or `rewards/<fn>` columns."""
    parts = row.get("reward_parts")
    if isinstance(parts, dict):
        return dict(parts)
    return {key.split("/", 1)[1]: row[key] for key in row if key.startswith(PART_PREFIXES)}


def _number(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "none"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _summary(row: dict) -> str:
    parts = reward_parts(row)
    said = f"reward {_number(row.get('reward'))}"
    if parts:
        said += " (" + ", ".join(f"{name} {_number(v)}" for name, v in parts.items()) + ")"
    said += f" | finish {row.get('finish_reason')} | {_number(row.get('completion_tokens'))} tokens"
    where = f"group {row.get('group')} member {row.get('member')}"
    error = row.get("error")
    return f"{where} | {said}" + (f" | error: {error}" if isinstance(error, str) and error else "")


def _card_text(row: dict) -> str:
    return f"--- {_summary(row)}\nprompt: {row.get('prompt', '')}\ncompletion:\n{row.get('completion', '')}"


def _card_html(row: dict) -> str:
    pre = 'style="white-space: pre-wrap; font-family: monospace; margin: 2px 0 6px 0"'
    return (f'<div style="border-top: 1px solid #ccc; padding: 4px 0"><div>{html.escape(_summary(row))}</div>'
            f'<div><i>prompt</i></div><div {pre}>{html.escape(str(row.get("prompt", "")))}</div>'
            f'<div><i>completion</i></div><div {pre}>{html.escape(str(row.get("completion", "")))}</div></div>')
