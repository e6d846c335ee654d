"""A per-step deadline on a hung server: poll /health and the process, SIGKILL a server that stopped answering.

What it does: `HealthWatchdog` runs as a background task while a GRPO step talks to the server.
Every `hang_timeout_s / 6` it asks GET /health (waiting up to `hang_timeout_s / 2` for the answer,
so a busy server's slow /health is not a hang) and reads the process state (a stopped process,
e.g. SIGSTOP, counts as not answering). A server that has not answered for `hang_timeout_s` — at
least two failed polls in a row and no answer for that long, so one poll delayed by synchronous
work that holds the event loop never counts as a hang — gets its whole process group SIGKILLed.
Every request in flight then fails at once, and the session's restart logic restarts the server
and redoes the step (the per-request timeout alone would wait 600 s). `paused()` stops
the polls while the server must not be probed (starting up, GPU memory released: SGLang's /health
generates a token).

What it does not do: restart anything (session.py does), or judge slow requests: a server that
answers /health is alive, however long its generations take.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import contextmanager


log = logging.getLogger(__name__)

MIN_FAILED_POLLS = 2


class HealthWatchdog:
    """`start()` / `stop()` around a step; `server` is a server.Server, `client()` its current client."""

    def __init__(self, server_fn, client_fn, hang_timeout_s: float):
        self.server_fn, self.client_fn, self.hang_timeout_s = server_fn, client_fn, hang_timeout_s
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
        answered, failures = time.monotonic(), 0  # the last answer (or the watch's start)
        while True:
            await asyncio.sleep(self.interval_s)
            server = self.server_fn()
            if self._paused or server is None or not server.alive():
                answered, failures = time.monotonic(), 0  # a dead server is the restart logic's to find
                continue
            if await self._answers(server) or self._paused:
                answered, failures = time.monotonic(), 0
                continue
            failures += 1
            silent_s = time.monotonic() - answered
            if failures >= MIN_FAILED_POLLS and silent_s >= self.hang_timeout_s:
                log.error("%r has not answered /health for %.1f s (hang_timeout_s=%g); killing its process "
                          "group so that the step is redone on a restarted server", server, silent_s, self.hang_timeout_s)
                server.kill()
                self.fired += 1
                answered, failures = time.monotonic(), 0

    async def _answers(self, server) -> bool:
        """A stopped process (server.Server / fleet.Fleet `stopped()`) never answers."""
        return not server.stopped() and await self.client_fn().health(timeout_s=self.poll_timeout_s)
