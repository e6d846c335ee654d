"""Where one update's seconds went, so a slow one says why.

What it does: `UpdateTimer` times `Trainer.train_step` from the outside of its work: the wall
clock, the GPU's own time for the update's kernels (CUDA events on the trainer's stream), the CPU
time of the thread that ran it, the garbage collector's pauses meanwhile, the Triton kernels
compiled meanwhile (new entries in Triton's cache folder), the wait for the checkpoint writer's
copy, and the CPU time every other thread of the process used meanwhile. `UpdateTiming.why()`
turns that into one sentence; `SlowUpdates` keeps the run's update times and says when one is
well above their median (the trainer logs it).

How to read it: wall ≈ GPU: the GPU was the limit (kernels, or another process's kernels on the
same card). Wall ≫ GPU and ≈ this thread's CPU: Python work (or a kernel compile). Wall ≫ both:
the thread waited — for the GIL held by another thread (listed), for the driver, or for the disk.

What it does not do: change the update, or measure anything without being asked (the trainer
makes one timer per update; each costs well under a millisecond).
"""
from __future__ import annotations

import gc
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

SLOW_FACTOR = 3.0
"""An update slower than this many times the run's median update is reported."""
SLOW_MIN_S = 0.5
"""...and only when it took at least this long: a 0.01 s update at 4x its median says nothing."""
MEDIAN_OF = 3
"""Updates seen before one can be called slow (the first, which pays one-off costs, included)."""
SAMPLE_AFTER_S = 0.3
"""An update still running after this long has its threads' Python frames sampled (`_StackSampler`)."""
SAMPLE_EVERY_S = 0.05


@dataclass
class UpdateTiming:
    """One update's seconds, split by who spent them (module docstring)."""

    wall_s: float
    thread_cpu_s: float
    gpu_s: float | None = None  # the stream's span over the update (busy or waiting for launches); None: on a CPU
    gc_s: float = 0.0
    gc_collections: int = 0
    gc_oldest: int | None = None
    compiled_kernels: int | None = None  # None: Triton's cache folder not found
    checkpoint_wait_s: float = 0.0
    other_threads_cpu_s: dict[str, float] = field(default_factory=dict)  # the busiest, by name
    stacks: dict[str, int] = field(default_factory=dict)  # a long update's sampled frames: "file:function" -> samples

    def why(self) -> str:
        """One sentence: the parts of the wall time that stand out."""
        parts = [f"GPU {self.gpu_s:.3f} s" if self.gpu_s is not None else "no GPU",
                 f"this thread's CPU {self.thread_cpu_s:.3f} s"]
        if self.gc_collections:
            parts.append(f"garbage collector {self.gc_s:.3f} s ({self.gc_collections}x, oldest generation "
                         f"{self.gc_oldest})")
        if self.compiled_kernels:
            parts.append(f"{self.compiled_kernels} Triton kernel(s) compiled")
        if self.checkpoint_wait_s >= 0.01:
            parts.append(f"waited {self.checkpoint_wait_s:.3f} s for the checkpoint writer's copy")
        busy = {name: s for name, s in self.other_threads_cpu_s.items() if s >= 0.01}
        if busy:
            parts.append("other threads' CPU " + ", ".join(f"{name} {s:.3f} s" for name, s in busy.items()))
        if self.stacks:
            parts.append("most sampled: " + ", ".join(f"{where} ({n})" for where, n in list(self.stacks.items())[:3]))
        return f"{self.wall_s:.3f} s: " + "; ".join(parts) + f" ({self._verdict()})"

    def _verdict(self) -> str:
        accounted = max(self.gpu_s or 0.0, self.thread_cpu_s)
        if self.compiled_kernels:
            return "compiling kernels"
        if self.gc_s > 0.5 * self.wall_s:
            return "the garbage collector"
        if self.thread_cpu_s + sum(self.other_threads_cpu_s.values()) > 0.7 * self.wall_s > self.thread_cpu_s:
            # the GPU events span the whole update either way: CPU busy on the forward's and the
            # autograd engine's threads in turn is CPU work (e.g. cuDNN building attention plans)
            return "CPU work on the update's threads (its own and the backward's)"
        if self.gpu_s is not None and self.gpu_s > 0.7 * self.wall_s:
            return "the GPU was the limit"
        if self.thread_cpu_s > 0.7 * self.wall_s:
            return "Python work on this thread"
        if accounted < 0.5 * self.wall_s:
            return "waiting: for the GIL, the CUDA driver or the disk"
        return "mixed"


