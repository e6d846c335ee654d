"""What every chart module of artsg_nb.view.plots shares: figures that show once, and tolerant columns.

`new_figure` makes a pyplot figure and closes it at once (it shows when displayed or returned
from a cell, never a second time through the inline backend's end-of-cell flush); `figure_png`
renders one to PNG bytes; the `_`-helpers read a History column as floats (empty when missing)
and label a panel with nothing to show. Nothing here draws a particular metric.
"""

from __future__ import annotations

import io

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


def new_figure(figsize: tuple[float, float]) -> Figure:
    """A figure that shows only when displayed: made by pyplot, then closed so that the inline
    backend does not also flush it at the end of the cell."""
    fig = plt.figure(figsize=figsize)
    plt.close(fig)
    return fig


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    """The figure rendered as PNG bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def axes_for(ax: Axes | None, title: str, ylabel: str) -> Axes:
    """`ax` titled and labelled as a per-step panel; a new open pyplot Axes when None."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.2), layout="constrained")
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # steps are whole: no "0.96, 0.98, ..."
    ax.set_ylabel(ylabel)
    return ax


def column(df: pd.DataFrame | None, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) as float arrays; empty when the frame or the column is missing."""
    if df is None or len(df) == 0 or name not in df:
        return np.array([]), np.array([])
    steps = df["step"] if "step" in df else pd.Series(range(len(df)), index=df.index)
    values = pd.to_numeric(df[name], errors="coerce")
    return steps.to_numpy(dtype=float), values.to_numpy(dtype=float)


def has_data(values) -> bool:
    return bool(np.isfinite(np.asarray(values, dtype=float)).any()) if len(values) else False


def plot_line(df: pd.DataFrame, name: str, ax: Axes, color: str) -> Axes:
    step, values = column(df, name)
    if not has_data(values):
        return no_data(ax)
    ax.plot(step, values, marker=".", color=color)
    return ax


def no_data(ax: Axes, text: str = "no data") -> Axes:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray")
    return ax


def ratio_column(df: pd.DataFrame | None, stat: str) -> tuple[np.ndarray, np.ndarray]:
    """The raw IS ratio's `stat` (mean, min, max): `is_raw_ratio_<stat>`, or in a history written
    before that column existed, `is_ratio_<stat>` (which then held the raw ratio)."""
    raw = column(df, f"is_raw_ratio_{stat}")
    return raw if len(raw[1]) else column(df, f"is_ratio_{stat}")
