"""A run's rollouts, sampled one step ahead while the trainer updates (RunConfig.pipeline).

What it does: `SampleAhead` supplies the two halves of a step that pipelining changes.
`rollouts(step)` returns the step's groups: those sampled ahead during the previous update when
they are for this step, else a fresh synchronous rollout (the first step, a resumed run, a step
after a skipped update or an error). `train(groups, step, release)` starts the rollouts of
step+1 as an asyncio task on the server (under the newest published adapter, the one the update
starts from) and runs the trainer's update in a worker thread meanwhile, then, in the same thread,
saves the new adapter version (a 256-token step's rollouts outlast its update by ~0.5 s on an
H100), and loads it into the server beside them (`stage`); the version is served (the older one
unloaded) only once those rollouts are in: the unload waits for the requests of the adapter they
sample from.
So step n+1 trains on rollouts one adapter version old: staleness at most 1, recorded per row
(`fields`, history.PipelineFields: `staleness`, `ahead_wait_s`: how long the update and its save waited for them, `reload_wait_s`:
how long the step waited for its reload once both the update and those rollouts had ended; reload_s
counts the save and load wherever they ran), corrected by importance
sampling against the server's logprobs (session.py makes grpo.is_mode default to "token_truncate",
TRL's truncated IS, when pipelining).
In `GRPORun.run()` a step followed by another may leave its version unpublished when the rollouts
ahead ended before its update (an 8-token step's: the save and load would come after both, on the
step's path): the next step's rollouts ahead serve it first (`serve_newest`), beside that step's
update, which needs only the trainer's weights. They still sample from the version the update
starts from, so staleness stays at most 1.

Invariants: the rollouts sampled ahead use the seeds of the step they will train (a pipelined
run draws the same prompts); they go through the same `with_restarts` and served-adapter check as
synchronous ones (checked when they start); at most one rollout is in flight and none outlives
the step that started it (a step is one `asyncio.run` in a notebook cell), so eval, `rollouts()`
and stop() never race one. A failure of the rollouts ahead is logged and the next step rolls out
afresh; a failed or cancelled update cancels them, and a cancelled step waits for the worker
thread to finish the update (a thread cannot be stopped) before the cancel goes up to the step,
which undoes it (versions.roll_back, its one rollback), so step() can simply be run again. With
pipeline=False `rollouts` is the step's synchronous rollout and the step trains without this
(run/step.py, released.py).

What it does not do: decide what a step is (run/step.py), restart servers (supervisor.py), save
or serve versions (versions.py), or the IS math (rl/grpo.py). It is handed the trainer,
the supervisor, the rollout source, the adapter versions and the clock; it knows nothing of the
run above it.
"""
from __future__ import annotations

import asyncio
import logging
import threading

from .clock import PhaseClock
from .row import PipelineFields
from .results import Rollouts, Saved, Update
from .source import RolloutSource
from .supervisor import ServerSupervisor
from .versions import AdapterVersions

log = logging.getLogger(__name__)


def staleness(groups, weights_version: str | None) -> int:
    """Versions between the adapter that sampled `groups` and the trainer's weights: 0 or 1."""
    return int(any(t.adapter != weights_version for g in groups for t in g.trajectories))


