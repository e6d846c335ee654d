"""A used run dir: a fresh start archives the whole earlier run (issue 49 defect 5, issue 50 item 2),
and a start cell run twice in one kernel takes over its own live run instead of RunDirBusyError."""
import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from artsg_nb.run import rundir
from artsg_nb.run.rundir import archive_earlier_run, take_over
from artsg_nb.run.session import GRPORun, RunConfig
from artsg_nb.serving.procs import RunDirBusyError, RunDirLock
from scripted_tasks import ADDITION_WITH_SIGNAL


def _earlier_run(run_dir: Path) -> None:
    """What a quickstart leaves behind: every kind of entry a run dir holds."""
    (run_dir / "adapters" / "policy-step-3").mkdir(parents=True)
    (run_dir / "adapters" / "policy-step-3" / "adapter_model.safetensors").write_bytes(b"w")
    (run_dir / "rollouts").mkdir()
    (run_dir / "rollouts" / "step-3.jsonl").write_text("{}\n")
    (run_dir / "history.jsonl").write_text('{"step": 1}\n')
    (run_dir / "history.20261206-101010.jsonl").write_text('{"step": 1}\n')
    (run_dir / "training.png").write_bytes(b"png")
    (run_dir / "tensorboard").mkdir()
    (run_dir / "config.json").write_text("{}")
    (run_dir / ".lock").write_text("123")
    (run_dir / "cpu.server.json").write_text("{}")
    (run_dir / "cpu.log").write_text("==== start\n")


def test_a_fresh_start_archives_the_whole_earlier_run_and_says_where(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _earlier_run(run_dir)
    target = archive_earlier_run(run_dir, stamp="20261207-121500")
    assert target == run_dir / "archive" / "20261207-121500"
    assert sorted(p.name for p in target.iterdir()) == [
        "adapters", "config.json", "history.20261206-101010.jsonl", "history.jsonl", "rollouts", "tensorboard",
        "training.png"]
    assert (target / "adapters" / "policy-step-3" / "adapter_model.safetensors").read_bytes() == b"w"
    # what belongs to the directory stays: the lock, the live server's record, the appended logs
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "archive", "cpu.log", "cpu.server.json"]
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and str(target) in out and "resume=True" in out


def test_a_second_archive_in_the_same_second_gets_its_own_folder(tmp_path, capsys):
    run_dir = tmp_path / "run"
    for _ in range(2):
        (run_dir / "rollouts").mkdir(parents=True)
        archive_earlier_run(run_dir, stamp="20261207-121500")
    assert sorted(p.name for p in (run_dir / "archive").iterdir()) == ["20261207-121500", "20261207-121500-1"]


def test_a_dir_without_steps_is_left_as_it_is(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")  # a start that failed before its first step
    (run_dir / "history.jsonl").write_text("")
    assert archive_earlier_run(run_dir) is None and archive_earlier_run(tmp_path / "absent") is None
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "history.jsonl"]
    assert capsys.readouterr().out == ""


class _Run:
    """What take_over reads of a GRPORun: run_dir, cfg, its lock, server, whether a step is under way, stop()."""

    def __init__(self, run_dir, stepping=False, **cfg):
        self.run_dir, self.server, self.stopped = run_dir, None, False
        self.cfg = RunConfig(run_dir=str(run_dir), **cfg)
        self._lock = RunDirLock(run_dir)
        self.in_step = stepping

    def stop(self):
        self.stopped = True
        self._lock.release()


def test_a_started_run_of_the_same_dir_is_stopped_and_replaced(tmp_path, capsys):
    old = _Run(tmp_path / "run")
    take_over(old)
    old._lock.acquire()
    new = _Run(tmp_path / "run")
    take_over(new)
    assert old.stopped and not old._lock.held
    new._lock.acquire()  # the lock is free for the new run
    assert "took over" in capsys.readouterr().out
    new.stop()
    other = _Run(tmp_path / "run")
    take_over(other)  # the registered run already stopped: nothing to take over, nothing said
    assert capsys.readouterr().out == "" and not other.stopped


def test_a_changed_configuration_stops_the_old_server_too(tmp_path, monkeypatch, capsys):
    """Kept, a server the new run does not reuse (another engine, model, ...) would run unused."""
    class Live(rundir.Server):
        def __init__(self):
            self.stopped = False

        def alive(self):
            return not self.stopped

        def stop(self, timeout_s=10.0):
            self.stopped = True

    for new_cfg, kept in (({}, True), ({"resume": True}, True), ({"group_size": 4}, False)):
        old = _Run(tmp_path / "run")
        old.server = server = Live()
        stop = old.stop
        old.stop = lambda: (old.server.stop() if old.server is not None else None, stop())
        take_over(old)
        old._lock.acquire()
        new = _Run(tmp_path / "run", **new_cfg)
        take_over(new)
        assert server.alive() == kept and old.stopped, new_cfg
        assert ("kept its server" in capsys.readouterr().out) == kept
        new._lock.acquire()
        new.stop()


