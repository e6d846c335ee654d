"""The sweep's one server, shared by its experiments, restarted when it is lost.

What it does: `SharedServer` holds the server, its client and every experiment's adapter publisher.
An experiment runs each of its server phases (rollouts, reload, the served-adapter check) through
`with_restarts(fn)`: a server that exited or stopped answering is restarted once for everyone
(bounded by `max_restarts`, the single run's rule), each experiment's newest served version is
loaded again (rl.lora.AdapterPublisher.republish), and the phase is redone — rollouts with the
same seeds, a reload by loading the new version again. Experiments that lose the server at the same
moment share one restart: one that finds a newer server than the one it failed on just redoes its
phase. Restarts spent: ServerLostError with the cause and the log tail, which stops every
experiment (their completed steps stay in their run dirs).

What it does not do: start the server (runtime.py), watch for hangs (a hung server is seen when a
request times out), or roll an update back (a phase after the update only serves it).
"""
from __future__ import annotations

import asyncio
import logging

from ..engines import ServerUnavailableError
from ..serving.server import ServerStartError, exit_status

log = logging.getLogger(__name__)


class ServerLostError(RuntimeError):
    """The sweep's server was lost and max_restarts are spent (message: the cause, the log tail)."""


class SharedServer:
    """The sweep's server, its client and its experiments' publishers (module docstring)."""

    def __init__(self, server, max_restarts: int):
        self.server = server
        self.client = server.client()
        self.max_restarts = max_restarts
        self.restarts = 0
        self.generation = 0
        """Restarts completed: a phase that fails on the server of an older generation just redoes."""
        self.publishers: list = []
        """Every experiment's rl.lora.AdapterPublisher: given the new client and republished at a restart."""
        self._lock: asyncio.Lock | None = None
        self._lock_loop = None

    async def with_restarts(self, fn, *args):
        """`await fn(*args)`, redone after a restart each time the server is lost meanwhile."""
        while True:
            lock = self._restart_lock()
            if lock.locked():  # a restart under way: try on the server it brings
                async with lock:
                    pass
            generation = self.generation
            try:
                if not self.server.alive():
                    raise ServerUnavailableError(f"{self.server.config.engine} server is not running")
                return await fn(*args)
            except ServerUnavailableError as e:
                await self._restart_once(generation, e)

    async def _restart_once(self, generation: int, err: Exception) -> None:
        """Restart unless another experiment already did since `generation` (its failed try's)."""
        async with self._restart_lock():
            if self.generation != generation and self.server.alive():
                return
            while True:
                if self.restarts >= self.max_restarts:
                    raise ServerLostError(
                        f"the sweep's {self.server.config.engine} server {exit_status(self.server)} ({err}) and all "
                        f"{self.max_restarts} restarts allowed by max_restarts are used; every experiment's completed "
                        f"steps stay in its run dir. Last 20 lines of {self.server.log_path}:\n"
                        f"{self.server.log_tail(20)}") from err
                try:
                    await self._restart(err)
                    return
                except (ServerUnavailableError, ServerStartError) as e:
                    err = e

    async def _restart(self, err: Exception) -> None:
        self.restarts += 1
        log.warning("sweep: server lost (%s); restart %d/%d. Last 10 lines of %s:\n%s", err, self.restarts,
                    self.max_restarts, self.server.log_path, self.server.log_tail(10))
        await self.client.aclose()
        await asyncio.to_thread(self.server.restart)
        self.client = self.server.client()
        for publisher in self.publishers:
            publisher.client = self.client
        for publisher in list(self.publishers):  # an experiment removed meanwhile must not skip the next one
            await publisher.republish()
        self.generation += 1

    def _restart_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock
