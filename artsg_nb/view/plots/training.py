"""The training figure: the informative panels in one grid, live while it trains, runs compared.

`plot_training(df)` draws panels.training_panels(df) in a grid (4 or 5 columns); `LivePlot`
redraws that grid in place after each step (one IPython display handle in Jupyter, a PNG file
elsewhere); `LiveTraining` adds an ETA bar above it for a loop of n steps, both in the running
cell's own output, ending green on success and red on failure; `compare_runs` puts several runs'
histories on one figure. Figures are closed for pyplot at once (panels.common.new_figure): they
show when displayed or returned from a cell, never twice.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Sequence

import IPython.display
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from artsg_nb.view import widgets

from . import panels
from .common import axes_for, column, figure_png, has_data, new_figure, no_data, ratio_column
from .samples import load_rollouts, read_history

logger = logging.getLogger(__name__)

PANEL_SIZE_IN = (3.5, 3.0)
LIVE_DPI = 80


def plot_training(df: pd.DataFrame, fig: Figure | None = None, theoretical_hit_rate: float | None = None,
                  samples: pd.DataFrame | None = None) -> Figure:
    """The panels that carry information for `df` in a grid; `fig` is cleared and reused when
    given. `samples` (plots.load_rollouts) adds per-sample reward and length spreads."""
    names = panels.training_panels(df)
    ncols = 4 if len(names) <= 8 else 5
    nrows = math.ceil(len(names) / ncols)
    if fig is None:
        fig = new_figure((PANEL_SIZE_IN[0] * ncols, PANEL_SIZE_IN[1] * nrows))
    else:
        fig.set_size_inches(PANEL_SIZE_IN[0] * ncols, PANEL_SIZE_IN[1] * nrows)
    fig.clear()
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for name, ax in zip(names, axes):
        draw = getattr(panels, f"plot_{name}")
        if name == "hit_rate":
            draw(df, ax, theoretical=theoretical_hit_rate)
        elif name in ("reward", "completion_length"):
            draw(df, ax, samples=samples)
        else:
            draw(df, ax)
    for ax in axes[len(names):]:
        ax.remove()
    steps = len(df) if df is not None else 0
    fig.suptitle(f"GRPO training, {steps} step{'s' if steps != 1 else ''}{_left_out(df, names)}",
                 fontsize="medium")
    # Fixed margins: a layout engine would triple the time of each live redraw.
    # The title needs ~0.5 in above the top row whatever the number of rows.
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.55 / (PANEL_SIZE_IN[1] * nrows),
                        top=1 - 0.6 / (PANEL_SIZE_IN[1] * nrows),
                        wspace=0.32, hspace=0.5)
    return fig


def save_training_plot(df: pd.DataFrame, path: str | Path, theoretical_hit_rate: float | None = None,
                       dpi: int = 100, samples: pd.DataFrame | None = None) -> Path:
    """Write the training grid to an image file (format from the suffix); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_training(df, theoretical_hit_rate=theoretical_hit_rate, samples=samples).savefig(path, dpi=dpi)
    return path


class LivePlot:
    """The training grid, redrawn in place after each step.

    Create it once in a cell, then call `.update(history.df)` after each step. In Jupyter it
    shows one image with an IPython display handle and replaces that image on each update
    (headless nbclient/nbmake runs keep exactly one image, the last). Outside Jupyter it writes
    a PNG to `path` (default `training.png`) instead; with `path` in Jupyter too. With `run_dir`
    the per-sample spreads come from its rollouts files.
    """

    def __init__(self, path: str | Path | None = None, theoretical_hit_rate: float | None = None,
                 dpi: int = LIVE_DPI, run_dir: str | Path | None = None):
        self.theoretical_hit_rate = theoretical_hit_rate
        self.dpi = dpi
        self.run_dir = run_dir
        self.fig = new_figure((14, 6))
        self.notebook = widgets.in_jupyter()  # one definition of "in a notebook"
        self.path = Path(path) if path is not None else (None if self.notebook else Path("training.png"))
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
        samples = load_rollouts(self.run_dir, steps=_steps(df)) if self.run_dir is not None and len(df) else None
        samples = samples if samples is not None and len(samples) else None
        plot_training(df, fig=self.fig, theoretical_hit_rate=self.theoretical_hit_rate, samples=samples)
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


