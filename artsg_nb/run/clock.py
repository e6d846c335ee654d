"""The step's one clock: every timing a run records comes from `PhaseClock`.

What it does: `with clock.phase("rollouts") as lap:` times a named phase of a step (`lap.seconds`
once the block has left, also when it raised) and keeps it as a `Span` (name, start, end), so a
profiler reads what the step did from `clock.since(t0)` instead of wrapping the run's methods.
`clock.now()` is the same monotonic time, for the few instants that are not a phase (when the
rollouts ahead ended, when an update returned). A run's start is timed on it too: "server_start"
and "trainer_build", which run side by side. Spans from worker threads are kept too (a
pipelined update saves in one).

What it does not do: decide what a phase is (run/step.py names them: rollouts, rewards, update,
version, row, and the parts inside them), aggregate across steps (the history rows do), or log.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")

KEPT_SPANS = 4096
"""The newest spans kept (a few dozen a step): a profiler reads them after each step."""


@dataclass(frozen=True)
class Span:
    """One timed phase: its name and its start and end on `PhaseClock.now()`'s scale (seconds)."""

    name: str
    t0: float
    t1: float

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


class Lap:
    """The running phase `PhaseClock.phase` yields; `seconds` is set when its block leaves."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.seconds: float | None = None


class PhaseClock:
    """Times named phases and keeps them as spans (module docstring)."""

    def __init__(self, keep: int = KEPT_SPANS):
        self.spans: deque[Span] = deque(maxlen=keep)

    @staticmethod
    def now() -> float:
        """Monotonic seconds (the spans' scale)."""
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Lap]:
        """Time the block as phase `name`: kept as a span, its seconds on the yielded `Lap`."""
        lap = Lap(self.now())
        try:
            yield lap
        finally:
            t1 = self.now()
            lap.seconds = t1 - lap.t0
            self.spans.append(Span(name, lap.t0, t1))

    def call(self, name: str, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` timed as phase `name`: for work handed on as a function (to a thread)."""
        with self.phase(name):
            return fn(*args)

    def since(self, t0: float) -> list[Span]:
        """The spans that started at or after `t0`, in the order they ended."""
        return [s for s in list(self.spans) if s.t0 >= t0]