class SampleAhead:
    """Rollouts of step n+1 on the server while the trainer updates on step n's (module docstring)."""

    def __init__(self, pipeline: bool, trainer, supervisor: ServerSupervisor, source: RolloutSource | None,
                 versions: AdapterVersions | None, clock: PhaseClock | None = None):
        self.pipeline = pipeline
        self.trainer = trainer
        self.supervisor = supervisor
        self.source = source  # the step's rollouts (RolloutSource.rollouts)
        self.versions = versions  # saves, stages and serves the versions
        self.clock = clock or PhaseClock()
        self.ahead: Rollouts | None = None  # sampled during the last update
        self.ahead_task: asyncio.Task | None = None  # the rollouts being sampled ahead, while a step runs
        self.fields: PipelineFields | None = None  # this step's pipelining columns of the history row

    async def rollouts(self, step: int) -> Rollouts:
        """`step`'s rollouts: sampled ahead, or rolled out now."""
        ahead, self.ahead = self.ahead, None
        rollouts = ahead if ahead is not None and ahead.step == step else await self._timed_rollouts(step)
        self.fields = PipelineFields(staleness(rollouts.groups, self.versions.weights_version)) if self.pipeline else None
        return rollouts

    async def _timed_rollouts(self, step: int) -> Rollouts:
        """`step`'s rollouts under the trainer's newest version: one the step before left
        unpublished is served first (its seconds are not rollout_s)."""
        await self.versions.serve_newest(scrape=True)
        with self.clock.phase("rollouts") as lap:
            groups, hit = await self.supervisor.with_restarts(self.source.rollouts, step)
        return Rollouts(step, groups, hit, lap.seconds)

    async def train(self, groups, step: int, release: bool, leave_unpublished: bool = False) -> Update:
        """The trainer's update overlapped with step+1's rollouts, followed in its worker thread by
        the save of the new version (versions.save_ahead, while those rollouts still run; None
        while the served version's checkpoint is only in memory), then by its stage in the server
        beside the rollouts still running (`Update.saved` is then what that returned). With
        `leave_unpublished` (the next step serves the version) it is staged only while those
        rollouts still run: after them the next step loads it beside its own update."""
        if release:
            raise ValueError("pipeline=True with release_memory: the server cannot give its memory back while "
                             "it samples the next step's rollouts. Turn one of them off (run.release = False).")
        self.supervisor.update_from = self.trainer.step  # what the rollouts ahead are checked against
        ahead = self.ahead_task = asyncio.ensure_future(self._timed_rollouts(step + 1))
        ahead_done_at: list[float] = []  # when the rollouts ahead ended (the callback runs before this task wakes)
        ahead.add_done_callback(lambda _: ahead_done_at.append(self.clock.now()))
        staging = None
        try:
            update, trained_at = await self._train_in_thread(groups)
            if update.saved is not None and not (leave_unpublished and ahead.done()):
                staging = asyncio.ensure_future(self.versions.stage(update.saved))
            with self.clock.phase("ahead_wait") as lap:
                try:
                    self.ahead = await ahead
                except (Exception, asyncio.CancelledError) as e:  # the update is done: step+1 rolls out afresh
                    if asyncio.current_task().cancelling():  # this step is cancelled, not just the rollouts (stop())
                        raise
                    log.warning("rollouts of step %d sampled ahead failed or were cancelled (%r); step %d rolls "
                                "out afresh", step + 1, e, step + 1)
            self.fields.ahead_wait_s = lap.seconds
            if staging is not None:
                update.saved = await staging
            # from when both the update and the rollouts ahead had ended: the save and load left then
            ready = max(trained_at, ahead_done_at[0] if ahead_done_at else lap.t0 + lap.seconds)
            self.fields.reload_wait_s = self.clock.now() - ready  # the step adds its publish's seconds
        except BaseException:  # the step rolls the update back (versions.roll_back), once, on its way out
            if staging is not None and not staging.done():
                staging.cancel()  # a load the server may still make: the next stage or publish unloads it
                await asyncio.wait([staging])
            await self._cancel_ahead()
            raise
        finally:
            self.ahead_task, self.supervisor.update_from = None, None
        return update

    async def _train_in_thread(self, groups) -> tuple[Update, float]:
        """(update, trained_at): trainer.train_step, then versions.save_ahead, in a worker thread,
        so the event loop keeps sampling meanwhile; trained_at is the clock's time at which the
        update ended. Once the step is cancelled nothing more is saved, and the cancel goes up
        only after the thread has ended (a thread cannot be stopped), so the step's rollback
        comes after the update it undoes."""
        cancelled = threading.Event()

        def work() -> tuple[Update, float]:
            with self.clock.phase("train") as lap:
                metrics = self.trainer.train_step(groups)
            saved: Saved | None = self.versions.save_ahead() if not cancelled.is_set() else None
            return Update(metrics, lap.seconds, saved=saved), lap.t0 + lap.seconds

        update = asyncio.ensure_future(asyncio.to_thread(work))
        try:
            return await asyncio.shield(update)
        except asyncio.CancelledError:
            cancelled.set()
            await asyncio.wait([update])  # the thread cannot be stopped: the step undoes it once it ends
            raise


    async def _cancel_ahead(self) -> None:
        """Cancel the rollouts being sampled ahead and wait until they have stopped (their requests'
        cleanup included). Not cancelled twice: stop()'s `cancel_now` may have cancelled them already,
        and a second cancel would cut that cleanup short."""
        task, self.ahead = self.ahead_task, None
        if task is not None and not task.done():
            if not task.cancelling():
                task.cancel()
            await asyncio.wait([task])

    def cancel_now(self) -> None:
        """stop()'s part (synchronous): cancel the rollouts sampled ahead; forget held ones."""
        task, self.ahead = self.ahead_task, None
        if task is not None and not task.done():
            task.cancel()
