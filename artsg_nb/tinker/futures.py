"""Tinker's futures: every training and sampling call answers a request id at once, and the
client polls /retrieve_future until its result is there.

What it does: `Futures` runs each submitted coroutine as a task, each under a timeout, and keeps
its outcome — a JSON-able result, protobuf bytes, or an error message — by request id until it
is retrieved (and a while after, for a client that retries the retrieval). `wait` long-polls: it
answers as soon as the outcome is there, or None after `wait_s` (the client then polls again).
A (model, seq_id) pair submitted twice (a client retrying a request whose answer it lost) gets
the first request's id.

What it does not do: order requests (service.py queues each model's) or speak HTTP (server.py).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)

KEEP_S = 600.0
"""How long an outcome is kept after it was first retrieved."""


class RequestFailed(Exception):
    """An operation's error meant for the client as it is (a user error: bad input, unsupported)."""


@dataclass
class Outcome:
    """What a finished request produced: `result` (a dict for JSON, bytes for protobuf) or `error`."""

    result: Any = None
    error: str | None = None
    category: str = "user"
    """"user" (the request was wrong) or "server" (the service failed)."""


class Futures:
    """Request id → the task computing it, then its Outcome."""

    def __init__(self, timeout_s: float = 900.0):
        self.timeout_s = timeout_s
        """Every operation's deadline; one that runs longer fails with an error that says so."""
        self._ids = itertools.count(1)
        self._tasks: dict[str, asyncio.Task] = {}
        self._outcomes: dict[str, Outcome] = {}
        self._retrieved: dict[str, float] = {}
        self._by_seq: dict[tuple[str, int], str] = {}

    def submit(self, make: Callable[[], Awaitable[Any]], what: str, dedupe: tuple[str, int] | None = None) -> str:
        """Start `make()` (its result is the request's); the request id."""
        if dedupe is not None and dedupe in self._by_seq:
            return self._by_seq[dedupe]
        request_id = str(next(self._ids))
        if dedupe is not None:
            self._by_seq[dedupe] = request_id
        self._tasks[request_id] = asyncio.ensure_future(self._run(request_id, make, what))
        return request_id

    def known(self, request_id: str) -> bool:
        return request_id in self._tasks or request_id in self._outcomes

    async def wait(self, request_id: str, wait_s: float) -> Outcome | None:
        """The outcome of `request_id`, waiting up to `wait_s`; None while it runs. KeyError for
        an id never submitted (or forgotten: retrieved more than KEEP_S ago)."""
        self._forget_old()
        task = self._tasks.get(request_id)
        if task is None and request_id not in self._outcomes:
            raise KeyError(request_id)
        if task is not None:
            done, _ = await asyncio.wait({task}, timeout=wait_s)
            if not done:
                return None
        self._retrieved.setdefault(request_id, time.monotonic())
        return self._outcomes[request_id]

    async def close(self) -> None:
        """Cancel what still runs (the server is stopping)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, request_id: str, make: Callable[[], Awaitable[Any]], what: str) -> None:
        try:
            outcome = Outcome(result=await asyncio.wait_for(make(), self.timeout_s))
        except RequestFailed as e:
            outcome = Outcome(error=str(e))
        except asyncio.TimeoutError:
            outcome = Outcome(error=f"{what} did not finish within {self.timeout_s:.0f} s (the service's per-request "
                                    "timeout); a smaller batch, or a longer timeout_s, may help", category="server")
        except Exception as e:  # the service's own failure: reported, the server keeps serving
            log.exception("%s failed", what)
            outcome = Outcome(error=f"{what} failed: {type(e).__name__}: {e}", category="server")
        self._outcomes[request_id] = outcome
        del self._tasks[request_id]

    def _forget_old(self) -> None:
        now = time.monotonic()
        for request_id, at in list(self._retrieved.items()):
            if now - at > KEEP_S:
                self._outcomes.pop(request_id, None)
                del self._retrieved[request_id]