class LiveTraining:
    """An ETA bar for a loop of `n_steps` steps above the live training grid, both in the cell
    that runs the loop. `.step_done(df)` after each step; `.finish(ok)` at the end: the bar ends
    green when every step ran, red when the loop failed. Outside Jupyter the grid goes to a PNG
    (LivePlot) and the progress to the log."""

    def __init__(self, n_steps: int, run_dir: str | Path | None = None,
                 theoretical_hit_rate: float | None = None, path: str | Path | None = None):
        self.n_steps, self.done = n_steps, 0
        self.t0 = time.monotonic()
        self.notebook = widgets.in_jupyter()
        self._bar = (IPython.display.display(IPython.display.HTML(self.progress_html()), display_id=True)
                     if self.notebook else None)
        self.plot = LivePlot(path=path, theoretical_hit_rate=theoretical_hit_rate, run_dir=run_dir)

    def step_done(self, df: pd.DataFrame) -> None:
        self.done += 1
        self.plot.update(df)
        self._show()

    def finish(self, ok: bool, state: str | None = None) -> None:
        """End the bar: "done" (every step ran), "failed", "stopped" (fewer steps than asked), or
        the `state` given (the loop's "interrupted": the stop button, not an error)."""
        self._show(state or ("done" if ok and self.done >= self.n_steps else "failed" if not ok else "stopped"))

    def progress_html(self, state: str = "running") -> str:
        """The bar as HTML: steps done of n, seconds per step, ETA; blue running, green done,
        red failed."""
        elapsed = time.monotonic() - self.t0
        per_step = elapsed / self.done if self.done else None
        eta = per_step * (self.n_steps - self.done) if per_step is not None else None
        color = {"done": "#2a2", "failed": "#c22", "stopped": "#c22", "interrupted": "#d80"}.get(state, "#1f77b4")
        percent = 100 * self.done / max(self.n_steps, 1)
        timing = (f"{_clock(elapsed)} elapsed · {per_step:.1f} s/step · ETA {_clock(eta)}"
                  if per_step is not None else "first step running…")
        return (f'<div class="artsg-progress" data-state="{state}" data-done="{self.done}" '
                f'data-total="{self.n_steps}" style="font-family:monospace;font-size:12px">'
                f'<span style="display:inline-block;width:320px;height:12px;background:#eee;'
                f'border:1px solid #ccc;vertical-align:middle"><span style="display:block;height:100%;'
                f'width:{percent:.1f}%;background:{color}"></span></span> '
                f'step {self.done}/{self.n_steps} · {state} · {timing}</div>')

    def _show(self, state: str = "running") -> None:
        if self._bar is not None:
            self._bar.update(IPython.display.HTML(self.progress_html(state)))
        else:
            logger.info("%s", self.progress_html(state))


def compare_runs(run_dirs: Sequence[str | Path], labels: Sequence[str] | None = None) -> Figure:
    """Several runs on one figure, one colour per run: reward (± std), loss, completion length,
    generation tokens/s, step seconds and hit rate, from each run's history.jsonl."""
    labels = list(labels) if labels is not None else [Path(d).name for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"compare_runs got {len(run_dirs)} run dirs and {len(labels)} labels")
    histories = [read_history(d) for d in run_dirs]
    fig = new_figure((14, 6.2))
    axes = fig.subplots(2, 3).ravel()
    titles = [("reward", "reward"), ("loss", "loss"), ("completion length", "tokens / sample"),
              ("generation throughput", "tokens / s"), ("step time", "seconds"),
              ("prefix-cache hit rate per step", "hit rate")]
    for ax, (title, ylabel) in zip(axes, titles):
        axes_for(ax, title, ylabel)
    for i, (df, label) in enumerate(zip(histories, labels)):
        color = f"C{i % 10}"
        for ax, values in zip(axes, _compared_series(df)):
            step, y = values
            if has_data(y):
                ax.plot(step, y, marker=".", color=color, label=label)
        step, mean = column(df, "reward_mean")
        _, std = column(df, "reward_std")
        if has_data(mean) and has_data(std):
            axes[0].fill_between(step, mean - std, mean + std, color=color, alpha=0.12)
    for ax in axes:
        if not ax.lines:
            no_data(ax)
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="upper center", ncol=min(len(names), 6), frameon=False)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.08, top=0.88, wspace=0.3, hspace=0.45)
    return fig


def _compared_series(df: pd.DataFrame) -> list[tuple[np.ndarray, np.ndarray]]:
    step, tokens = column(df, "completion_tokens")
    _, rollout_s = column(df, "rollout_s")
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = tokens / rollout_s if len(tokens) else tokens
    total = sum((np.nan_to_num(column(df, c)[1]) for c in ("rollout_s", "train_s", "reload_s")),
                np.zeros(len(step)))
    return [column(df, "reward_mean"), column(df, "loss"), panels._completion_length(df),
            (step, rate), (step, np.where(total > 0, total, np.nan)), column(df, "hit_rate")]


def _left_out(df: pd.DataFrame | None, names: list[str]) -> str:
    """What the title says about panels dropped for saying nothing."""
    notes = []
    if "kl" not in names and len(column(df, "kl")[1]):
        notes.append("no KL term (beta = 0)")
    if "is_ratio" not in names and has_data(ratio_column(df, "mean")[1]):
        notes.append(f"IS ratio within 1 ± {panels.IS_FLAT_TOLERANCE} (on-policy)")
    if "clip_frac" not in names and has_data(column(df, "clip_frac")[1]):
        notes.append("nothing clipped")
    return f" · {' · '.join(notes)}" if notes else ""


def _steps(df: pd.DataFrame) -> list[int] | None:
    return [int(s) for s in df["step"]] if "step" in df else None


def _clock(seconds: float | None) -> str:
    if seconds is None or not np.isfinite(seconds):
        return "—"
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds < 3600 else f"{seconds // 3600}h{seconds % 3600 // 60:02d}"
