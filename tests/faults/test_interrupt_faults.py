"""A notebook's interrupt (the stop button: a cancel at the step's next await) at every point of a
step leaves trainer, served adapter, `weights_version` and history consistent, on the CPU engine.

Injected at public seams, never by sleeping: the run's PhaseClock (`run.clock.phase`, every phase a
step times: the cancel is sent as the phase starts and lands at the step's next await) and a client
whose load or unload blocks on an event. After each interrupt the state is one of the two a step
may leave: undone (the trainer back at the served version, no row) or complete (its version the
trainer's, its row written); the next step continues with the next number.

In order (interrupt → state):
  - synchronous step, at rollouts / train / save / load / unload of the version before / verify /
    row → undone before the new version is served, complete after (before: an interrupt after the
    update left the trainer at N with policy-step-N unserved and no row, the next step trained as
    N+1 on rollouts of N-1, history [1, 2, 4]; one during the unload left weights_version at N-1
    and every later step() raised AdapterMismatchError);
  - 8 interrupts at seeded random phases of `run.run(5)`, synchronous and pipelined → contiguous
    history, the trainer's version served (or left to the next step) every time;
  - the trainer a step ahead of the served version → check_served refuses to roll out;
  - what the user sees: one line naming the step, the phase and what the next step() does, and
    a short traceback (no chain of the awaits it crossed).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import traceback
from dataclasses import replace

import pytest

from artsg_nb.rl.lora import AdapterMismatchError
from artsg_nb.run.session import GRPORun, RunConfig
from scripted_tasks import ADDITION_WITH_SIGNAL
from waiting import forever, wait_until_async

pytestmark = pytest.mark.faults

# scripted reward: every step has a signal, so every step trains and serves policy-step-N
CFG = RunConfig(task=ADDITION_WITH_SIGNAL, engine="cpu", group_size=2, groups_per_step=2, lora_rank=8,
                lora_alpha=16, seed=5, verbose=False, verify_every=1)


def _run(tmp_path, tiny_model_dir, fault_engine, **kw) -> GRPORun:
    return GRPORun(replace(CFG, engine=fault_engine, model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"),
                           **kw)).start()


def assert_consistent(run: GRPORun) -> None:
    """Trainer, history and the served adapter agree: history is 1..N with N the trainer's step,
    whose version is the trainer's weights, served (or left to the next step of run())."""
    n = run.trainer.step
    assert [r["step"] for r in run.history.rows] == list(range(1, n + 1)), (n, run.history.rows)
    assert [r["step"] for r in run.history.load(run.run_dir).rows] == list(range(1, n + 1)), "history on disk"
    assert run.weights_version == f"policy-step-{n}" and run.versions.weights_step == n
    left = run.versions.unpublished
    assert run.adapter == run.weights_version or (left is not None and left.name == run.weights_version), \
        (run.adapter, run.weights_version)


class Interrupter:
    """Cancels the task running a step when the run's clock starts phase `name` (its `nth`
    start, counted over every phase when `name` is None); from a worker thread through the loop."""

    def __init__(self, run: GRPORun, name: str | None, nth: int = 1):
        self.run, self.name, self.nth, self.seen, self.fired = run, name, nth, 0, None
        self.task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        real = run.clock.phase

        @contextlib.contextmanager
        def phase(phase_name):
            self._started(phase_name)
            with real(phase_name) as lap:
                yield lap

        self._real, run.clock.phase = real, phase

    def _started(self, phase_name: str) -> None:
        if self.task is None or self.fired is not None or (self.name is not None and phase_name != self.name):
            return
        self.seen += 1
        if self.seen == self.nth:
            self.fired = phase_name
            if threading.current_thread() is threading.main_thread():
                self.task.cancel()
            else:  # a pipelined update's thread (train, save)
                self.loop.call_soon_threadsafe(self.task.cancel)

    async def interrupt(self, coro) -> bool:
        """Run `coro`; whether it was interrupted."""
        self.loop, self.task = asyncio.get_running_loop(), asyncio.ensure_future(coro)
        await asyncio.wait([self.task])
        if not self.task.cancelled():
            self.task.result()  # an error, not an interrupt, fails the test
        return self.task.cancelled()

    def remove(self) -> None:
        self.run.clock.phase = self._real


def interrupt_at_phase(run: GRPORun, name: str) -> str:
    """run.step() interrupted as phase `name` starts; the phase it fired at."""
    interrupter = Interrupter(run, name)
    try:
        assert asyncio.run(interrupter.interrupt(run.step())) or name == "row", f"not interrupted at {name}"
    finally:
        interrupter.remove()
    return interrupter.fired


