"""One-step off-policy pipelining of a GRPO run (RunConfig.pipeline): sample ahead while training.

What it does: `PipelinedSteps`, mixed into session.GRPORun, supplies the two halves of a step
that pipelining changes. `_step_rollouts(step)` returns the step's groups: those sampled ahead
during the previous update when they are for this step, else a fresh synchronous rollout (the
first step, a resumed run, a step after a skipped update or an error). `_step_train(groups, step)`
starts the rollouts of step+1 as an asyncio task on the server (under the newest published
adapter, the one the update starts from) and runs the trainer's update in a worker thread
meanwhile; the adapter is saved and hot-reloaded only once those rollouts are in (the reload
unloads the adapter they sample from). So step n+1 trains on rollouts one adapter version old:
staleness at most 1, recorded per row (`staleness`, `ahead_wait_s`: how long the update waited
for them), corrected by importance sampling against the server's logprobs (session makes
grpo.is_mode default to "token_truncate", TRL's truncated IS, when pipelining).

Invariants: the rollouts sampled ahead use the seeds of the step they will train (a pipelined
run draws the same prompts); they go through the same `_with_restarts` and `_check_served` as
synchronous ones (checked when they start); at most one rollout is in flight and none outlives
the step that started it (a step is one `asyncio.run` in a notebook cell), so eval, `rollouts()`
and stop() never race one. A failure of the rollouts ahead is logged and the next step rolls out
afresh; a failed or cancelled update cancels them, and a cancelled step undoes an update the
worker thread finished (a thread cannot be stopped), so step() can simply be run again. With
pipeline=False both halves are the synchronous code as it was.

What it does not do: decide what a step is (session.py), restart servers (recovery.py), or the
IS math (grpo.py). It uses the run's cfg, run_dir, trainer, release, _weights_version,
_with_restarts, _rollouts and _train.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from types import MappingProxyType

from .lora import load_version

log = logging.getLogger(__name__)


def staleness(groups, weights_version: str | None) -> int:
    """Versions between the adapter that sampled `groups` and the trainer's weights: 0 or 1."""
    return int(any(t.adapter != weights_version for g in groups for t in g.trajectories))


class PipelinedSteps:
    """Rollouts of step n+1 on the server while the trainer updates on step n's (module docstring)."""

    _ahead: tuple | None = None  # (step, groups, hit_rate, rollout_s) sampled during the last update
    _ahead_task: asyncio.Task | None = None  # the rollouts being sampled ahead, while a step runs
    _pipeline_row: Mapping = MappingProxyType({})  # this step's pipelining columns of the history row

    async def _step_rollouts(self, step: int):
        """(groups, hit_rate, rollout_s) of `step`: sampled ahead, or rolled out now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            groups, hit, rollout_s = ahead[1:]
        else:
            groups, hit, rollout_s = await self._timed_rollouts(step)
        self._pipeline_row = ({"staleness": staleness(groups, self._weights_version), "ahead_wait_s": None}
                              if self.cfg.pipeline else {})
        return groups, hit, rollout_s

    async def _timed_rollouts(self, step: int):
        t0 = time.perf_counter()
        groups, hit = await self._with_restarts(self._rollouts, step)
        return groups, hit, time.perf_counter() - t0

    async def _step_train(self, groups, step: int):
        """(metrics, train_s, (release_s, resume_s)): the update, overlapped with step+1's rollouts."""
        if not self.cfg.pipeline:
            return await self._train(groups)
        if self.release:
            raise ValueError("pipeline=True with release_memory: the server cannot give its memory back while "
                             "it samples the next step's rollouts. Turn one of them off (run.release = False).")
        before = self.trainer.step
        ahead = self._ahead_task = asyncio.ensure_future(self._timed_rollouts(step + 1))
        trained = False
        try:
            t0 = time.perf_counter()
            metrics = await self._train_in_thread(groups, before)
            train_s, trained = time.perf_counter() - t0, True
            t1 = time.perf_counter()
            try:
                self._ahead = (step + 1, *await ahead)
            except (Exception, asyncio.CancelledError) as e:  # the update is done: step+1 rolls out afresh
                if asyncio.current_task().cancelling():  # this step is cancelled, not just the rollouts (stop())
                    raise
                log.warning("rollouts of step %d sampled ahead failed or were cancelled (%r); step %d rolls "
                            "out afresh", step + 1, e, step + 1)
            self._pipeline_row["ahead_wait_s"] = time.perf_counter() - t1
        except BaseException:
            await self._cancel_ahead()
            if trained:  # cancelled while waiting: the update was not saved, so it is undone
                self._roll_back(before)
            raise
        finally:
            self._ahead_task = None
        return metrics, train_s, (None, None)

    async def _train_in_thread(self, groups, before: int) -> dict:
        """trainer.train_step in a worker thread, so the event loop keeps sampling meanwhile."""
        update = asyncio.ensure_future(asyncio.to_thread(self.trainer.train_step, groups))
        try:
            return await asyncio.shield(update)
        except asyncio.CancelledError:
            await asyncio.wait([update])  # the thread cannot be stopped: let it finish, then undo it
            if update.exception() is None:
                self._roll_back(before)
            raise

    def _roll_back(self, step: int) -> None:
        """The trainer back to the saved version `step` (weights, optimizer, step, RNG)."""
        self.trainer.load_checkpoint(load_version(self.run_dir / "adapters", step).path)
        log.warning("step %d cancelled during its update; trainer rolled back to step %d", step + 1, step)

    async def _cancel_ahead(self) -> None:
        """Cancel the rollouts being sampled ahead and wait until they have stopped."""
        task, self._ahead = self._ahead_task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])

    def _cancel_ahead_now(self) -> None:
        """stop()'s part (synchronous): cancel the rollouts sampled ahead; forget held ones."""
        task, self._ahead = self._ahead_task, None
        if task is not None and not task.done():
            task.cancel()
