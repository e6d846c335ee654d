"""One GRPO step, top to bottom: rollouts → rewards → update → version → row.

What it does: `GRPOStep.step(release, publish)` is the whole step in one place, each phase a
method on named parts, each handing the next a typed result (results.py), each timed by the run's
PhaseClock:

  rollouts  the step's groups from the server (pipeline.SampleAhead: sampled ahead during the
            previous update when pipelining, else now)
  rewards   require them, write them to run_dir/rollouts, find groups without signal
  update    the trainer's step: skipped without signal (the step still counts and is checkpointed),
            synchronous with the server's memory released around it (released.py), or pipelined
            beside the next step's rollouts (SampleAhead.train)
  version   the new version saved, loaded and served (versions.AdapterVersions), checked when due;
            or, in `run()`, left to the next step to serve beside its own update
  row       the history row (row.StepRow) written, logged to trackers, old versions pruned

`train_on(groups, release)` is the same step on groups rolled out elsewhere (ART). Each phase is
a point where the step can stop (an error, or an interrupt: the notebook's stop button cancels at
the next await), and the step has one point of no return: its version becoming the trainer's
(served, left to the next step, or a skipped update's checkpoint; versions.weights_step). Stopped
in rollouts or rewards nothing has changed; stopped before that point the trainer is rolled back
to the version the step started from (versions.roll_back), so the next step() redoes the step (a
version saved but not served stays on disk without a row: resume never takes it, the redo
replaces it); stopped after it the row is written with what the step has, so the next step() is
the next one. A row that cannot be written is kept and written first by the next step, so history
has no gap. An interrupt goes up (the cell stops) with one logged line saying where it stopped.

What it does not do: start or stop anything (session.py), restart servers (supervisor.py), the
loss (rl/grpo.py). It is handed the run's parts; it knows nothing of the run above it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ..rollout.evaluate import history_fields
from ..rollout.samples import constant_groups, samples_block, write_rollouts
from ..rollout.trajectory import require_rewards
from .clock import PhaseClock
from .config import RunConfig
from .history import History
from .row import EvalFields, FleetFields, MemoryFields, PipelineFields, step_row
from .pipeline import SampleAhead
from .released import train_released
from .results import Published, Rewards, Rollouts, Saved, Update
from .retention import prune_adapters
from .scrape import MetricsScrape
from .source import RolloutSource
from .supervisor import ServerSupervisor
from .trackers import Trackers
from .versions import AdapterVersions

log = logging.getLogger(__name__)


class GRPOStep:
    """The run's step on its parts (module docstring)."""

    def __init__(self, cfg: RunConfig, trainer, supervisor: ServerSupervisor, source: RolloutSource,
                 sampler: SampleAhead, versions: AdapterVersions, scrape: MetricsScrape, history: History,
                 trackers: Trackers, clock: PhaseClock):
        self.cfg, self.trainer, self.supervisor, self.source = cfg, trainer, supervisor, source
        self.sampler, self.versions, self.scrape, self.history = sampler, versions, scrape, history
        self.trackers, self.clock = trackers, clock
        self.unwritten_row: dict | None = None  # a completed step whose history write failed

    async def step(self, release: bool, publish: bool = True) -> dict:
        """One step. publish=False (a step of `run()` followed by another): a pipelined step may
        leave its new version saved and unserved; the next step serves it beside its own update."""
        return await self._interruptible(self._step(release, publish))

    async def _step(self, release: bool, publish: bool) -> dict:
        async with self._bracket(release):
            step = self.trainer.step + 1
            log.info("step %d: rollouts under %s", step, self.versions.weights_version)  # a stall names its phase
            rollouts = await self.sampler.rollouts(step)
            log.info("step %d: %d groups in %.2f s; update%s", step, len(rollouts.groups), rollouts.rollout_s,
                     " (server memory released around it)" if release else "")
            rewards = self._rewards(rollouts)
            leave = not publish and self._leaves_unpublished(step)
            return await self._train_and_serve(rollouts, rewards, release, leave, self.cfg.pipeline,
                                               self.sampler.fields)

    async def train_on(self, groups, release: bool) -> dict:
        """The step on groups rolled out elsewhere, from the served adapter: update, version, row
        (no rollout_s / hit_rate)."""
        return await self._interruptible(self._train_on(groups, release))

    async def _train_on(self, groups, release: bool) -> dict:
        async with self._bracket(release):
            await self.versions.serve_newest()
            rollouts = Rollouts(self.trainer.step + 1, groups, None, None)
            rewards = self._rewards(rollouts)
            return await self._train_and_serve(rollouts, rewards, release, False, False, None)

    async def _train_and_serve(self, rollouts: Rollouts, rewards: Rewards, release: bool, leave: bool,
                               pipelined: bool, pipeline: PipelineFields | None) -> dict:
        """update → version → row, around the step's one point of no return: its version becomes
        the trainer's (served, left to the next step, or a skipped update's checkpoint:
        versions.weights_step reaches the step). Stopped before it (an error, or an interrupt:
        a cancel at the next await, KeyboardInterrupt) the trainer is rolled back to the version
        it started from, so the next step() redoes the step; stopped after it, the step's row is
        written from what it has (no probe, no evaluation) before the error goes up, so the next
        step() is the next one. A version saved and not served stays on disk without a row:
        resume never takes it, and the redo replaces it."""
        before, update = self.trainer.step, None
        try:
            update = await self._update(rollouts, rewards, release, leave, pipelined)
            published = await self._version(rollouts, update, leave)
            return await self._row(rollouts, update, published, pipeline)
        except BaseException:
            if self.versions.weights_step != rollouts.step:  # the step's one rollback
                self.versions.roll_back(before)
            elif update is not None and not self._row_kept(rollouts.step):
                try:
                    self.write_row(self._build_row(rollouts, update, None, pipeline))
                except BaseException:  # noqa: BLE001 — kept for the next step (write_row); the first error goes up
                    pass
            raise

    # ---- the phases -------------------------------------------------------------------------------
    def _rewards(self, rollouts: Rollouts) -> Rewards:
        with self.clock.phase("rewards"):
            # written first: a step that stops for want of rewards leaves its completions to read
            write_rollouts(self.history.run_dir, rollouts.step, rollouts.groups)
            require_rewards(rollouts.groups)
            zero_adv, no_signal = constant_groups(rollouts.groups)
        return Rewards(zero_adv, not no_signal)

    async def _update(self, rollouts: Rollouts, rewards: Rewards, release: bool, leave: bool,
                      pipelined: bool) -> Update:
        with self.clock.phase("update"):
            if not rewards.signal:  # every group has one reward: no gradient (versions.save_skipped)
                version = self.versions.save_skipped()
                return Update({"zero_adv_groups": rewards.zero_adv_groups, "update_skipped": True}, 0.0,
                              saved=Saved(version, 0.0))
            if pipelined:
                return await self.sampler.train(rollouts.groups, rollouts.step, release, leave)
            return await train_released(self.trainer, rollouts.groups, self.supervisor, release,
                                        self.cfg.release_tags, self.clock)

    async def _version(self, rollouts: Rollouts, update: Update, leave: bool) -> Published:
        step = rollouts.step
        with self.clock.phase("version"):
            if update.skipped:  # the served adapter stays (same weights)
                if not leave:  # no update to overlap with: a version the step before left is served now
                    await self.versions.serve_newest()
                self.scrape.send()
                return Published(update.saved.version, None)
            if leave and update.saved is not None:  # served by the next step, beside its update
                log.info("step %d: update in %.2f s; %s served from the next step", step, update.train_s,
                         update.saved.version.name)
                self.scrape.send()
                return self.versions.leave(update.saved)
            log.info("step %d: update in %.2f s; save and reload", step, update.train_s)
            self.scrape.send()  # sent while the reload waits on the server
            return await self.versions.publish(rollouts.groups, update.saved)

    async def _row(self, rollouts: Rollouts, update: Update, published: Published,
                   pipeline: PipelineFields | None) -> dict:
        step = rollouts.step
        with self.clock.phase("row"):
            await self.scrape.wait()  # the step's /metrics scrape, sent beside its reload or a serve
            reload_s, publish_s = published.reload_s, self.versions.take_publish_s()
            if publish_s:  # the serve of the version before, made in this step (versions.serve_newest)
                reload_s = (reload_s or 0.0) + publish_s
            if pipeline is not None and pipeline.reload_wait_s is not None:  # the load's wait, then the publish's
                pipeline.reload_wait_s += published.waited_s
            evaluation = await self._evaluation(step)
            row = self._build_row(rollouts, update, published, pipeline, reload_s, evaluation)
            self.write_row(row)
            if self.cfg.verbose and self.cfg.print_samples:  # a short block under the step's line
                print(samples_block(rollouts.groups, self.cfg.print_samples, step), flush=True)
            self.trackers.log(row)
            with self.clock.phase("prune"):
                prune_adapters(self.versions.adapters, self.cfg.keep_adapters, self.cfg.keep_every,
                               protect=(*self.versions.protected(), published.version.step))
        return row

    def _build_row(self, rollouts: Rollouts, update: Update, published: Published | None,
                   pipeline: PipelineFields | None, reload_s: float | None = None,
                   evaluation: EvalFields | None = None) -> dict:
        """The step's row (row.step_row); `published` None: a step interrupted after its
        version was served, whose row has no reload_s or probe. Statistics that cannot be computed
        never lose the row: it is written with what is known, and a warning says why."""
        stats = self.supervisor.server.worker_stats()  # a fleet's per-worker figures since the last scrape
        try:
            return step_row(rollouts.step, self.versions.weights_version, rollouts.groups, update.metrics,
                            hit_rate=rollouts.hit_rate, rollout_s=rollouts.rollout_s, train_s=update.train_s,
                            reload_s=reload_s, probe=published.probe if published else None,
                            memory=MemoryFields(update.release_s, update.resume_s),
                            restarts=self.supervisor.restarts, pipeline=pipeline, eval=evaluation,
                            fleet=FleetFields(**stats) if stats else None,
                            kv_tokens=self.scrape.tracker.kv_tokens, in_flight=self.cfg.concurrency).as_dict()
        except Exception as e:  # noqa: BLE001 — the step is done: its row is written whatever a statistic does
            log.warning("step %d: its row's statistics could not be computed (%s: %s); written without them",
                        rollouts.step, type(e).__name__, e)
            return {"step": rollouts.step, "adapter": self.versions.weights_version, "groups": len(rollouts.groups),
                    "update_skipped": update.skipped, "restarts": self.supervisor.restarts, "time": time.time()}

    def _row_kept(self, step: int) -> bool:
        """Whether step `step`'s row is written, or kept for the next step to write."""
        last = self.history.last
        return (last is not None and last["step"] == step) or (
            self.unwritten_row is not None and self.unwritten_row["step"] == step)

    async def _interruptible(self, step_coro) -> dict:
        """`await step_coro`; an interrupt (the notebook's stop button: a cancel, or KeyboardInterrupt)
        goes up as it came, so the cell stops, with one line saying where the step stopped and how
        to go on, instead of the traceback of every await it crossed."""
        t0, step = self.clock.now(), self.trainer.step + 1
        try:
            return await step_coro
        except (asyncio.CancelledError, KeyboardInterrupt) as e:
            log.warning("%s", self._interrupted_line(step, t0))
            raise e.with_traceback(None) from None

    def _interrupted_line(self, step: int, t0: float) -> str:
        started = self.clock.since(t0)
        phase = max(started, key=lambda span: span.t0).name if started else "its start"
        if self.trainer.step >= step:
            return (f"step {step} interrupted during {phase}, after {self.versions.weights_version} became the "
                    f"trainer's: step {step} is complete and in history; the next step() is step {step + 1}.")
        return (f"step {step} interrupted during {phase}: undone, the trainer is back at step {self.trainer.step} "
                f"({self.versions.weights_version}); the next step() redoes step {step}.")

    # ---- around the phases ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _bracket(self, release: bool):
        """A step's frame: the row a failed write left first, the step's own lock and counters,
        the health watchdog on (a server silent for hang_timeout_s is restarted, the step's server
        work redone), and the starting version served."""
        self.write_unwritten_row()
        self.versions.begin_step()
        self.supervisor.watchdog.start()
        try:
            await self.versions.serve_initial(self.cfg.release_tags if release else None)
            yield
        finally:
            self.versions.end_step()
            self.scrape.drop()  # a step that failed before its row awaited its scrape
            await self.supervisor.watchdog.stop()

    def _leaves_unpublished(self, step: int) -> bool:
        """Whether a step of `run()` leaves its new version to the next step to serve: pipelined
        steps do, unless this one's row needs it served (its served-adapter check or evaluation)."""
        return self.cfg.pipeline and not self.versions.verify_due(step) and not self._eval_due(step)

    def _eval_due(self, step: int) -> bool:
        return bool(self.cfg.eval_every) and step % self.cfg.eval_every == 0

    async def _evaluation(self, step: int) -> EvalFields | None:
        """The held-out evaluation after this step, when due (RunConfig.eval_every)."""
        if not self._eval_due(step):
            return None
        await self.versions.serve_newest()
        return EvalFields(**history_fields((await self.source.evaluate(n=self.cfg.eval_n)).summary))

    def write_unwritten_row(self) -> None:
        """The row of a completed step whose write failed, written now (before anything else)."""
        if self.unwritten_row is not None:
            row, self.unwritten_row = self.unwritten_row, None
            self.write_row(row)

    def write_row(self, row: dict) -> None:
        """Append the row; if that fails the step stays complete (adapter saved and served) and
        the next step writes this row before anything else, so history never has a gap."""
        try:
            with self.clock.phase("history"):
                self.history.append(row)
        except BaseException:
            self.unwritten_row = row
            log.error("history row of step %d not written; the next step() writes it first", row["step"])
            raise
        if self.cfg.verbose:
            print(self.history.format_row(row), flush=True)