def interrupt_in_client(run: GRPORun, method: str, name: str) -> None:
    """run.step() interrupted while the client's `method` (load_adapter / unload_adapter) of
    adapter `name` waits."""
    client, entered = run.client, asyncio.Event()
    real = getattr(client, method)

    async def blocked(adapter, *args):
        if adapter != name:
            return await real(adapter, *args)
        entered.set()
        await forever()

    async def go():
        setattr(client, method, blocked)
        step = asyncio.ensure_future(run.step())
        try:
            await wait_until_async(entered.is_set)
        finally:
            setattr(client, method, real)
        step.cancel()
        await asyncio.wait([step])
        assert step.cancelled()

    asyncio.run(go())


@pytest.fixture
def sync_run(tmp_path, tiny_model_dir, fault_engine):
    run = _run(tmp_path, tiny_model_dir, fault_engine)
    yield run
    run.stop()


def test_an_interrupt_at_each_phase_of_a_synchronous_step_undoes_it_or_completes_it(sync_run):
    run = sync_run
    asyncio.run(run.step())
    for phase, done in (("rollouts", False), ("train", False), ("save", False), ("load", False),
                        ("verify", True), ("row", True)):
        before = run.trainer.step
        interrupt_at_phase(run, phase)
        assert run.trainer.step == before + done, f"interrupted at {phase}"
        assert_consistent(run)
        if done and phase == "verify":
            assert run.history.last["probe_mad"] is None, "the row of a step stopped in its check has no probe"
        row = asyncio.run(run.step())  # the next step continues: the same number redone, or the next
        assert row["step"] == run.trainer.step == before + done + 1
        assert_consistent(run)


def test_an_interrupt_in_the_load_or_the_unload_of_a_version_leaves_no_wedged_run(sync_run):
    """The load interrupted: undone, its redo loads the same name again (the server refuses a name
    twice: the publisher unloads it first). The unload of the version before interrupted: the new
    version is served, so the step is complete (before: weights_version stayed at N-1 and every
    later step() raised AdapterMismatchError)."""
    run = sync_run
    asyncio.run(run.step())
    interrupt_in_client(run, "load_adapter", "policy-step-2")
    assert run.trainer.step == 1 and run.adapter == "policy-step-1"
    assert_consistent(run)
    interrupt_in_client(run, "unload_adapter", "policy-step-1")  # after policy-step-2's load
    assert run.trainer.step == 2 and run.adapter == "policy-step-2"
    assert_consistent(run)
    assert asyncio.run(run.step())["step"] == 3 and run.adapter == "policy-step-3"
    assert_consistent(run)
    run.trainer.step += 1  # the old defect's state: the trainer a step ahead of the version it serves
    with pytest.raises(AdapterMismatchError, match="at step 4 but the served policy-step-3 holds the weights of step 3"):
        asyncio.run(run.step())  # check_served refuses to roll out (before: it compared only the names)
    run.trainer.step -= 1


def test_the_user_sees_one_line_where_it_stopped_and_a_short_traceback(sync_run, caplog):
    run = sync_run
    asyncio.run(run.step())
    interrupter = Interrupter(run, "load")

    async def cell():
        interrupter.loop, interrupter.task = asyncio.get_running_loop(), asyncio.current_task()
        try:
            await run.step()
        except asyncio.CancelledError as e:  # what the notebook shows
            return "".join(traceback.format_exception(e))

    with caplog.at_level(logging.WARNING, logger="artsg_nb.run.step"):
        shown = asyncio.run(cell())
    interrupter.remove()
    lines = [r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()]
    assert lines == ["step 2 interrupted during publish: undone, the trainer is back at step 1 (policy-step-1); "
                     "the next step() redoes step 2."], lines
    assert "During handling" not in shown and shown.count("File ") <= 5, shown
    assert len(shown) < 1500, shown


@pytest.mark.parametrize("pipeline", [False, True], ids=["synchronous", "pipelined"])
def test_eight_interrupts_at_random_points_of_run_keep_history_and_served_adapter_consistent(
        tmp_path, tiny_model_dir, fault_engine, pipeline):
    """The held-out trial: `run.run(5)` interrupted at a seeded random phase, 8 times in a row
    (each time the run goes on from where the interrupt left it), then run to the end."""
    rng = random.Random(49 + pipeline)
    run = _run(tmp_path, tiny_model_dir, fault_engine, pipeline=pipeline, verify_every=3)
    try:
        fired = []
        for _ in range(8):
            interrupter = Interrupter(run, None, nth=rng.randint(1, 40))
            try:
                interrupted = asyncio.run(interrupter.interrupt(run.run(5)))
            finally:
                interrupter.remove()
            fired.append((interrupter.fired, interrupted))
            assert_consistent(run)
        asyncio.run(run.run(2))
        assert_consistent(run)
        assert run.adapter == f"policy-step-{run.trainer.step}", "the last step of run() serves its version"
        assert sum(i for _, i in fired) >= 6, fired
    finally:
        run.stop()
