"""Training curves and engine-comparison charts, drawn from pandas DataFrames.

`plot_*(df, ax=None)` draw one History column family (docs/internals.md, "History columns") on
one Axes and return it; `plot_training` puts six of them in a 2×3 grid; `LivePlot` redraws that
grid in place after each step (one IPython display handle in Jupyter, a PNG file elsewhere);
`plot_engine_comparison` draws the benchmark table from bench.run as grouped bars;
`plot_turn_hit_rates` draws metrics.turn_hit_rates (one colour per schedule when compared).

Every function accepts empty frames, missing columns and NaN values: a panel with nothing to
show says "no data" instead of raising. Nothing here computes metrics or reads files.

Figures made here (`plot_training`, `LivePlot`, `plot_engine_comparison`,
`plot_turn_hit_rates`) are created through pyplot (which loads the kernel's backend and its image
formatter) and closed at once with `plt.close`: in a notebook they appear once, when displayed or returned from a cell, never a
second time through the inline backend's end-of-cell flush. `plot_*` with `ax=None` follows the
matplotlib convention and draws on a new, open pyplot figure.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
import IPython.display
from matplotlib.ticker import MaxNLocator

from . import widgets
from .step_plots import plot_step_benchmark  # noqa: F401  (re-exported: plots.plot_step_benchmark)

logger = logging.getLogger(__name__)

TRAINING_FIGSIZE = (13.0, 6.5)
ENGINE_COLORS = {"sglang": "tab:blue", "vllm": "tab:orange", "cpu": "tab:gray"}
SCHEDULE_COLORS = {"naive": "tab:orange", "prefix": "tab:blue", "prefix_sync": "tab:cyan",
                   "prefix_n": "tab:green", "n": "tab:purple"}


# ---------------------------------------------------------------- training curves (History df)

def plot_reward(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Mean reward per step with a ±1 std band."""
    ax = _axes(ax, "reward", "reward")
    step, mean = _column(df, "reward_mean")
    if not _has_data(mean):
        return _no_data(ax)
    ax.plot(step, mean, marker=".", color="tab:blue", label="mean")
    _, std = _column(df, "reward_std")
    if _has_data(std):
        ax.fill_between(step, mean - std, mean + std, color="tab:blue", alpha=0.2, label="± std")
    return ax


