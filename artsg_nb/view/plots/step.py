"""The step benchmark's chart: where each framework's GRPO step time goes.

`plot_step_benchmark(df)` draws the frame bench.step writes (one row per framework x job) as
stacked bars: rollout, train and reload medians per framework, one group of bars per job
(max_new_tokens), with the median step time written over each bar (a step also spends time
outside the three phases: scheduling, metrics, Python). artsg_nb.view.plots re-exports it.

What it does not do: measure (bench.step), or read files.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

PHASES = (("rollout_s_median", "rollout", "#4C72B0"), ("train_s_median", "train", "#DD8452"),
          ("reload_s_median", "reload", "#55A868"))
"""(column, legend label, colour) of each stacked segment, bottom to top."""


def plot_step_benchmark(df: pd.DataFrame, ax: Axes | None = None) -> Figure:
    """Stacked rollout/train/reload bars per framework (x engine) for each job; the figure.

    `df` has bench.step.COLUMNS; an empty frame draws "no data".
    """
    if ax is None:
        fig = plt.figure(figsize=(max(6.0, 1.6 * max(len(df), 1)), 4.2))
        plt.close(fig)  # shown once, when displayed (as plots.new_figure)
        ax = fig.subplots()
    ax.set_title("GRPO step time by phase (median)")
    ax.set_ylabel("seconds per step")
    if df is None or len(df) == 0 or "framework" not in df:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        return ax.figure
    df = df.copy()
    df["label"] = df["framework"].astype(str) + np.where(df["framework"] == "trl", "", " (" + df["engine"].astype(str) + ")")
    jobs = sorted(df["max_new_tokens"].unique())
    labels = list(dict.fromkeys(df["label"]))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        rows = df[df["label"] == label].set_index("max_new_tokens").reindex(jobs)
        x = np.arange(len(jobs)) - 0.4 + width * (j + 0.5)
        bottom = np.zeros(len(jobs))
        for column, name, colour in PHASES:
            h = pd.to_numeric(rows[column], errors="coerce").fillna(0.0).to_numpy()
            ax.bar(x, h, width * 0.9, bottom=bottom, color=colour, edgecolor="white", hatch="//" if j % 2 else "",
                   label=name if j == 0 else None)
            bottom += h
        for xi, step in zip(x, pd.to_numeric(rows["step_s_median"], errors="coerce")):
            if np.isfinite(step):
                ax.text(xi, step, f"{label}\n{step:.2f} s", ha="center", va="bottom", fontsize=7)
            ax.plot([xi - width * 0.45, xi + width * 0.45], [step, step], color="black", lw=1)
    ax.set_xticks(np.arange(len(jobs)), [f"{m} new tokens" for m in jobs])
    ax.legend(loc="upper left", fontsize=8)
    ax.margins(y=0.2)
    return ax.figure