def test_a_run_in_the_middle_of_a_step_is_not_stopped_under_it(tmp_path):
    old = _Run(tmp_path / "run", stepping=True)
    take_over(old)
    old._lock.acquire()
    with pytest.raises(RunDirBusyError, match="middle of a step. Try: wait"):
        take_over(_Run(tmp_path / "run"))
    assert not old.stopped
    old.stop()


def test_start_twice_takes_over_and_a_fresh_start_shows_only_its_own_steps(tiny_model_dir, tmp_path, capsys):
    """The quickstart's start cell run twice, then a fresh start in the same dir: the second start
    reuses the first one's server (same pid), and after the fresh start samples(), the history and
    the adapters are the new run's only (issue 49 defect 5: the old step showed beside step 1)."""
    cfg = RunConfig(task=ADDITION_WITH_SIGNAL, engine="cpu", model_path=str(tiny_model_dir),
                    run_dir=str(tmp_path / "run"), group_size=2, groups_per_step=1, verify_adapter=False)
    first = GRPORun(cfg).start()
    try:
        pid = first.server.pid
        asyncio.run(first.step())
        asyncio.run(first.step())
        second = GRPORun(cfg).start()  # was: RunDirBusyError "in use by this kernel"
    finally:
        first.stop()
    try:
        assert second.server.pid == pid and second.server.alive(), "the live server was not reused"
        assert not first._lock.held
        out = capsys.readouterr().out
        assert "took over" in out and "held an earlier run" in out
        assert f"took over from the run this kernel started there earlier (stopped it at step 2, kept its server)" in out
        assert not [line for line in out.splitlines() if line.startswith("stopped ")], out  # one line says it
        asyncio.run(second.step())
        assert list(second.samples()["step"].unique()) == [1]
        assert sorted(p.name for p in (second.run_dir / "adapters").iterdir()) == ["policy-step-0", "policy-step-1"]
        assert [json.loads(line)["step"] for line in (second.run_dir / "history.jsonl").read_text().splitlines()] == [1]
        archived = next((second.run_dir / "archive").iterdir())
        assert sorted(p.name for p in (archived / "rollouts").iterdir()) == ["step-1.jsonl", "step-2.jsonl"]
    finally:
        second.stop()
    assert not rundir._holds_lock(second)
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"stopped {cfg.run_dir} at step 1: server stopped;")
    with GRPORun(replace(cfg, resume=True)) as resumed:
        assert f"resumed {cfg.run_dir} at step 1 (policy-step-1): the next step is 2." in capsys.readouterr().out
        assert resumed.trainer.step == 1 and not list((resumed.run_dir / "archive").iterdir())[1:]


def test_make_demo_archives_the_earlier_demo_with_its_executed_notebook(tmp_path, monkeypatch, capsys):
    """The executed notebook is written before the quickstart's start cell archives: it must go
    with the run it belongs to, not be moved half-written with the new run's start."""
    from artsg_nb import demo
    run_dir = tmp_path / "demo"
    (run_dir / "rollouts").mkdir(parents=True)
    (run_dir / "01_quickstart.executed.ipynb").write_text("the earlier demo")
    written = []
    monkeypatch.setattr(demo.papermill, "execute_notebook",
                        lambda src, out, **kw: written.append(Path(out).read_text() if Path(out).exists() else None))
    assert demo.main(["--run-dir", str(run_dir)]) == 0
    assert written == [None]
    [archived] = (run_dir / "archive").iterdir()
    assert (archived / "01_quickstart.executed.ipynb").read_text() == "the earlier demo"


def test_half_written_adapter_folders_alone_are_no_earlier_run(tmp_path):
    """A crashed save leaves `.tmp-*` folders; the start removes the stale ones, it does not
    archive them as a run (tests/faults/test_loop_faults.py's fixture is that case)."""
    from artsg_nb.run.rundir import holds_earlier_run

    (tmp_path / "adapters" / ".tmp-policy-step-3-0dead000").mkdir(parents=True)
    assert not holds_earlier_run(tmp_path)
    (tmp_path / "adapters" / "policy-step-2").mkdir()
    assert holds_earlier_run(tmp_path)


def test_a_fresh_start_in_a_folder_the_user_also_keeps_files_in_moves_only_the_run(tmp_path, capsys):
    """run_dir="." (a notebook's own folder): the run's entries go to the archive; the user's
    notebooks, data and .git stay where they are (found in review)."""
    _earlier_run(tmp_path)
    for name in ("analysis.ipynb", "data.csv"):
        (tmp_path / name).write_text("mine")
    (tmp_path / ".git").mkdir()
    target = archive_earlier_run(tmp_path, stamp="20261207-140000")
    assert {"analysis.ipynb", "data.csv", ".git"} <= {p.name for p in tmp_path.iterdir()}
    assert not {"analysis.ipynb", "data.csv", ".git"} & {p.name for p in target.iterdir()}
    assert {"history.jsonl", "adapters", "rollouts"} <= {p.name for p in target.iterdir()}
