"""What a run does when its server is lost, hangs or serves the wrong adapter.

What it does: `ServerSupervisor` holds the run's inference side (the server or fleet, its client,
the adapter publisher) and runs the server's part of a step through `with_restarts`: a server that
exited, stopped answering (the health watchdog kills a hung one) or lost every rollout is
restarted, bounded by `max_restarts` (with several servers, a dead worker is dropped once they are
spent), the newest adapter is republished, and the work is redone; a server that dies again during
the restart takes the next restart. Before rollouts, `check_served` makes sure the server holds the
version the trainer's weights are (`weights_version`, set by `publish`, also when a publish is
interrupted after its load), never the base model in its place, and that this version holds the
trainer's step (`weights_step`). Restarts exhausted: `ServerLostError` with the cause, what to do and the log tail;
completed steps stay in run_dir.

What it does not do: decide what a step is (step.py), start processes (serving/), or keep
adapter versions (rl/lora.py). It is handed the watchdog, the restart bound and run_dir, and is
given the server and publisher once they are started; it knows nothing of the run above it.
"""
from __future__ import annotations

import logging
from pathlib import Path

from ..engines import ServerUnavailableError
from ..rl.lora import AdapterMismatchError
from ..serving.inference import InferenceServer
from ..serving.server import ServerStartError, exit_status
from .watchdog import HealthWatchdog

log = logging.getLogger(__name__)


class ServerLostError(RuntimeError):
    """The server died and the restart policy is off or exhausted (message: the cause, what to
    do, the log tail). Completed steps stay in run_dir; continue with `resume=True`."""


class ServerSupervisor:
    """The run's server, client and publisher, kept serving the trainer's adapter (module docstring)."""

    def __init__(self, watchdog: HealthWatchdog, max_restarts: int, run_dir: Path):
        self.watchdog = watchdog
        self.max_restarts = max_restarts
        self.run_dir = run_dir
        self.server: InferenceServer | None = None
        self.client = None
        self.publisher = None  # rl.lora.AdapterPublisher, on self.client
        self.restarts = 0
        self.weights_version: str | None = None  # the adapter version holding the trainer's weights
        self.weights_step: int | None = None
        """The trainer step whose weights the served version holds: its own step, or a later one
        whose update was skipped (no signal: same weights; AdapterVersions.save_skipped)."""
        self.update_from: int | None = None
        """While a pipelined update runs beside the rollouts ahead (pipeline.SampleAhead.train): the
        trainer step it started from, the weights those rollouts sample from (the trainer's own
        step moves when the update ends, in its worker thread)."""

    @property
    def adapter(self) -> str | None:
        """The adapter version served now (None before the first publish)."""
        cur = self.publisher.current if self.publisher else None
        return cur.name if cur else None

    async def check_served(self, trainer_step: int) -> None:
        """Roll out only under the adapter the trainer's weights are: the version this run published
        last (a step without signal keeps it), held by the server (never the base model instead),
        and holding the weights of `trainer_step` (the trainer's step, or the one an update in
        flight started from), never those of a step before it."""
        expected = self.weights_version
        trainer_step = self.update_from if self.update_from is not None else trainer_step
        held = await self.client.list_adapters()
        if self.adapter != expected or expected not in held:
            raise AdapterMismatchError(
                f"the trainer is at step {trainer_step} and expects rollouts from {expected}, but the "
                f"server holds {sorted(held)}; no rollout was run. "
                f"Continue with GRPORun(replace(cfg, resume=True)).start() (run_dir {self.run_dir}).")
        if self.weights_step is not None and trainer_step != self.weights_step:
            raise AdapterMismatchError(
                f"the trainer is at step {trainer_step} but the served {expected} holds the weights of step "
                f"{self.weights_step}; no rollout was run. Continue with "
                f"GRPORun(replace(cfg, resume=True)).start() (run_dir {self.run_dir}).")

    async def raise_if_server_lost(self, groups) -> None:
        """Failed rollouts and a server that exited (or no longer answers /health) are a server
        loss: the step is redone after a restart, never trained on the rollouts that survived."""
        errors = [t.error for g in groups for t in g.trajectories if t.error]
        if errors and not (self.server.alive() and await self.client.health()):
            raise ServerUnavailableError(f"{len(errors)} rollouts failed and the server is gone: {errors[0]}")

    async def with_restarts(self, fn, *args):
        """`await fn(*args)`, redone after a restart each time the server is lost meanwhile."""
        while True:
            try:
                if not self.server.alive():
                    raise ServerUnavailableError(f"{self.server.config.engine} server is not running")
                return await fn(*args)
            except ServerUnavailableError as e:
                await self._restart_or_raise(e)

    async def _restart_or_raise(self, err: Exception) -> None:
        """Restart and republish; a server that dies again meanwhile takes the next restart."""
        while True:
            self._raise_if_exhausted(err)
            try:
                with self.watchdog.paused():
                    await self._restart(err)
                return
            except (ServerUnavailableError, ServerStartError) as e:
                err = e

    def _raise_if_exhausted(self, err: Exception) -> None:
        # Restarts exhausted with several servers: go on without the dead ones while any remain.
        if self.restarts >= self.max_restarts and not self.server.drop_dead():
            policy = ("automatic restarts are off (max_restarts=0)" if self.max_restarts == 0 else
                      f"all {self.max_restarts} restarts allowed by max_restarts are used")
            raise ServerLostError(
                f"the {self.server.config.engine} server {exit_status(self.server)} ({err}) and {policy}. "
                f"Completed steps (adapters, optimizer state, history) are saved in {self.run_dir}. Try: find "
                "the cause in the log below, then continue with GRPORun(replace(cfg, resume=True)).start(), "
                f"or allow more restarts with max_restarts. Last 20 lines of {self.server.log_path}:\n"
                f"{self.server.log_tail(20)}") from err

    async def _restart(self, err: Exception) -> None:
        self.restarts += 1
        log.warning("server lost (%s); restart %d/%d. Last 10 lines of %s:\n%s", err, self.restarts,
                    self.max_restarts, self.server.log_path, self.server.log_tail(10))
        await self.client.aclose()
        self.server.restart()
        self.client = self.server.client()
        self.publisher.client = self.client
        await self.publisher.republish()

    async def publish(self, version) -> None:
        """Load `version`, unless the republish after a restart already did (the server died
        while unloading the version before it): adapter names cannot be loaded twice."""
        if self.publisher.current is None:  # a run's first: an adopted server holds a dead kernel's adapters
            await self.publisher.clear()
        try:
            if self.publisher.current is None or self.publisher.current.name != version.name:
                await self.publisher.publish(version)
        finally:  # also when interrupted while unloading the version before: `version` is served then
            if self.publisher.current is not None and self.publisher.current.name == version.name:
                self.weights_version = version.name  # what the trainer's weights are, served
                # a step skipped since (same weights) keeps its later step (a version left to serve)
                self.weights_step = max(version.step, self.weights_step if self.weights_step is not None else -1)
