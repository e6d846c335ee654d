"""Benchmark charts: engines side by side (bench.run's table) and hit rate per turn.

`plot_engine_comparison` draws the benchmark table from bench.run as grouped bars;
`plot_turn_hit_rates` draws metrics.turn_hit_rates (one colour per schedule when compared).
Both accept empty frames and NaN values, return a closed Figure (it shows once, when displayed
or returned from a cell), and compute nothing beyond averaging repeated rows.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .common import has_data as _has_data
from .common import new_figure
from .common import no_data as _no_data

ENGINE_COLORS = {"sglang": "tab:blue", "vllm": "tab:orange", "cpu": "tab:gray"}
SCHEDULE_COLORS = {"naive": "tab:orange", "prefix": "tab:blue", "prefix_sync": "tab:cyan",
                   "prefix_n": "tab:green", "n": "tab:purple"}


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

def _is_off(value) -> bool:
    """Whether a bench `radix` cell means the prefix cache was disabled."""
    if isinstance(value, str):
        return value.strip().lower() in ("false", "off", "no", "0", "disabled")
    return value is not None and not pd.isna(value) and not bool(value)
