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
  row       the history row (history.StepRow) written, logged to trackers, old versions pruned

`train_on(groups, release)` is the same step on groups rolled out elsewhere (ART). Each phase is
a point where the step can stop: an error or a cancellation in rollouts or rewards leaves nothing
changed; in the update the trainer is rolled back (pipeline.py, versions.save_new); in version a
version saved but not served stays on disk without a row (resume never takes it); a row that
cannot be written is kept and written first by the next step, so history has no gap.

What it does not do: start or stop anything (session.py), restart servers (supervisor.py), the
loss (rl/grpo.py). It is handed the run's parts; it knows nothing of the run above it.
"""
from __future__ import annotations

import contextlib
import logging

from ..rollout.evaluate import history_fields
from ..rollout.samples import constant_groups, samples_block, write_rollouts
from ..rollout.trajectory import require_rewards
from .clock import PhaseClock
from .config import RunConfig
from .history import EvalFields, FleetFields, History, MemoryFields, PipelineFields, step_row
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
        async with self._bracket(release):
            step = self.trainer.step + 1
            log.info("step %d: rollouts under %s", step, self.versions.weights_version)  # a stall names its phase
            rollouts = await self.sampler.rollouts(step)
            log.info("step %d: %d groups in %.2f s; update%s", step, len(rollouts.groups), rollouts.rollout_s,
                     " (server memory released around it)" if release else "")
            rewards = self._rewards(rollouts)
            leave = not publish and self._leaves_unpublished(step)
            update = await self._update(rollouts, rewards, release, leave, pipelined=self.cfg.pipeline)
            published = await self._version(rollouts, update, leave)
            return await self._row(rollouts, update, published, self.sampler.fields)

    async def train_on(self, groups, release: bool) -> dict:
        """The step on groups rolled out elsewhere, from the served adapter: update, version, row
        (no rollout_s / hit_rate)."""
        async with self._bracket(release):
            await self.versions.serve_newest()
            rollouts = Rollouts(self.trainer.step + 1, groups, None, None)
            rewards = self._rewards(rollouts)
            update = await self._update(rollouts, rewards, release, leave=False, pipelined=False)
            published = await self._version(rollouts, update, leave=False)
            return await self._row(rollouts, update, published, pipeline=None)

    # ---- the phases -------------------------------------------------------------------------------
    def _rewards(self, rollouts: Rollouts) -> Rewards:
        with self.clock.phase("rewards"):
            require_rewards(rollouts.groups)
            write_rollouts(self.history.run_dir, rollouts.step, rollouts.groups)
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
            stats = self.supervisor.server.worker_stats()  # a fleet's per-worker figures since the last scrape
            row = step_row(step, self.versions.weights_version, rollouts.groups, update.metrics,
                           hit_rate=rollouts.hit_rate, rollout_s=rollouts.rollout_s, train_s=update.train_s,
                           reload_s=reload_s, probe=published.probe,
                           memory=MemoryFields(update.release_s, update.resume_s), restarts=self.supervisor.restarts,
                           pipeline=pipeline, eval=evaluation,
                           fleet=FleetFields(**stats) if stats else None,
                           kv_tokens=self.scrape.tracker.kv_tokens).as_dict()
            self.write_row(row)
            if self.cfg.verbose and self.cfg.print_samples:  # a short block under the step's line
                print(samples_block(rollouts.groups, self.cfg.print_samples, step), flush=True)
            self.trackers.log(row)
            with self.clock.phase("prune"):
                prune_adapters(self.versions.adapters, self.cfg.keep_adapters, self.cfg.keep_every,
                               protect=(*self.versions.protected(), published.version.step))
        return row

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