def plot_loss(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Policy loss per step."""
    return _plot_line(df, "loss", _axes(ax, "loss", "loss"), color="tab:red")


def plot_kl(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """KL to the reference (adapter-disabled) model per step; NaN when beta = 0."""
    ax = _axes(ax, "KL", "kl")
    step, kl = _column(df, "kl")
    if len(kl) and not _has_data(kl):  # the column is there, every value is null
        pad = max(step.max() - step.min(), 1) * 0.05  # the same steps as the panels beside it
        ax.set_xlim(step.min() - pad, step.max() + pad)
        ax.set_yticks([])
        return _no_data(ax, "no KL term (beta = 0)")
    return _plot_line(df, "kl", ax, color="tab:purple")


def plot_is_ratio(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Importance-sampling ratio trainer/server: mean with a min–max band, 1.0 dotted."""
    ax = _axes(ax, "IS ratio (trainer / server)", "ratio")
    step, mean = _column(df, "is_ratio_mean")
    if not _has_data(mean):
        return _no_data(ax)
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.plot(step, mean, marker=".", color="tab:green", label="mean")
    _, low = _column(df, "is_ratio_min")
    _, high = _column(df, "is_ratio_max")
    if _has_data(low) and _has_data(high):
        ax.fill_between(step, low, high, color="tab:green", alpha=0.2, label="min–max")
    # On-policy the ratio sits within ~1e-5 of 1: show at least 0.95-1.05, in plain numbers
    # rather than matplotlib's "1e-5+1" offset, so "exactly on-policy" reads as a flat line.
    lo, hi = ax.get_ylim()
    ax.set_ylim(min(lo, 0.95), max(hi, 1.05))
    ax.ticklabel_format(axis="y", useOffset=False)
    return ax


def plot_hit_rate(df: pd.DataFrame, ax: Axes | None = None,
                  theoretical: float | None = None) -> Axes:
    """Prefix-cache hit rate of each step, with the theoretical maximum dashed when given.

    Each step serves a new adapter, and the cache is keyed by adapter, so the rate is per step
    (reuse inside a group and across turns), never across steps.
    """
    ax = _axes(ax, "prefix-cache hit rate per step", "hit rate")
    step, rate = _column(df, "hit_rate")
    if theoretical is not None and np.isfinite(theoretical):
        ax.axhline(theoretical, color="black", linestyle="--", linewidth=1,
                   label=f"theoretical {theoretical:.2f}")
        ax.legend(loc="lower right", fontsize="small")
    if not _has_data(rate):
        return _no_data(ax)
    ax.plot(step, rate, marker=".", color="tab:cyan")
    ax.set_ylim(0, 1.05)
    return ax


def plot_reload_time(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Seconds to save the adapter and load it into the server, per step."""
    return _plot_line(df, "reload_s", _axes(ax, "adapter reload", "seconds"), color="tab:brown")


def plot_training(df: pd.DataFrame, fig: Figure | None = None,
                  theoretical_hit_rate: float | None = None) -> Figure:
    """The six training panels in a 2×3 grid; `fig` is cleared and reused when given."""
    if fig is None:
        fig = new_figure(TRAINING_FIGSIZE)
    fig.clear()
    axes = fig.subplots(2, 3).ravel()
    plot_reward(df, axes[0])
    plot_loss(df, axes[1])
    plot_kl(df, axes[2])
    plot_is_ratio(df, axes[3])
    plot_hit_rate(df, axes[4], theoretical=theoretical_hit_rate)
    plot_reload_time(df, axes[5])
    steps = len(df) if df is not None else 0
    fig.suptitle(f"GRPO training, {steps} step{'s' if steps != 1 else ''}", fontsize="medium")
    # Fixed margins: a layout engine would triple the time of each live redraw.
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.09, top=0.9, wspace=0.3, hspace=0.45)
    return fig


def save_training_plot(df: pd.DataFrame, path: str | Path,
                       theoretical_hit_rate: float | None = None, dpi: int = 100) -> Path:
    """Write the 2×3 training grid to an image file (format from the suffix); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_training(df, theoretical_hit_rate=theoretical_hit_rate).savefig(path, dpi=dpi)
    return path


class LivePlot:
    """The training grid, redrawn in place after each step.

    Create it once in a cell, then call `.update(history.df)` after each step. In Jupyter it
    shows one image with an IPython display handle and replaces that image on each update
    (headless nbclient/nbmake runs keep exactly one image, the last). Outside Jupyter it writes
    a PNG to `path` (default `training.png`) instead. When `path` is given in Jupyter too, the
    PNG is written as well.
    """

    def __init__(self, path: str | Path | None = None,
                 theoretical_hit_rate: float | None = None, dpi: int = 100):
        self.theoretical_hit_rate = theoretical_hit_rate
        self.dpi = dpi
        self.fig = new_figure(TRAINING_FIGSIZE)
        self.notebook = widgets.in_jupyter()  # one definition of "in a notebook"
        self.path = Path(path) if path is not None else (None if self.notebook else
                                                         Path("training.png"))
        self._handle = None
        if self.notebook:  # an empty grid now, so the cell shows where the curves will appear
            self._draw(pd.DataFrame())

    def update(self, df: pd.DataFrame) -> None:
        """Redraw every panel from `df` and push the new image."""
        self._draw(df)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fig.savefig(self.path, dpi=self.dpi)

    def _draw(self, df: pd.DataFrame) -> None:
        plot_training(df, fig=self.fig, theoretical_hit_rate=self.theoretical_hit_rate)
        if self.notebook:
            self._publish()

    def _publish(self) -> None:
        # PNG bytes rather than the Figure itself: the same image/png output whatever
        # matplotlib backend the kernel uses (inline, widget, or none).
        image = IPython.display.Image(data=figure_png(self.fig, self.dpi))
        if self._handle is None:
            self._handle = IPython.display.display(image, display_id=True)
        else:
            self._handle.update(image)


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


# ---------------------------------------------------------------- engine comparison (bench df)

# (bench column, panel title, y label); the hit-rate panel is drawn separately.
_BENCH_PANELS = (
    ("out_tok_s", "output throughput", "tokens / s"),
    ("ttft_p50_s", "time to first token, p50", "seconds"),
    (None, "prefix-cache hit rate", "hit rate"),
    ("reload_s", "adapter reload", "seconds"),
)


def plot_engine_comparison(bench_df: pd.DataFrame, axes: Sequence[Axes] | None = None) -> Figure:
    """Side-by-side bars per engine, grouped by schedule (and radix off), one panel per metric.

    Panels: output tok/s, TTFT p50, hit rate (server counters, else per-request; the theoretical
    maximum as a dashed tick over each bar), reload latency. Repeated rows of one
    (engine, schedule, radix) are averaged. `axes`, when given, holds four Axes.
    """
    own_figure = axes is None
    if own_figure:
        fig = new_figure((16, 4.6))
        axes = fig.subplots(1, 4)
        fig.subplots_adjust(left=0.05, right=0.98, bottom=0.22, top=0.82, wspace=0.3)
    if len(axes) != 4:
        raise ValueError(f"plot_engine_comparison draws 4 panels; got {len(axes)} axes")
    table = _bench_table(bench_df)
    for ax, (column, title, ylabel) in zip(axes, _BENCH_PANELS):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if column is None:
            _bench_hit_rate(table, ax)
        else:
            _grouped_bars(table, column, ax)
    _bench_legend(axes, own_figure)
    return axes[0].figure


def _bench_table(bench_df: pd.DataFrame | None) -> pd.DataFrame:
    """Mean of each metric per (group, engine); group = schedule, with "no radix" when off."""
    if bench_df is None or len(bench_df) == 0 or "engine" not in bench_df:
        return pd.DataFrame()
    df = bench_df.copy()
    schedule = df["schedule"].astype(str) if "schedule" in df else pd.Series("", index=df.index)
    radix_off = df["radix"].map(_is_off) if "radix" in df else pd.Series(False, index=df.index)
    df["group"] = schedule.where(~radix_off, schedule + ", no radix")
    metrics = [c for c in ("out_tok_s", "ttft_p50_s", "hit_rate_server", "hit_rate_requests",
                           "hit_rate_theoretical", "reload_s") if c in df]
    for column in metrics:
        df[column] = pd.to_numeric(df[column], errors="coerce")
    return df.groupby(["group", "engine"], sort=False)[metrics].mean().reset_index()


def _grouped_bars(table: pd.DataFrame, column: str, ax: Axes) -> dict:
    """Bars of `column`, one colour per engine, side by side within each group.

    Returns {(group, engine): (x centre, bar width)} for the bars drawn.
    """
    if column not in table or not _has_data(table[column]):
        _no_data(ax)
        return {}
    groups = list(dict.fromkeys(table["group"]))
    engines = list(dict.fromkeys(table["engine"]))
    width = 0.8 / len(engines)
    crowded = len(groups) * len(engines) > 8  # flat labels of neighbouring bars would collide
    placed = {}
    for i, engine in enumerate(engines):
        rows = table[(table["engine"] == engine) & table[column].notna()]
        x = np.array([groups.index(g) for g in rows["group"]]) - 0.4 + width * (i + 0.5)
        bars = ax.bar(x, rows[column], width, label=engine,
                      color=ENGINE_COLORS.get(str(engine).lower()))
        ax.bar_label(bars, labels=[_short(v) for v in rows[column]], fontsize="x-small",
                     rotation=90 if crowded else 0, padding=2)
        placed.update({(g, engine): (xi, width) for g, xi in zip(rows["group"], x)})
    # Schedule names ("prefix_sync", "naive / no radix") overlap when set flat side by side.
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", rotation_mode="anchor",
                  fontsize="small")
    ax.margins(y=0.2)  # room for the value labels
    return placed


def _short(value: float) -> str:
    """A bar's value in few characters: 11.2k, 0.874, 0.21."""
    if not np.isfinite(value):
        return ""
    if abs(value) >= 1000:
        return f"{value / 1000:.3g}k"
    return f"{value:.3g}"


def _bench_hit_rate(table: pd.DataFrame, ax: Axes) -> None:
    """Measured hit rate bars, with the theoretical maximum as a dashed tick over each bar."""
    if len(table) == 0:
        _no_data(ax)
        return
    measured = pd.Series(np.nan, index=table.index)
    for column in ("hit_rate_requests", "hit_rate_server"):  # server counters win when present
        if column in table:
            measured = table[column].where(table[column].notna(), measured)
    table = table.assign(hit_rate=measured)
    placed = _grouped_bars(table, "hit_rate", ax)
    if "hit_rate_theoretical" in table:
        for row in table.itertuples():
            if (row.group, row.engine) in placed and np.isfinite(row.hit_rate_theoretical):
                x, width = placed[(row.group, row.engine)]
                ax.hlines(row.hit_rate_theoretical, x - width / 2, x + width / 2,
                          colors="black", linestyles="--", linewidth=1.5)
        ax.plot([], [], color="black", linestyle="--", label="theoretical")
    ax.set_ylim(0, 1.2)


def _bench_legend(axes: Sequence[Axes], own_figure: bool) -> None:
    """One legend for all panels (engines, theoretical): above them, or in the first panel."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if not handles:
        return
    if own_figure:
        axes[0].figure.legend(handles.values(), handles.keys(), loc="upper center",
                              ncol=len(handles), frameon=False)
    else:
        axes[0].legend(handles.values(), handles.keys(), fontsize="small")


# ---------------------------------------------------------------- per-turn hit rates (turn table)

def plot_turn_hit_rates(table: pd.DataFrame, ax: Axes | None = None) -> Figure:
    """Hit rate per turn as bars (grouped by `schedule` when the table has one), the theoretical
    maximum as a dashed tick over each bar."""
    if ax is None:
        fig = new_figure((8, 3.6))
        ax = fig.subplots()
        fig.subplots_adjust(left=0.09, right=0.8, bottom=0.14, top=0.9)
    table = table if "schedule" in table else table.assign(schedule="")
    schedules = list(dict.fromkeys(table["schedule"]))
    width = 0.8 / max(len(schedules), 1)
    for i, schedule in enumerate(schedules):
        rows = table[table["schedule"] == schedule]
        x = rows["turn"].to_numpy(dtype=float) - 0.4 + width * (i + 0.5)
        bars = ax.bar(x, rows["hit_rate"].fillna(0), width, label=schedule or None,
                      color=SCHEDULE_COLORS.get(schedule, "tab:blue"))
        ax.bar_label(bars, fmt="%.2f", fontsize="x-small", padding=2)
        ax.hlines(rows["theoretical"], x - width / 2, x + width / 2, colors="black", linestyles="--")
    ax.plot([], [], color="black", linestyle="--", label="theoretical")
    ax.set_xticks(sorted(table["turn"].unique()))
    ax.set(xlabel="turn", ylabel="hit rate", ylim=(0, 1.12), title="prefix-cache hit rate per turn")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return ax.figure


# ---------------------------------------------------------------- helpers

def _axes(ax: Axes | None, title: str, ylabel: str) -> Axes:
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.2), layout="constrained")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # steps are whole: no "0.96, 0.98, ..."
    ax.set_ylabel(ylabel)
    return ax


def _column(df: pd.DataFrame | None, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) as float arrays; empty when the frame or the column is missing."""
    if df is None or len(df) == 0 or name not in df:
        return np.array([]), np.array([])
    steps = df["step"] if "step" in df else pd.Series(range(len(df)), index=df.index)
    values = pd.to_numeric(df[name], errors="coerce")
    return steps.to_numpy(dtype=float), values.to_numpy(dtype=float)


def _has_data(values) -> bool:
    return bool(np.isfinite(np.asarray(values, dtype=float)).any()) if len(values) else False


def _plot_line(df: pd.DataFrame, column: str, ax: Axes, color: str) -> Axes:
    step, values = _column(df, column)
    if not _has_data(values):
        return _no_data(ax)
    ax.plot(step, values, marker=".", color=color)
    return ax


def _no_data(ax: Axes, text: str = "no data") -> Axes:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center",
            color="gray")
    return ax


def _is_off(value) -> bool:
    """Whether a bench `radix` cell means the prefix cache was disabled."""
    if isinstance(value, str):
        return value.strip().lower() in ("false", "off", "no", "0", "disabled")
    return value is not None and not pd.isna(value) and not bool(value)
