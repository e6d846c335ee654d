"""Experiment trackers as sinks of the history: W&B, Trackio, TensorBoard, MLflow.

What it does: `Trackers(report_to, run_dir, run_name, config)` opens one sink per name in
`RunConfig.report_to` and `log(row)` sends every history row (its numeric fields, eval columns
included, at `step`) to each; `close()` ends them. Each tracker package is imported inside its
sink's factory, only when asked for: they are optional. Where they write (offline-friendly):
- "wandb": wandb.init(dir=run_dir); WANDB_MODE=offline keeps it local (`wandb sync` later).
- "trackio": trackio.init(project=run_name), a local SQLite database (TRACKIO_DIR).
- "tensorboard": torch.utils.tensorboard SummaryWriter, event files in run_dir/tensorboard.
- "mlflow": mlflow with MLFLOW_TRACKING_URI if set, else a file store in run_dir/mlruns
  (MLFLOW_ALLOW_FILE_STORE is set for it: MLflow 3 otherwise asks for a database).
A sink that fails (to import, to start, or to log a row) logs one warning naming the tracker and
the fix, is dropped, and never breaks training.

What it does not do: keep the history (history.py does; trackers are copies of it) or log
samples, plots or artifacts.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Callable, Iterable

log = logging.getLogger(__name__)

TRACKERS = ("wandb", "trackio", "tensorboard", "mlflow")
"""Names RunConfig.report_to accepts."""


def numeric_fields(row: dict) -> dict[str, float]:
    """The row's finite numbers (bools as 0/1) without `step`: what a tracker plots."""
    out = {}
    for key, value in row.items():
        if key in ("step", "time") or value is None or isinstance(value, str):
            continue
        if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


class _WandbSink:
    def __init__(self, run_dir: Path, name: str, config: dict):
        import wandb  # optional: only when report_to names it

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "artsg_nb"), name=name, config=config,
                              dir=str(run_dir), reinit="finish_previous")

    def log(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # stop wandb's service process now, not at interpreter exit


class _TrackioSink:
    def __init__(self, run_dir: Path, name: str, config: dict):
        import trackio  # optional: only when report_to names it

        self.trackio = trackio
        self.run = trackio.init(project=name, name=name, config=config)

    def log(self, step: int, values: dict) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


class _TensorBoardSink:
    def __init__(self, run_dir: Path, name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard package

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _MLflowSink:
    def __init__(self, run_dir: Path, name: str, config: dict):
        import mlflow  # optional (mlflow-skinny is enough): only when report_to names it

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 refuses its file store unless told: it is the one that needs no server or database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(name)
        self.run = mlflow.start_run(run_name=name)
        mlflow.log_params({k: str(v)[:250] for k, v in config.items()})

    def log(self, step: int, values: dict) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


FACTORIES: dict[str, Callable] = {"wandb": _WandbSink, "trackio": _TrackioSink,
                                  "tensorboard": _TensorBoardSink, "mlflow": _MLflowSink}
"""Sink classes by tracker name: each takes (run_dir, run_name, config) and has log(step, values), close()."""


class Trackers:
    """The sinks of one run; a failing sink is dropped with one warning."""

    def __init__(self, report_to: Iterable[str], run_dir: str | Path, run_name: str, config: dict,
                 factories: dict[str, Callable] | None = None):
        names = list(report_to)
        unknown = [n for n in names if n not in TRACKERS]
        if unknown:
            raise ValueError(f"report_to names unknown trackers {unknown}; choose from {', '.join(TRACKERS)}")
        factories = factories or FACTORIES
        self.sinks: dict[str, object] = {}
        for name in names:
            try:
                self.sinks[name] = factories[name](Path(run_dir), run_name, config)
            except Exception as e:  # an optional tracker must never stop training
                _warn(name, "could not start", e)

    def log(self, row: dict) -> None:
        """Send one history row to every sink."""
        values = numeric_fields(row)
        step = int(row.get("step", 0))
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(step, values)
            except Exception as e:
                _warn(name, "failed to log a row", e)
                self.sinks.pop(name, None)

    def close(self) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                sink.close()
            except Exception as e:
                _warn(name, "failed to close", e)
        self.sinks.clear()


def _warn(name: str, what: str, err: Exception) -> None:
    log.warning("tracker %r %s (%s: %s); it is switched off for this run, training goes on. Try: "
                "pip install %s, or drop %r from RunConfig.report_to", name, what, type(err).__name__, err,
                "mlflow-skinny" if name == "mlflow" else name, name)
