"""The run's adapter versions, from the trainer's weights to the server: one owner.

What it does: `AdapterVersions` saves the trainer's adapter as `policy-step-N` (its checkpoint
written in the background), stages it in the server beside the rollouts ahead, serves it
(supervisor.publish, under `with_restarts`), checks the served adapter against the trainer when
due, keeps a skipped update's checkpoint, and restores the newest one on resume. It holds the
state those share: the starting version (`initial`), whether it is served yet, a version a step of
`run()` saved and left to the next step to serve (`unpublished`), the seconds serving that one took
in this step (counted in its row's reload_s), the step's lock (a stage never interleaves with a
serve) and the restart count at the last check.

A step stopped before its version became the trainer's (a failed save, an error, an interrupt) is
rolled back here, once (`roll_back`, called by run/step.py on its way out), so it can simply be
run again.

What it does not do: train (rl/trainer.py), speak HTTP (rl/lora.AdapterPublisher), restart
servers (supervisor.py), or decide when a step saves or serves (run/step.py, run/pipeline.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from ..rl.lora import (AdapterVersion, MaskedScorer, adapter_name, latest_checkpoint,
                       probe_served_adapter, probe_trajectory, remove_stale_tmp, save_adapter_atomic, seal_version)
from .clock import PhaseClock
from .results import Published, Saved
from .scrape import MetricsScrape
from .supervisor import ServerSupervisor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyPolicy:
    """When and how closely the served adapter is checked (RunConfig's fields of the same names)."""

    verify_adapter: bool = True
    verify_every: int = 10
    temperature: float = 1.0


class AdapterVersions:
    """Save, stage, serve, verify, skip and restore the run's adapter versions (module docstring)."""

    def __init__(self, trainer, run_dir: Path, supervisor: ServerSupervisor, clock: PhaseClock,
                 scrape: MetricsScrape | None, policy: VerifyPolicy):
        self.trainer = trainer
        self.adapters = Path(run_dir) / "adapters"
        self.supervisor = supervisor
        self.clock = clock
        self.scrape = scrape
        self.policy = policy
        self.initial: AdapterVersion | None = None  # policy-step-0, or the version a resumed run starts from
        self.initial_served = False  # the first await (step/run) serves it
        self.unpublished: AdapterVersion | None = None  # saved by a step of run(), served by the next (serve_newest)
        self.verified_on_server: int | None = None  # supervisor.restarts at the last check
        self._publish_s = 0.0  # serve_newest's seconds since the last row: that row's reload_s counts them
        self._lock: asyncio.Lock | None = None  # a step's: its serve_newest and its stage never interleave

    # ---- the run's versions ----------------------------------------------------------------------
    def begin(self, resume_after: int | None) -> AdapterVersion:
        """The starting version: policy-step-0 saved now (the untrained LoRA, B = 0, serves the base
        model's outputs), or with `resume_after` (the history's last step) the newest checkpoint
        up to it, loaded into the trainer."""
        remove_stale_tmp(self.adapters)
        if resume_after is None:
            self.initial = save_adapter_atomic(self._write_with_checkpoint, self.adapters, 0)
        else:
            self.initial = latest_checkpoint(self.adapters, resume_after)
            self.trainer.load_checkpoint(self.initial.path)
        return self.initial

    @property
    def weights_version(self) -> str | None:
        """The version the trainer's weights are: the served one, or one left to the next step."""
        return self.unpublished.name if self.unpublished else self.supervisor.weights_version

    @property
    def weights_step(self) -> int | None:
        """The trainer step whose weights `weights_version` holds (a skipped update's step keeps
        the version before it: same weights). A step is done once this reaches it (run/step.py)."""
        steps = [s for s in (self.unpublished.step if self.unpublished else None, self.supervisor.weights_step)
                 if s is not None]
        return max(steps) if steps else None

    @property
    def newest(self) -> AdapterVersion:
        """The trainer's newest version on disk: left unserved, served, or (before the first step) the initial."""
        return self.unpublished or self.supervisor.publisher.current or self.initial

    def protected(self) -> tuple[int, ...]:
        """Steps retention must keep: the served version and one left to the next step."""
        return (self.supervisor.publisher.current.step, *([self.unpublished.step] if self.unpublished else []))

    # ---- a step's bracket --------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A step's own lock and counters (each step may run in its own event loop: asyncio.run per cell)."""
        self._lock, self._publish_s = asyncio.Lock(), 0.0

    def end_step(self) -> None:
        self._lock = None

    @property
    def in_step(self) -> bool:
        """Whether a step is under way (between begin_step and end_step)."""
        return self._lock is not None

    def take_publish_s(self) -> float:
        """The seconds serve_newest took since the last call (a row's share of reload_s)."""
        seconds, self._publish_s = self._publish_s, 0.0
        return seconds

    # ---- save ------------------------------------------------------------------------------------
    def write(self, step: int) -> AdapterVersion:
        """The trained adapter as version `step`, its checkpoint written in the background: the
        server needs only the adapter, so its checksum and flush to disk (lora.seal_version) and
        the optimizer state (twice its size) go to disk while the step reloads and the next one
        rolls out (rl/checkpoint.CheckpointWriter). Until then the version has no
        trainer_state.json and a resume starts from the one before."""
        version = save_adapter_atomic(self.trainer.save_adapter, self.adapters, step, durable=False)
        self.trainer.save_checkpoint(version.path, wait=False, before=lambda: seal_version(version))
        return version

    def save_new(self) -> Saved:
        """The update's adapter saved as a new version (`write`). A save that fails raises: the step
        stops before its version is the trainer's, so it rolls the update back (`roll_back`) and
        the next step() redoes it. A pipelined step runs this in its update's worker thread
        (`save_ahead`)."""
        with self.clock.phase("save") as lap:
            version = self.write(self.trainer.step)
        return Saved(version, lap.seconds)

    def save_ahead(self) -> Saved | None:
        """`save_new`, run by a pipelined step in its update's worker thread while the next rollouts
        still run; None (the save then comes after them, in `publish`) while the served version's
        checkpoint is only in memory (its write failed for want of disk): a cancelled step rolls
        back to that version, and the next checkpoint would let it go."""
        with self.clock.phase("checkpoint_wait") as lap:
            self.trainer.wait_for_checkpoint()
        if lap.seconds > 0.005:  # the checkpoint writer is behind the steps: its disk, not the save, costs this
            log.info("step %d: waited %.3f s for the previous checkpoint's write before saving", self.trainer.step,
                     lap.seconds)
        if self.trainer.checkpoints.failed is not None:
            return None
        saved = self.save_new()
        log.info("step %d: %s saved in %.3f s, in the update's thread", saved.version.step, saved.version.name,
                 saved.seconds)
        return saved

    def save_skipped(self) -> AdapterVersion:
        """No signal (each group's rewards identical: every advantage 0): no backward or optimizer
        step. The step counts and is checkpointed (resume); the served adapter (same weights) stays."""
        self.trainer.step += 1
        try:
            with self.clock.phase("save"):
                version = save_adapter_atomic(self._write_with_checkpoint, self.adapters, self.trainer.step)
        except BaseException:
            self.trainer.step -= 1
            raise
        self.supervisor.weights_step = self.trainer.step  # the served version holds this step's weights too
        return version

    def roll_back(self, step: int) -> None:
        """The trainer back to its own saved version `step` (weights, optimizer, step, RNG): a step
        stopped before its version was served (or left to the next step) is undone whole, so the
        next step() redoes it. The one rollback of a step, made by the step on its way out
        (run/step.py) whatever stopped it: a failed save, an error, an interrupt, in the update's
        worker thread too (pipeline.py waits for it to end first). No checksum is asked of the
        version (this trainer saved it): its checkpoint may still be written in the background, or
        only in memory after a full disk (load_checkpoint waits for it or restores it from there).
        A version the stopped step saved stays on disk without a row: resume never takes it, the
        redo replaces it. A rollback that fails is logged, not raised (the step's own error is the
        one to report): the next step's check (supervisor.check_served) then refuses to roll out."""
        try:
            self.trainer.load_checkpoint(self.adapters / adapter_name(step))
        except Exception as e:  # noqa: BLE001 — the step's own error goes up
            log.error("could not roll the trainer back to step %d (%s: %s); continue with "
                      "GRPORun(replace(cfg, resume=True)).start()", step, type(e).__name__, e)
            return
        log.warning("step %d stopped before its version was served; trainer rolled back to step %d", step + 1, step)

    def _write_with_checkpoint(self, tmp: Path) -> None:
        """The adapter and its checkpoint, both written before the version is renamed into place."""
        self.trainer.save_adapter(tmp)
        self.trainer.save_checkpoint(tmp)

    # ---- load and serve --------------------------------------------------------------------------
    async def serve_initial(self, check_release_tags: tuple | None = None) -> None:
        """Serve the starting version, once; with `check_release_tags` (the run releases memory)
        a server that cannot release fails here first, before any rollout."""
        if self.initial_served:
            return
        if check_release_tags is not None:
            await self.supervisor.client.check_memory_saver(check_release_tags)
        await self._publish(self.initial)
        self.initial_served = True
        if self.scrape is not None:
            # The dashboard's windows run from one step's reload to the next (the step's rollouts, and
            # the adapter probe or an evaluation beside them); this is the first window's start.
            await self.scrape.now()

    async def stage(self, saved: Saved) -> Saved:
        """`saved` with its version loaded into the server, not served yet: a pipelined step's,
        while the rollouts ahead still run (AdapterPublisher.stage); its seconds then count the
        load too. A load that fails is logged, and `publish` makes it (under `with_restarts`)
        once the rollouts are in."""
        lap = None
        try:
            # after the serve of the version before, if it is still under way (its stage would be dropped)
            async with self._lock or contextlib.nullcontext():
                with self.clock.phase("stage") as lap:
                    await self.supervisor.publisher.stage(saved.version)
        except Exception as e:  # noqa: BLE001 — the reload loads it: its errors are raised there
            log.warning("loading %s beside the rollouts ahead failed (%s: %s); it is loaded after them",
                        saved.version.name, type(e).__name__, e)
        return Saved(saved.version, saved.seconds + (lap.seconds if lap is not None else 0.0))  # reload work too

    async def publish(self, groups, saved: Saved | None = None) -> Published:
        """Save the update's adapter (unless `saved` already), load it into the server (unless
        staged: then only the older version is unloaded), check it when due. reload_s is the
        save's and the load's seconds together, wherever they ran; waited_s the part made here."""
        previous = self.supervisor.publisher.current
        probe = probe_trajectory(groups)
        with self.clock.phase("reload") as waited:
            saved = saved or self.save_new()
            with self.clock.phase("load") as load:
                try:
                    await self._publish(saved.version)
                except BaseException:
                    self.trainer.wait_for_checkpoint()  # the step stops here: its checkpoint on disk first
                    raise
            self.unpublished = None  # a version a failed step left unserved is superseded by this one
        result = await self._verify(saved.version, previous, probe) if self.verify_due(saved.version.step) else {}
        return Published(saved.version, saved.seconds + load.seconds, result, waited.seconds)

    def leave(self, saved: Saved) -> Published:
        """A step of `run()` leaves its version to the next step, which serves it (`serve_newest`)
        beside its own update."""
        self.unpublished = saved.version
        return Published(saved.version, saved.seconds)

    async def serve_newest(self, scrape: bool = False) -> None:
        """Serve the version a step of `run()` left unpublished (`leave`), before any rollout from
        the server: the next step's rollouts ahead call it beside its update. Its seconds count in
        the next row's reload_s; with `scrape` (inside a step) the step's /metrics scrape goes
        beside it."""
        version = self.unpublished
        if version is None:
            return
        with self.clock.phase("serve_newest") as lap:
            async with self._lock or contextlib.nullcontext():
                if self.unpublished is version:  # not served meanwhile (a stage waited for this serve)
                    # a publish interrupted during its unload already serves it (supervisor.publish
                    # goes on); the older version then stays loaded until a restart: a slot, never a request
                    await self._publish(version)
                    self.unpublished = None
        self._publish_s += lap.seconds
        if scrape and self.scrape is not None:
            self.scrape.send()

    async def _publish(self, version: AdapterVersion) -> None:
        with self.clock.phase("publish"):
            try:
                await self.supervisor.with_restarts(self.supervisor.publish, version)
            finally:  # served, even if interrupted while unloading the version before: one left unserved is superseded
                if (self.supervisor.weights_version == version.name and self.unpublished is not None
                        and self.unpublished.step < version.step):
                    self.unpublished = None

    # ---- verify ------------------------------------------------------------------------------------
    def verify_due(self, step: int) -> bool:
        """Whether this reload's served adapter is checked (RunConfig.verify_every): the first
        reload on a server (none checked since it started or restarted), then every verify_every steps."""
        first_on_server = self.verified_on_server != self.supervisor.restarts
        return self.policy.verify_adapter and (first_on_server or step % self.policy.verify_every == 0)

    async def _verify(self, version: AdapterVersion, previous: AdapterVersion | None, probe) -> dict:
        """The served adapter's logprobs on the probe trajectory against the trainer's (and moved
        from the previous version's); {} without a probe (no valid trajectory)."""
        if probe is None:
            return {}
        with self.clock.phase("verify"):
            trainer_lp = self.trainer.score_tokens(probe.token_ids)
            prev_lp = probe.logprobs[1:] if previous else None
            mask = probe.completion_mask[1:]
            sel = lambda xs: [x for x, m in zip(xs, mask) if m]  # noqa: E731
            tol = 0.02 if self.trainer.device.type == "cpu" else 0.25
            # A server lost while scoring is restarted (the republish reloads `version`) and
            # scored again: the step is complete only with its row, so it must not stop here.
            verify = lambda: probe_served_adapter(  # noqa: E731  (the client after a restart)
                MaskedScorer(self.supervisor.client, mask, self.policy.temperature), version, probe.token_ids,
                sel(trainer_lp), sel(prev_lp) if prev_lp else None, tol)
            result = await self.supervisor.with_restarts(verify)
        self.verified_on_server = self.supervisor.restarts
        return result
