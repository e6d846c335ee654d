"""Calls into a task's own code — `make_env`, `env.reset`, `env.step`, `group_reward`, a dataset
task's reward functions — with a time limit, and errors that say which function failed.

What it does: `call_task_code(fn, *args, what=..., timeout_s=...)` runs `fn`: a coroutine function
is awaited for at most `timeout_s` (then cancelled); a plain function runs on a worker thread (a
daemon: one that never returns is left behind with its thread, which never holds up the kernel's
exit, and later calls get a new worker) while the event loop waits up to `timeout_s`; what a plain
function returns, if awaitable, is awaited in the remaining time. Calls of plain functions are
serialised (one at a time per event loop, as they were when they ran on the loop itself), so task
code needs no locks; but a plain function no longer runs on the event loop's thread, so one that
needs the loop should be `async def`. A hand-off costs ~0.1 ms (measured on a busy 2-core machine),
so rollouts make one per group for make_env and reset together, and one per env.step. Past the limit it raises
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
import queue
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
            t0, call = time.monotonic(), _in_thread(fn, args, kwargs)
            try:
                out = await _limited_call(call, timeout_s, what)
            except TaskCodeTimeout:
                _abandon(call.worker)
                raise
        if inspect.isawaitable(out):
            out = await _limited(out, max(0.0, timeout_s - (time.monotonic() - t0)), what)
        return out
    except TaskCodeError:
        raise
    except Exception as e:
        raise error(f"{what} raised {type(e).__name__}: {e}") from e


async def await_task_code(awaitable, *, what: str, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                          error: type[TaskCodeError] = TaskCodeError) -> Any:
    """An awaitable the task's code returned (an async env.reset's coroutine), awaited within
    `timeout_s`; its failures named like `call_task_code`'s."""
    try:
        return await (_limited(awaitable, timeout_s, what) if timeout_s else awaitable)
    except TaskCodeError:
        raise
    except Exception as e:
        raise error(f"{what} raised {type(e).__name__}: {e}") from e


async def _limited_call(call: asyncio.Future, timeout_s: float, what: str) -> Any:
    """The worker's result within `timeout_s`: a timer cancels the future (the cheap path, a plain
    future and no task; a cancel of the caller is told apart by `cancelling()`)."""
    timer = asyncio.get_running_loop().call_later(timeout_s, call.cancel)
    try:
        return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if timer.when() > asyncio.get_running_loop().time() or (task is not None and task.cancelling()):
            raise
        raise _timeout(what, timeout_s) from None
    finally:
        timer.cancel()


def _timeout(what: str, timeout_s: float) -> "TaskCodeTimeout":
    return TaskCodeTimeout(
        f"{what} did not return within {timeout_s:g} s (RunConfig.reward_timeout_s); the episode goes on "
        "without it. Try: find where it waits (a network call without a timeout, a lock, input()), or raise "
        "reward_timeout_s if it is just slow.")


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
        raise _timeout(what, timeout_s)
    return inner.result()


class _Worker:
    """One daemon thread running the jobs put on its queue, in order; None stops it."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="artsg-task-code").start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()


_worker: _Worker | None = None
_worker_lock = threading.Lock()


def _current_worker() -> _Worker:
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = _Worker()
        return _worker


def _abandon(stuck: _Worker) -> None:
    """Leave a worker stuck in a call that timed out: later calls, and any queued behind it, go
    to a new one; the stuck thread ends when (if ever) its call returns."""
    global _worker
    with _worker_lock:
        if _worker is not stuck:
            return
        _worker = _Worker()
        while True:
            try:
                job = stuck.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                _worker.jobs.put(job)
        stuck.jobs.put(None)


def _in_thread(fn: Callable, args: tuple, kwargs: dict) -> asyncio.Future:
    """A future of `fn(*args, **kwargs)` run on the worker thread (with this context's variables);
    the future knows its worker (`.worker`), to abandon it if the call times out."""
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

    worker = _current_worker()
    future.worker = worker
    worker.jobs.put(run)
    return future
