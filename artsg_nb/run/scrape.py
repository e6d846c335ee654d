"""The step's one /metrics scrape, sent beside its reload and awaited before its row.

What it does: `MetricsScrape` feeds the run's HitRateTracker (the dashboard's hit-rate windows and
a fleet's per-worker figures, `worker_stats`) one scrape a step. `send()` starts it once (a second
call in the same step does nothing), `wait()` awaits it, `drop()` cancels one a failed step left
behind; `now()` scrapes at once (the first window's start). A failed scrape is logged and leaves
that window out: neither the step nor its row depends on it.

What it does not do: compute hit rates (serving/metrics.py) or choose when a step scrapes
(run/step.py and run/versions.py do: beside a reload or a serve, never on the rollouts' path).
"""
from __future__ import annotations

import asyncio
import logging

from .supervisor import ServerSupervisor

log = logging.getLogger(__name__)


class MetricsScrape:
    """One /metrics scrape a step into `tracker`, through the supervisor's client of the moment."""

    def __init__(self, tracker, supervisor: ServerSupervisor):
        self.tracker = tracker
        self.supervisor = supervisor
        self._sent: asyncio.Future | None = None

    async def now(self) -> None:
        """Scrape now (the client after a restart); a failure only costs the dashboard's window."""
        try:
            self.tracker.add_sample(await self.supervisor.client.metrics_text())
        except Exception as e:  # noqa: BLE001 — a server error, or text the parser refuses (ValueError)
            log.warning("/metrics scrape failed (%s: %s); the dashboard's hit-rate window skips it",
                        type(e).__name__, e)

    def send(self) -> None:
        """The step's scrape, started now unless started already."""
        if self._sent is None:
            self._sent = asyncio.ensure_future(self.now())

    async def wait(self) -> None:
        """The step's scrape done (none sent: nothing to wait for)."""
        if self._sent is not None:
            await self._sent
            self._sent = None

    def drop(self) -> None:
        """A step ended (maybe failed) before awaiting its scrape: cancel it (each step may run in
        its own event loop)."""
        sent, self._sent = self._sent, None
        if sent is not None and not sent.done():
            sent.cancel()
