"""Calls into a task's own code — `make_env`, `env.reset`, `env.step`, `group_reward`, a dataset
task's reward functions — with a time limit, and errors that say which function failed.

What it does: `call_task_code(fn, *args, what=..., timeout_s=...)` runs `fn`: a coroutine function
is awaited under `asyncio.wait_for`; a plain function runs on a thread of its own (a daemon: one
that never returns is left behind, and never holds up the kernel's exit) while the event loop
waits up to `timeout_s`; what a plain function returns, if awaitable, is awaited in the remaining
time. Calls of plain functions are serialised (one at a time per event loop, as they were when
they ran on the loop itself), so task code needs no locks. Past the limit it raises
TaskCodeTimeout; an exception of the function itself comes back as TaskCodeError (for env methods,
EnvError), both naming `what` ("env.step of task 'addition'"). `timeout_s` 0 or None: called
inline on the event loop, as before there was a limit.

What it does not: stop a hung plain function (Python cannot kill a thread), or decide what a
failure means for the rollout (groups.py records it on the trajectory).
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import time
import weakref
from typing import Any, Callable

DEFAULT_TIMEOUT_S = 120.0
"""RunConfig.reward_timeout_s's default, also collect_groups's."""


class TaskCodeError(RuntimeError):
    """A function of the task (env method, reward function, group_reward) raised or hung."""


class EnvError(TaskCodeError):
    """An env method (`make_env`, `reset`, `step`) raised."""


class TaskCodeTimeout(TaskCodeError, TimeoutError):
    """A function of the task did not return within the run's reward_timeout_s."""


_LOCKS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock]" = weakref.WeakKeyDictionary()


def _serial() -> asyncio.Lock:
    """The lock that keeps this event loop's task-code calls one at a time."""
    loop = asyncio.get_running_loop()
    lock = _LOCKS.get(loop)
    if lock is None:
        lock = _LOCKS[loop] = asyncio.Lock()
    return lock


async def call_task_code(fn: Callable, *args: Any, what: str, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                         error: type[TaskCodeError] = TaskCodeError, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, awaited if awaitable, within `timeout_s` (module docstring). Raises
    TaskCodeTimeout, or `error` wrapping what `fn` raised; both name `what`."""
    try:
        if not timeout_s:
            out = fn(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
            return await _limited(fn(*args, **kwargs), timeout_s, what)
        async with _serial():
            t0 = time.monotonic()
            out = await _limited(_in_thread(fn, args, kwargs), timeout_s, what)
        if inspect.isawaitable(out):
            out = await _limited(out, max(0.0, timeout_s - (time.monotonic() - t0)), what)
        return out
    except TaskCodeError:
        raise
    except Exception as e:
        raise error(f"{what} raised {type(e).__name__}: {e}") from e


async def _limited(awaitable, timeout_s: float, what: str) -> Any:
    """`awaitable`'s result within `timeout_s`. Not asyncio.wait_for: on Python 3.11 it can return
    a result that arrives together with a cancel and drop the cancel, which left a cancelled
    rollout running on (and its group's followers waiting for ever)."""
    inner = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({inner}, timeout=timeout_s)
    except asyncio.CancelledError:
        inner.cancel()
        await asyncio.wait({inner})  # a second cancel of the caller stops this wait
        raise
    if not done:
        inner.cancel()
        raise TaskCodeTimeout(
            f"{what} did not return within {timeout_s:g} s (RunConfig.reward_timeout_s); the episode goes on "
            "without it. Try: find where it waits (a network call without a timeout, a lock, input()), or raise "
            "reward_timeout_s if it is just slow.")
    return inner.result()


def _in_thread(fn: Callable, args: tuple, kwargs: dict) -> asyncio.Future:
    """A future of `fn(*args, **kwargs)` run on a new daemon thread (with this context's variables)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    context = contextvars.copy_context()

    def settle(value, exc) -> None:
        if not future.done():  # a timed-out call's future is already cancelled
            future.set_exception(exc) if exc is not None else future.set_result(value)

    def run() -> None:
        try:
            value, exc = context.run(fn, *args, **kwargs), None
        except BaseException as e:  # noqa: BLE001 — handed to the waiting coroutine
            value, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:
            pass  # the event loop has closed: nobody waits for this call any more

    threading.Thread(target=run, daemon=True, name=f"artsg-task-code-{getattr(fn, '__name__', 'fn')}").start()
    return future