class UpdateTimer:
    """`with UpdateTimer(device) as timer: ...` then `timer.timing`; `timer.checkpoint_wait()` is a
    context for the part spent waiting on the checkpoint writer."""

    def __init__(self, device: torch.device):
        self.device = device
        self.timing: UpdateTiming | None = None
        self._checkpoint_wait = 0.0

    def __enter__(self) -> "UpdateTimer":
        self._gc = _GcWatch()
        self._kernels = _triton_kernel_count()
        self._threads = _thread_cpu()
        self._events = None
        if self.device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._sampler = _StackSampler()
        self._cpu0, self._t0 = time.thread_time(), time.perf_counter()
        return self

    def checkpoint_wait(self):
        return _Lap(self)

    def __exit__(self, *exc) -> None:
        gpu_s = None
        if self._events is not None:
            self._events[1].record()
            self._events[1].synchronize()  # the optimizer's kernels: part of the update
            gpu_s = self._events[0].elapsed_time(self._events[1]) / 1000
        wall, cpu = time.perf_counter() - self._t0, time.thread_time() - self._cpu0
        stacks = self._sampler.stop()
        self._gc.stop()
        kernels = _triton_kernel_count()
        self.timing = UpdateTiming(
            wall_s=wall, thread_cpu_s=cpu, gpu_s=gpu_s, gc_s=self._gc.seconds, gc_collections=self._gc.count,
            gc_oldest=self._gc.oldest,
            compiled_kernels=None if kernels is None or self._kernels is None else kernels - self._kernels,
            checkpoint_wait_s=self._checkpoint_wait, other_threads_cpu_s=_busiest(self._threads, _thread_cpu()),
            stacks=stacks)


class _Lap:
    def __init__(self, timer: UpdateTimer):
        self.timer = timer

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.timer._checkpoint_wait += time.perf_counter() - self.t0


class SlowUpdates:
    """The run's update wall times; `slow(timing)` says whether this one stands out."""

    def __init__(self) -> None:
        self.walls: list[float] = []

    def slow(self, timing: UpdateTiming) -> float | None:
        """Its median's multiple when `timing` is slow (module constants), else None; records it."""
        earlier, self.walls = self.walls, [*self.walls, timing.wall_s]
        if len(earlier) < MEDIAN_OF:
            return None
        median = statistics.median(earlier)
        if timing.wall_s >= SLOW_MIN_S and timing.wall_s > SLOW_FACTOR * median:
            return timing.wall_s / median
        return None


class _GcWatch:
    """The collections made (on any thread: a collection holds the GIL) until `stop()`."""

    def __init__(self) -> None:
        self.seconds, self.count, self.oldest = 0.0, 0, None
        self._start = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.count += 1
            self.oldest = max(self.oldest or 0, int(info.get("generation", 0)))
            self._start = None

    def stop(self) -> None:
        try:
            gc.callbacks.remove(self._callback)
        except ValueError:
            pass


class _StackSampler:
    """Once an update has run SAMPLE_AFTER_S, the Python frames of every other thread of the process
    (the update's own and the autograd engine's, which runs Python backward functions) every
    SAMPLE_EVERY_S, counted by the innermost frame outside torch's own modules and the
    standard library, so a long update names the code it was in (a kernel compile, a wait)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="artsg-update-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._stop.wait(SAMPLE_AFTER_S):
            return
        me = threading.get_ident()
        while not self._stop.is_set():
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    where = _where(frame)
                    if where is not None:
                        self.counts[where] = self.counts.get(where, 0) + 1
            self._stop.wait(SAMPLE_EVERY_S)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return dict(sorted(self.counts.items(), key=lambda kv: -kv[1])[:8])


_IDLE = ("threading.py", "selectors.py", "queue.py", "concurrent/futures/thread.py", "asyncio/")


def _where(frame) -> str | None:
    """'file:function' of the innermost frame that says something: None for a thread that idles."""
    innermost = f"{_short(frame.f_code.co_filename)}:{frame.f_code.co_name}"
    if any(part in frame.f_code.co_filename for part in _IDLE):
        return None
    while frame is not None:  # the innermost frame outside torch/_tensor-like plumbing
        name = frame.f_code.co_filename
        if "/torch/" not in name or "/_inductor/" in name or "/_dynamo/" in name:
            return f"{_short(name)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return innermost


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    if "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1:]
    return "/".join(parts[-3:])


def _triton_cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def _triton_kernel_count() -> int | None:
    """Entries in Triton's cache folder (one per compiled kernel variant), or None without one."""
    try:
        with os.scandir(_triton_cache_dir()) as entries:
            return sum(1 for _ in entries)
    except OSError:
        return None


def _thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each OS thread of this process."""
    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
    except (psutil.Error, OSError):
        return {}


def _busiest(before: dict[int, float], after: dict[int, float], top: int = 3) -> dict[str, float]:
    """The `top` other threads by CPU used between the two readings, by Python name (or OS id)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    me = threading.get_native_id()
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after if tid != me}
    busiest = sorted(used.items(), key=lambda kv: -kv[1])[:top]
    return {names.get(tid, f"thread {tid}"): round(s, 4) for tid, s in busiest}
