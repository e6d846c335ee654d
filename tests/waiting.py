"""Waiting on a condition in tests, instead of sleeping a guessed time to force an order.

`wait_until(condition)` (a thread: a fake trainer's update, a test body) and
`await wait_until_async(condition)` (a coroutine: a fake rollout, a step's interrupt) return as
soon as `condition()` is true and fail (AssertionError, naming `what`) after `timeout_s`;
`poll_until` is the same without the failure (False after timeout_s: the caller decides).
`forever()` waits until it is cancelled (a rollout "still running" when a step is interrupted);
`LIVES_UNTIL_KILLED` is the body of a child process that does the same (`python -c`).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.005
LIVES_UNTIL_KILLED = "import signal; signal.pause()"


def poll_until(condition: Callable[[], object], timeout_s: float, poll_s: float = POLL_S) -> bool:
    """Whether condition() turned true within timeout_s (checked every poll_s)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return bool(condition())
        time.sleep(poll_s)
    return True


def wait_until(condition: Callable[[], object], timeout_s: float = 60.0, what: str | Callable[[], str] = "",
               poll_s: float = POLL_S) -> bool:
    """Block until condition() is true (then True); AssertionError after timeout_s."""
    if not poll_until(condition, timeout_s, poll_s):
        raise AssertionError(f"not true after {timeout_s} s: {(what() if callable(what) else what) or condition}")
    return True


async def wait_until_async(condition: Callable[[], object], timeout_s: float = 60.0, what: str = "") -> bool:
    """Yield to the event loop until condition() is true (then True); AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not true after {timeout_s} s: {what or condition}"
        await asyncio.sleep(POLL_S)
    return True


async def forever() -> None:
    """Wait until cancelled."""
    await asyncio.Event().wait()
