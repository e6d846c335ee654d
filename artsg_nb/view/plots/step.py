"""The step benchmark's chart: where each framework's GRPO step time goes.

`plot_step_benchmark(df)` draws the frame bench.step writes (one row per framework x job, and per
pipeline setting for artsg_nb; a leg with several rows of one machine at their mean, each machine's
apart) as stacked bars: rollout, train and reload medians per framework,
one group of bars per job (max_new_tokens; and per `job` shape when a frame holds several, named
under the tick), with the median step time written over each bar (a
step also spends time outside the three phases: scheduling, metrics, Python). A pipelined artsg_nb
row ("artsg_nb (sglang, pipelined)") overlaps rollout with train, so its phases add up to more than
its step: its bar is the measured median step time, split among the phases in proportion to their
medians, drawn with a dashed outline. artsg_nb.view.plots re-exports it.

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


def _pipelined(df: pd.DataFrame) -> np.ndarray:
    """Each row's `pipeline` as a bool (True or "True"); all False for a frame from before the column."""
    if "pipeline" not in df:
        return np.zeros(len(df), dtype=bool)
    return df["pipeline"].map(lambda v: str(v).strip().lower() == "true").to_numpy(dtype=bool)


def _labels(df: pd.DataFrame) -> pd.Series:
    """"trl", "artsg_nb (sglang)", "artsg_nb (sglang, pipelined)"; with " · <hardware>" after each
    when the frame holds rows of several machines (their legs are never averaged together)."""
    pipelined = np.where(_pipelined(df), ", pipelined", "")
    detail = np.where(df["framework"] == "trl", "", " (" + df["engine"].astype(str) + pipelined + ")")
    labels = df["framework"].astype(str) + detail
    if "hardware" in df and df["hardware"].nunique(dropna=False) > 1:
        labels = labels + " · " + df["hardware"].fillna("hardware not recorded").astype(str)
    return labels


def _groups(df: pd.DataFrame) -> pd.Series:
    """Each row's bar group: "8 new tokens", and its `job` shape under it when the frame holds
    rows of several jobs (a file from before the job column: "" for its rows)."""
    tokens = df["max_new_tokens"].map(lambda m: f"{int(m)} new tokens")
    jobs = df["job"].fillna("").astype(str) if "job" in df else pd.Series("", index=df.index)
    if jobs.nunique() <= 1:
        return tokens
    return tokens + "\n" + jobs.replace("", "(job not recorded)")


def _mean_per_group(rows: pd.DataFrame) -> pd.DataFrame:
    """One label's rows, one per bar group: a leg measured more than once (two calls merged into
    one file) at the mean of its medians, as bench.step_ratios averages them."""
    columns = [column for column, _, _ in PHASES] + ["step_s_median"]
    numbers = rows[columns].apply(pd.to_numeric, errors="coerce").assign(group=rows["group"])
    return numbers.groupby("group", sort=False).mean()


def _segments(rows: pd.DataFrame, pipelined: bool) -> list[np.ndarray]:
    """Each phase's bar heights for one label's rows (one per job, NaN phases as 0). Pipelined:
    scaled so that they add up to the row's median step time (its phases overlap; stacked as
    measured they would draw a step longer than it was); a row without a step time stays as is."""
    heights = [pd.to_numeric(rows[column], errors="coerce").fillna(0.0).to_numpy() for column, _, _ in PHASES]
    if not pipelined:
        return heights
    total = np.sum(heights, axis=0)
    step = pd.to_numeric(rows["step_s_median"], errors="coerce").to_numpy()
    scale = np.where(np.isfinite(step) & (total > 0), step / np.where(total > 0, total, 1.0), 1.0)
    return [h * scale for h in heights]


def plot_step_benchmark(df: pd.DataFrame, ax: Axes | None = None) -> Figure:
    """Stacked rollout/train/reload bars per framework (x engine, x pipeline) for each job; the
    figure. A pipelined row's bar is its median step time split in proportion to its phases
    (module docstring), outlined dashed.

    `df` has bench.step.COLUMNS (a frame from before `pipeline` was one draws every row synchronous);
    an empty frame draws "no data".
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
    df["label"] = _labels(df)
    df["pipelined"] = _pipelined(df)
    df["group"] = _groups(df)
    order = df.sort_values(["max_new_tokens", "group"], kind="stable")
    jobs = list(dict.fromkeys(order["group"]))
    labels = list(dict.fromkeys(df["label"]))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        pipelined = bool(df.loc[df["label"] == label, "pipelined"].any())
        rows = _mean_per_group(df[df["label"] == label]).reindex(jobs)
        x = np.arange(len(jobs)) - 0.4 + width * (j + 0.5)
        bottom = np.zeros(len(jobs))
        for (_, name, colour), h in zip(PHASES, _segments(rows, pipelined)):
            ax.bar(x, h, width * 0.9, bottom=bottom, color=colour, edgecolor="black" if pipelined else "white",
                   linestyle="--" if pipelined else "-", hatch="//" if j % 2 else "", label=name if j == 0 else None)
            bottom += h
        for xi, step in zip(x, pd.to_numeric(rows["step_s_median"], errors="coerce")):
            if np.isfinite(step):
                ax.text(xi, step, f"{label}\n{step:.2f} s", ha="center", va="bottom", fontsize=7)
            ax.plot([xi - width * 0.45, xi + width * 0.45], [step, step], color="black", lw=1)
    ax.set_xticks(np.arange(len(jobs)), jobs, fontsize=8 if any("\n" in j for j in jobs) else None)
    ax.legend(loc="upper left", fontsize=8)
    ax.margins(y=0.2)
    return ax.figure
