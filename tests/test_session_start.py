"""GRPORun.start's parallel start-up: the server starts while the trainer loads; failures of
either are reported and never leave a server behind."""
from __future__ import annotations

import threading

import pytest

from artsg_nb.serving.server import start_while as _in_parallel


class _Server:
    stopped = False

    def stop(self):
        self.stopped = True


def test_server_and_trainer_start_at_the_same_time():
    """Each side waits at a barrier for the other: run one after the other, the first would time
    out (BrokenBarrierError), so this holds on a loaded CI box where wall-clock sums would not."""
    server = _Server()
    both_started = threading.Barrier(2, timeout=10)
    got = _in_parallel(lambda: (both_started.wait(), server)[1], lambda: (both_started.wait(), "trainer")[1])
    assert got == (server, "trainer")


def test_a_failed_trainer_stops_the_started_server():
    server = _Server()

    def trainer():
        raise RuntimeError("no trainer")

    with pytest.raises(RuntimeError, match="no trainer"):
        _in_parallel(lambda: server, trainer)
    assert server.stopped


def test_when_both_fail_the_server_error_is_raised():
    def server():
        raise FileNotFoundError("model path")

    def trainer():
        raise ValueError("config.json")

    with pytest.raises(FileNotFoundError, match="model path") as err:
        _in_parallel(server, trainer)
    assert isinstance(err.value.__cause__, ValueError)


def test_a_failed_server_closes_the_built_trainer():
    """A RankedTrainer's rank processes must not outlive a start whose server failed."""
    class Trainer:
        closed = False

        def close(self):
            self.closed = True

    trainer = Trainer()

    def server():
        raise FileNotFoundError("model path")

    with pytest.raises(FileNotFoundError, match="model path"):
        _in_parallel(server, lambda: trainer)
    assert trainer.closed


def test_the_two_halves_of_a_start_are_spans_on_the_runs_clock():
    """GRPORun.start hands each half to its thread as PhaseClock.call: "server_start" and
    "trainer_build" are spans that overlap (a profiler reads the trainer's build from them)."""
    from artsg_nb.run.clock import PhaseClock

    clock, both_started = PhaseClock(), threading.Barrier(2, timeout=10)
    got = _in_parallel(lambda: clock.call("server_start", lambda: (both_started.wait(), "server")[1]),
                       lambda: clock.call("trainer_build", lambda: (both_started.wait(), "trainer")[1]))
    assert got == ("server", "trainer")
    spans = {s.name: s for s in clock.since(0.0)}
    assert set(spans) == {"server_start", "trainer_build"}
    assert spans["server_start"].t0 < spans["trainer_build"].t1 and spans["trainer_build"].t0 < spans["server_start"].t1
