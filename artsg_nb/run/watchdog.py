"""A per-step deadline on a hung server: SIGKILL a server that stopped answering, or stopped working.

What it does: `HealthWatchdog` runs as a background task while a GRPO step talks to the server.
Every `hang_timeout_s / 6` it asks GET /health (waiting up to `hang_timeout_s / 2` for the answer,
so a busy server's slow /health is not a hang) and reads the process state (a stopped process,
e.g. SIGSTOP, counts as not answering). A server gets its whole process group SIGKILLed when,
either

* it has not answered /health for `hang_timeout_s` (at least two failed polls in a row, so one poll delayed by
  synchronous work that holds the event loop never counts as a hang), or
* it answers /health but makes no progress for `stall_timeout_s` (default 5 x hang_timeout_s, a
  weaker sign, so a longer wait: a first JIT compile or a long prefill round holds the counter
  still): generation requests are in flight and the engine's progress counter (tokens processed,
  counted every scheduler round: `metrics.progress_tokens`) has not moved — a wedged scheduler, or
  requests stuck behind a stuck adapter operation. A server without the counter is judged by
  /health alone.

Every request in flight then fails at once, and the session's restart logic restarts the server
and redoes the step (the per-request timeout alone would wait 600 s). Admin calls that hang
(an unload that never returns) have their own timeout in the client (engines.AdminTimeoutError).
`paused()` stops the polls while the server must not be probed (starting up, GPU memory
released: SGLang's /health generates a token).

What it does not do: restart anything (session.py does), or judge slow requests: a server whose
counters move is working, however long its generations take.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import contextmanager

from ..engines import EngineError
from ..serving.metrics import progress_tokens

log = logging.getLogger(__name__)

MIN_FAILED_POLLS = 2
STALL_FACTOR = 5
"""stall_timeout_s defaults to this many hang_timeout_s (60 s → 300 s)."""


class _Clock:
    """Since when a condition has held, and over how many polls."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.since, self.polls = time.monotonic(), 0

    def tick(self) -> float:
        self.polls += 1
        return time.monotonic() - self.since


class HealthWatchdog:
    """`start()` / `stop()` around a step; `server_fn()` is the server.Server (or fleet.Fleet),
    `client_fn()` its current client."""

    def __init__(self, server_fn, client_fn, hang_timeout_s: float, stall_timeout_s: float | None = None):
        self.server_fn, self.client_fn, self.hang_timeout_s = server_fn, client_fn, hang_timeout_s
        self.stall_timeout_s = STALL_FACTOR * hang_timeout_s if stall_timeout_s is None else stall_timeout_s
        self.interval_s = max(hang_timeout_s / 6, 0.05)
        self.poll_timeout_s = max(hang_timeout_s / 2, 0.1)
        self.fired = 0  # how many servers it killed
        self._task: asyncio.Task | None = None
        self._paused = 0

    def start(self) -> None:
        if self.hang_timeout_s and self.hang_timeout_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    @contextmanager
    def paused(self):
        """No polls (and a fresh count of failures) while the server must not be probed."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    async def _watch(self) -> None:
        silent, idle = _Clock(), _Clock()  # no /health answer; no progress while requests are in flight
        last_progress = None
        while True:
            await asyncio.sleep(self.interval_s)
            server = self.server_fn()
            if self._paused or server is None or not server.alive():
                silent.reset(), idle.reset()  # a dead server is the restart logic's to find
                last_progress = None
                continue
            if not (await self._answers(server) or self._paused):
                if self._expired(silent, server, "has not answered /health", self.hang_timeout_s):
                    silent.reset(), idle.reset()
                continue
            silent.reset()
            progress = await self._progress()
            if progress is None or progress != last_progress or self._paused:
                idle.reset()
                last_progress = progress
            elif self._expired(idle, server, f"answers /health but processed no token while "
                                             f"{self.client_fn().in_flight} requests were in flight",
                               self.stall_timeout_s):
                idle.reset()
                last_progress = None

    def _expired(self, clock: _Clock, server, what: str, limit_s: float) -> bool:
        """One more poll of `what`; past `limit_s` (and two polls), kill the server's process group."""
        held_s = clock.tick()
        if clock.polls < MIN_FAILED_POLLS or held_s < limit_s:
            return False
        log.error("%r %s for %.1f s (limit %g s: RunConfig.hang_timeout_s, x%d without progress); killing its "
                  "process group so that the step is redone on a restarted server", server, what, held_s, limit_s,
                  STALL_FACTOR)
        server.kill()
        self.fired += 1
        return True

    async def _answers(self, server) -> bool:
        """A stopped process (server.Server / fleet.Fleet `stopped()`) never answers."""
        return not server.stopped() and await self.client_fn().health(timeout_s=self.poll_timeout_s)

    async def _progress(self) -> float | None:
        """The engine's progress counter while generation requests are in flight; None when none
        are (nothing to wait for) or the counter cannot be read (only /health is judged then)."""
        client = self.client_fn()
        if not getattr(client, "in_flight", 0):
            return None
        try:
            return progress_tokens(await client.metrics_text(), client.engine)
        except (EngineError, ValueError) as e:
            log.debug("watchdog: no progress counter (%s)", e)
            return None
