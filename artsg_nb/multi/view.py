"""What a sweep shows: the experiments' table, and their curves side by side, live.

What it does: `sweep_table(experiments)` is one row per experiment — its served adapter, step,
last reward and hit rate, seconds per step part, its share of the trainer's time, its status and
error. `LiveSweep` redraws every experiment's curves on one figure (view.plots.compare_runs, one
colour each) and the table under an ETA bar, in the running cell's output, after each experiment's
step; outside Jupyter the figure goes to `<run_dir>/sweep.png` and the progress to the log.

What it does not do: run anything (runtime.py), or draw panels of its own (view/plots does).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Iterable

import IPython.display
import pandas as pd

from ..view.plots import compare_runs
from ..view.plots.common import figure_png
from ..view.plots.training import LiveTraining
from ..view.widgets import in_jupyter

log = logging.getLogger(__name__)

LIVE_DPI = 72


def sweep_table(experiments: Iterable) -> pd.DataFrame:
    """One row per experiment (experiment.Experiment): what a dashboard of the sweep shows."""
    exps = list(experiments)
    trainer_s = sum(e.train_s for e in exps)
    rows = []
    for e in exps:
        last = e.history.last or {}
        rows.append({"experiment": e.name, "task": getattr(e.source.task, "name", str(e.cfg.task)),
                     "learning_rate": e.multi.learning_rate_of(e.name) if e.name in e.multi.names else None,
                     "seed": e.cfg.seed, "adapter": e.adapter, "step": last.get("step", 0),
                     "reward": last.get("reward_mean"), "hit_rate": last.get("hit_rate"),
                     "rollout_s": _mean(e, "rollout_s"), "train_s": _mean(e, "train_s"),
                     "reload_s": _mean(e, "reload_s"), "trainer_wait_s": _mean(e, "trainer_wait_s"),
                     "trainer_share": e.train_s / trainer_s if trainer_s > 0 else None,
                     "status": e.status, "error": e.error})
    return pd.DataFrame(rows).set_index("experiment") if rows else pd.DataFrame()


def _mean(exp, column: str) -> float | None:
    values = [r[column] for r in exp.history.rows if isinstance(r.get(column), (int, float))
              and math.isfinite(r[column])]
    return sum(values) / len(values) if values else None


class LiveSweep:
    """The sweep's curves and table, redrawn in place after each experiment's step (module docstring)."""

    def __init__(self, total_steps: int, sweep):
        self.sweep = sweep
        self.progress = _Progress(total_steps)
        self.notebook = in_jupyter()
        self._figure = self._table = None
        if self.notebook:
            self._figure = IPython.display.display(IPython.display.HTML("<i>first steps running…</i>"), display_id=True)
            self._table = IPython.display.display(pd.DataFrame(), display_id=True)

    def step_done(self) -> None:
        self.progress.done += 1
        self._draw()

    def finish(self, ok: bool) -> None:
        self.progress.show("done" if ok else "failed")

    def _draw(self) -> None:
        fig = self.sweep.plot()
        table = self.sweep.table()
        if self.notebook:
            self._figure.update(IPython.display.Image(data=figure_png(fig, LIVE_DPI)))
            self._table.update(table)
        else:
            fig.savefig(self.sweep.run_dir / "sweep.png", dpi=LIVE_DPI)
        self.progress.show()


class _Progress(LiveTraining):
    """LiveTraining's ETA bar over the sweep's steps (every experiment's), without its training grid."""

    def __init__(self, n_steps: int):  # not LiveTraining's: that one also makes the single run's grid
        self.n_steps, self.done, self.t0 = n_steps, 0, time.monotonic()
        self.notebook = in_jupyter()
        self._bar = (IPython.display.display(IPython.display.HTML(self.progress_html()), display_id=True)
                     if self.notebook else None)

    def show(self, state: str = "running") -> None:
        self._show(state)
