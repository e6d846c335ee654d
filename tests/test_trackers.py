"""Tracker sinks: each installed tracker gets history rows offline (TensorBoard event files, W&B
offline mode, an MLflow file store, Trackio's local database); a sink that fails warns once and
never breaks the caller; unknown names are refused."""
import logging

import pytest
from pathlib import Path

from artsg_nb.run.trackers import Trackers, numeric_fields

ROWS = [{"step": 1, "adapter": "policy-step-1", "reward_mean": 0.25, "loss": None, "update_skipped": False},
        {"step": 2, "adapter": "policy-step-2", "reward_mean": 0.5, "loss": 0.1, "eval_reward": 0.75}]


def test_numeric_fields_keep_finite_numbers_only():
    assert numeric_fields({"step": 3, "a": 1, "b": float("nan"), "c": None, "d": "x", "e": True, "time": 9.0}) == \
        {"a": 1.0, "e": 1.0}


def test_tensorboard_sink_writes_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = Trackers(["tensorboard"], tmp_path, "run", {"lr": 0.1})
    for row in ROWS:
        trackers.log(row)
    trackers.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("eval_reward")] == [(2, 0.75)]


def test_wandb_sink_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = Trackers(["wandb"], tmp_path, "run", {"lr": 0.1})
    assert "wandb" in trackers.sinks, "wandb did not start offline"
    for row in ROWS:
        trackers.log(row)
    trackers.close()
    assert list(tmp_path.rglob("run-*.wandb")), "no offline run file written"


def test_mlflow_sink_file_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trackers = Trackers(["mlflow"], tmp_path, "run", {"lr": 0.1})
    assert "mlflow" in trackers.sinks, "mlflow did not start with a file store"
    run_id = trackers.sinks["mlflow"].run.info.run_id
    for row in ROWS:
        trackers.log(row)
    trackers.close()
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    history = client.get_metric_history(run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    assert client.get_run(run_id).data.params["lr"] == "0.1"


def test_trackio_sink_local(tmp_path, monkeypatch):
    import uuid

    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is first imported
    import trackio.utils

    where = Path(trackio.utils.TRACKIO_DIR)  # an earlier test may have imported trackio with another dir
    name = f"artsg-test-{uuid.uuid4().hex[:8]}"
    before = set(where.rglob("*")) if where.exists() else set()
    trackers = Trackers(["trackio"], tmp_path, name, {"lr": 0.1})
    assert "trackio" in trackers.sinks, "trackio did not start locally"
    for row in ROWS:
        trackers.log(row)
    trackers.close()
    written = [p for p in where.rglob("*") if p.is_file() and p not in before]
    assert written, f"trackio wrote nothing locally under {where}"


def test_a_failing_sink_warns_once_and_never_breaks_training(tmp_path, caplog):
    class Broken:
        def __init__(self, *args):
            self.calls = 0

        def log(self, step, values):
            self.calls += 1
            raise RuntimeError("tracker server down")

        def close(self):
            raise AssertionError("a dropped sink is not closed")

    def unimportable(*args):
        raise ImportError("No module named 'wandb'")

    caplog.set_level(logging.WARNING, logger="artsg_nb.run.trackers")
    trackers = Trackers(["tensorboard", "wandb"], tmp_path, "run", {}, factories={"tensorboard": Broken,
                                                                                    "wandb": unimportable})
    broken = trackers.sinks["tensorboard"]
    for row in ROWS:
        trackers.log(row)
    trackers.close()
    assert broken.calls == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "'wandb' could not start" in warnings[0] and "failed to log" in warnings[1]
    with pytest.raises(ValueError, match="unknown trackers"):
        Trackers(["neptune"], tmp_path, "run", {})
