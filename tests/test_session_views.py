"""GRPORun's notebook views without a server: the dashboard it shows is refreshed once more when
the run stops (it says "stopped", not "running" in green), and a live loop that fails ends its
progress bar red. Fast: fake server and step, no engine started."""
import asyncio
from types import SimpleNamespace

import matplotlib
import pytest

matplotlib.use("Agg")

from artsg_nb.view import plots  # noqa: E402
from artsg_nb.serving.gpus import GpuPlan  # noqa: E402
from artsg_nb.run.history import History  # noqa: E402
from artsg_nb.run.session import GRPORun, RunConfig  # noqa: E402


class FakeServer:
    url, config = "http://127.0.0.1:1", SimpleNamespace(engine="cpu")

    def __init__(self):
        self.running = True

    def alive(self):
        return self.running

    def stop(self):
        self.running = False


def fake_run(tmp_path) -> GRPORun:
    run = GRPORun(RunConfig(engine="cpu", run_dir=str(tmp_path), verbose=False))
    run.plan, run.server, run.history = GpuPlan(mode="cpu"), FakeServer(), History(tmp_path)
    return run


def test_stop_refreshes_the_dashboard_after_the_server(tmp_path, capsys):
    run = fake_run(tmp_path)
    dashboard = run.dashboard(refresh_s=None)  # outside Jupyter: printed once
    assert "running" in capsys.readouterr().out
    dashboard.refresh()
    assert dashboard.snapshot.alive is True
    run.stop()
    assert dashboard.snapshot.alive is False and dashboard.snapshot.note == "run stopped"


def test_the_runs_stop_says_run_stopped_even_when_the_refresh_thread_saw_the_server_stop_first(tmp_path, capsys):
    """The race a live dashboard has (seen in a browser test): its thread refreshes between the
    server's stop and the run's, sees the server gone and ends itself; the run's reason wins."""
    from artsg_nb.view.widgets.dashboard import SERVER_STOPPED

    run = fake_run(tmp_path)
    dashboard = run.dashboard(refresh_s=None)
    run.server.stop()
    dashboard.stop(reason=SERVER_STOPPED)  # what the refresh thread does when it sees that
    assert dashboard.snapshot.note == SERVER_STOPPED
    run.stop()
    assert dashboard.snapshot.note == "run stopped"


def test_a_failed_live_loop_ends_its_bar_red(tmp_path, monkeypatch):
    finished = []
    monkeypatch.setattr(plots.LiveTraining, "finish", lambda self, ok: finished.append(ok))
    monkeypatch.chdir(tmp_path)  # LivePlot outside Jupyter writes training.png here
    run = fake_run(tmp_path)
    steps = iter([{"step": 1, "reward_mean": 0.5}])

    async def step(release, publish):  # run()'s step (step.GRPOStep.step)
        row = next(steps, None)
        if row is None:
            raise RuntimeError("server lost")
        run.history.append(row)
        return row

    run.steps = SimpleNamespace(step=step)
    with pytest.raises(RuntimeError, match="server lost"):
        asyncio.run(run.run(3, live=True))
    assert finished == [False]
    assert (tmp_path / "training.png").exists()  # the step that ran was drawn
    steps = iter([{"step": 2, "reward_mean": 0.6}])
    asyncio.run(run.run(1, live=True))
    assert finished == [False, True]
