"""A live dashboard for a run: GPU roles and memory, server status, prefix-cache hit rate.

`Dashboard(plan, server, tracker).show()` displays one ipywidgets HTML widget in Jupyter and
refreshes it from a background daemon thread; outside Jupyter `show()` prints a text rendering
once. The thread only assigns `HTML.value` (a trait set, safe from any thread); it never writes
through an Output widget's context manager, which would send output to whatever cell is running.

It stops on `.stop()`, when the server it watches is no longer alive (after a final refresh),
when the Dashboard is garbage-collected, and at interpreter exit. An error while refreshing is
logged and shown as a status line; the thread keeps going.

It only reads: GPU memory (gpus.list_gpus, nvidia-ml-py), `server.alive()`, the tracker's hit
rates. It does not plan GPUs, sample /metrics or control the server.
"""

from __future__ import annotations

import html
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import ipywidgets
from IPython import get_ipython
from IPython.display import display

from artsg_nb.gpus import list_gpus

logger = logging.getLogger(__name__)

SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
TREND_POINTS = 12
TEXT_BAR_WIDTH = 20
STOP_JOIN_TIMEOUT_S = 5.0


def in_jupyter() -> bool:
    """Whether this code runs in an IPython kernel (Jupyter, nbclient), not a plain interpreter."""
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def sparkline(values: Sequence[float | None], low: float = 0.0, high: float = 1.0) -> str:
    """Values as unicode blocks ▁..█ on a fixed [low, high] scale; a gap for None/NaN."""
    blocks = []
    for value in values:
        if value is None or value != value:
            blocks.append(" ")
            continue
        fraction = min(max((value - low) / (high - low), 0.0), 1.0)
        blocks.append(SPARK_BLOCKS[round(fraction * (len(SPARK_BLOCKS) - 1))])
    return "".join(blocks)


# ---------------------------------------------------------------- what one refresh collects

@dataclass
class GpuRow:
    index: int
    name: str
    role: str                       # "server" | "trainer" | "server+trainer" | "idle"
    mem_used_mib: float | None      # None when the GPU could not be read
    mem_total_mib: float | None


@dataclass
class Snapshot:
    """Everything one refresh shows; rendered to HTML or text by pure functions below."""
    mode: str
    gpus: list[GpuRow]
    engine: str | None = None
    url: str | None = None
    alive: bool | None = None       # None: unknown (no server, or alive() raised)
    adapter: str | None = None
    hit_cumulative: float | None = None
    hit_last: float | None = None
    hit_trend: list[float] = field(default_factory=list)
    has_server: bool = False
    has_tracker: bool = False
    errors: list[str] = field(default_factory=list)
    note: str = ""
    time_s: float = field(default_factory=time.time)


def gpu_role(index: int, plan: Any) -> str:
    """What the plan assigned this GPU to."""
    server = index in (getattr(plan, "server_gpus", None) or ())
    trainer = index in (getattr(plan, "trainer_gpus", None) or ())
    return {(True, True): "server+trainer", (True, False): "server",
            (False, True): "trainer"}.get((server, trainer), "idle")


def gpu_rows(plan: Any, readings: Sequence[Any]) -> list[GpuRow]:
    """One row per GPU the driver reports, plus any GPU in the plan that it did not."""
    rows = [GpuRow(r.index, r.name, gpu_role(r.index, plan), r.mem_used_mib, r.mem_total_mib)
            for r in readings]
    seen = {r.index for r in rows}
    planned = set(plan.server_gpus or ()) | set(plan.trainer_gpus or ())
    rows += [GpuRow(i, "?", gpu_role(i, plan), None, None) for i in sorted(planned - seen)]
    return sorted(rows, key=lambda row: row.index)


# ---------------------------------------------------------------- rendering

def snapshot_text(snap: Snapshot) -> str:
    """The dashboard as plain text, one line per GPU, then server, hit rate and any errors."""
    lines = [f"artsg dashboard · {snap.mode} · {_clock(snap)}"]
    if snap.mode == "cpu":
        lines.append("CPU engine (no GPU in use)")
    for row in snap.gpus if snap.mode != "cpu" else []:
        lines.append(f"GPU {row.index}  {row.name:<22} {row.role:<15} "
                     f"{_text_bar(row)}  {_memory_label(row)}")
    if snap.has_server:
        adapter = f"  adapter {snap.adapter}" if snap.adapter else ""
        lines.append(f"server  {snap.engine}  {snap.url}  {_status_word(snap)}{adapter}")
    if snap.has_tracker:
        lines.append(f"prefix-cache hit rate  cumulative {_rate(snap.hit_cumulative)}"
                     f" · last step {_rate(snap.hit_last)} · trend {sparkline(snap.hit_trend)}")
    lines += [f"! {error}" for error in snap.errors]
    if snap.note:
        lines.append(snap.note)
    return "\n".join(lines)


def render_html(snap: Snapshot) -> str:
    """The dashboard as HTML with stable class names (artsg-*) for styling and browser tests."""
    parts = [f'<div class="artsg-dashboard" data-mode="{_esc(snap.mode)}" '
             f'style="font-family:monospace;font-size:12px;line-height:1.6">',
             f'<div class="artsg-title"><b>artsg dashboard</b> · {_esc(snap.mode)} · '
             f'{_clock(snap)}</div>']
    if snap.mode == "cpu":
        parts.append('<div class="artsg-cpu-row">CPU engine (no GPU in use)</div>')
    else:
        parts += [_gpu_html(row) for row in snap.gpus]
    if snap.has_server:
        parts.append(_server_html(snap))
    if snap.has_tracker:
        parts.append(_hit_rate_html(snap))
    parts += [f'<div class="artsg-status artsg-error" style="color:#b00">! {_esc(e)}</div>'
              for e in snap.errors]
    if snap.note:
        parts.append(f'<div class="artsg-status">{_esc(snap.note)}</div>')
    parts.append("</div>")
    return "\n".join(parts)


def _gpu_html(row: GpuRow) -> str:
    fraction = _fraction(row)
    color = {"server": "#1f77b4", "trainer": "#ff7f0e", "server+trainer": "#9467bd"}.get(
        row.role, "#999")
    bar = (f'<span class="artsg-mem-bar" style="display:inline-block;width:160px;height:10px;'
           f'background:#eee;vertical-align:middle;border:1px solid #ccc">'
           f'<span style="display:block;height:100%;width:{100 * (fraction or 0):.1f}%;'
           f'background:{color}"></span></span>')
    return (f'<div class="artsg-gpu-row" data-gpu-index="{row.index}" data-role="{row.role}">'
            f'GPU {row.index} <span class="artsg-gpu-name">{_esc(row.name)}</span> · '
            f'<span class="artsg-gpu-role" style="color:{color}"><b>{row.role}</b></span> '
            f'{bar} <span class="artsg-gpu-mem">{_memory_label(row)}</span></div>')


def _server_html(snap: Snapshot) -> str:
    color = {True: "#2a2", False: "#b00"}.get(snap.alive, "#999")
    adapter = (f' · adapter <span class="artsg-adapter">{_esc(snap.adapter)}</span>'
               if snap.adapter else "")
    return (f'<div class="artsg-server-row artsg-engine-row" data-engine="{_esc(snap.engine)}">'
            f'server <b class="artsg-engine">{_esc(snap.engine)}</b> · '
            f'<span class="artsg-url">{_esc(snap.url)}</span> · '
            f'<span class="artsg-server-status" style="color:{color}">{_status_word(snap)}</span>'
            f'{adapter}</div>')


def _hit_rate_html(snap: Snapshot) -> str:
    def value(css: str, rate: float | None) -> str:
        data = "" if rate is None else f' data-value="{rate:.4f}"'
        return f'<span class="{css}"{data}>{_rate(rate)}</span>'

    return (f'<div class="artsg-hit-rate-row">prefix-cache hit rate · cumulative '
            f'{value("artsg-hit-rate artsg-hit-rate-cumulative", snap.hit_cumulative)} · '
            f'last step {value("artsg-hit-rate-last", snap.hit_last)} · trend '
            f'<span class="artsg-sparkline">{_esc(sparkline(snap.hit_trend))}</span></div>')


def _fraction(row: GpuRow) -> float | None:
    if row.mem_used_mib is None or not row.mem_total_mib:
        return None
    return min(max(row.mem_used_mib / row.mem_total_mib, 0.0), 1.0)


def _text_bar(row: GpuRow) -> str:
    fraction = _fraction(row)
    if fraction is None:
        return "?" * TEXT_BAR_WIDTH
    filled = round(fraction * TEXT_BAR_WIDTH)
    return "█" * filled + "░" * (TEXT_BAR_WIDTH - filled)


def _memory_label(row: GpuRow) -> str:
    if row.mem_used_mib is None or row.mem_total_mib is None:
        return "memory unavailable"
    return f"{row.mem_used_mib / 1024:.1f} / {row.mem_total_mib / 1024:.1f} GiB"


def _clock(snap: Snapshot) -> str:
    return time.strftime("%H:%M:%S", time.localtime(snap.time_s))


def _status_word(snap: Snapshot) -> str:
    return {True: "running", False: "stopped"}.get(snap.alive, "unknown")


def _rate(rate: float | None) -> str:
    return "—" if rate is None else f"{rate:.2f}"


def _esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


# ---------------------------------------------------------------- the widget and its thread

class Dashboard:
    """GPU roles and memory, server status and prefix-cache hit rate, refreshed live.

    plan: has `.mode` ("split" | "colocated" | "cpu"), `.server_gpus`, `.trainer_gpus`.
    server: has `.alive()`, `.url`, `.config.engine` (or None).
    tracker: has `.cumulative()`, `.last_window()`, `.trend(n)` hit rates (or None).
    refresh_s: seconds between background refreshes; None refreshes only on `.refresh()`.
    adapter_fn: returns the adapter name the server is serving now (or None).
    gpu_reader: returns objects with `.index .name .mem_used_mib .mem_total_mib`, read live;
        defaults to `gpus.list_gpus` (nvidia-ml-py); tests pass a fake.
    """

    def __init__(self, plan: Any, server: Any = None, tracker: Any = None,
                 refresh_s: float | None = 2.0, adapter_fn: Callable[[], str | None] | None = None,
                 gpu_reader: Callable[[], Sequence[Any]] = list_gpus):
        self.plan, self.server, self.tracker = plan, server, tracker
        self.refresh_s = refresh_s
        self.adapter_fn = adapter_fn
        self.gpu_reader = gpu_reader
        self.widget = ipywidgets.HTML(value="")
        self.widget.add_class("artsg-dashboard-widget")
        self.snapshot: Snapshot | None = None
        self._lock = threading.RLock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen_errors: set[str] = set()
        self._note = ""
        # The thread holds only a weak reference to this object; the finalizer (which must not
        # reference self) stops it when this object is collected or the interpreter exits.
        self._thread_box: list[threading.Thread | None] = [None]
        weakref.finalize(self, _stop_thread, self._stop_event, self._thread_box)

    # -- public -------------------------------------------------------------------------------

    def show(self) -> Dashboard:
        """Display the widget and start refreshing (Jupyter), or print the text once (elsewhere)."""
        if not in_jupyter():
            print(self.render_text())
            return self
        self.refresh()
        display(self.widget)
        self.start()
        return self

    def start(self) -> Dashboard:
        """Start the background refresh thread (no-op if running or refresh_s is None)."""
        with self._lock:
            if self.refresh_s is None or self.running:
                return self
            self._stop_event.clear()
            self._note = ""
            self._thread = threading.Thread(
                target=_refresh_loop, args=(weakref.ref(self), self._stop_event, self.refresh_s),
                name="artsg-dashboard", daemon=True)
            self._thread_box[0] = self._thread
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def refresh(self) -> Snapshot:
        """Read everything now and update the widget; returns what was shown."""
        with self._lock:
            snap = self._collect()
            self.snapshot = snap
            self.widget.value = render_html(snap)
            return snap

    def render_text(self) -> str:
        """The dashboard as text, read now."""
        with self._lock:
            return snapshot_text(self._collect())

    def stop(self, reason: str = "dashboard stopped") -> None:
        """Stop the refresh thread and show a final state with `reason`. Idempotent."""
        self._stop_event.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_JOIN_TIMEOUT_S)
            if thread.is_alive():
                logger.warning("dashboard thread still busy after %.0f s; left as daemon",
                               STOP_JOIN_TIMEOUT_S)
        if not self._note:
            self._note = reason
            self._safe_refresh()

    def __repr__(self) -> str:
        state = "refreshing" if self.running else "not refreshing"
        return f"<Dashboard {getattr(self.plan, 'mode', '?')}, {state}>"

    # -- internals ----------------------------------------------------------------------------

    def _collect(self) -> Snapshot:
        snap = Snapshot(mode=str(getattr(self.plan, "mode", "?")), gpus=[], note=self._note)
        if snap.mode != "cpu":
            self._guard(snap, "GPU memory", lambda: setattr(
                snap, "gpus", gpu_rows(self.plan, self.gpu_reader())))
        if self.server is not None:
            snap.has_server = True
            self._guard(snap, "server", lambda: self._read_server(snap))
        if self.tracker is not None:
            snap.has_tracker = True
            self._guard(snap, "hit rate", lambda: self._read_tracker(snap))
        return snap

    def _read_server(self, snap: Snapshot) -> None:
        snap.engine = getattr(getattr(self.server, "config", None), "engine", None)
        snap.url = getattr(self.server, "url", None)
        snap.alive = bool(self.server.alive())
        if self.adapter_fn is not None:
            snap.adapter = self.adapter_fn()

    def _read_tracker(self, snap: Snapshot) -> None:
        snap.hit_cumulative = self.tracker.cumulative()
        snap.hit_last = self.tracker.last_window()
        snap.hit_trend = list(self.tracker.trend(TREND_POINTS))

    def _guard(self, snap: Snapshot, what: str, read: Callable[[], None]) -> None:
        """Run one read; on error log it (traceback once per distinct message) and note it."""
        try:
            read()
        except Exception as error:  # a dashboard must survive anything its sources raise
            message = f"{what}: {type(error).__name__}: {error}"
            if message not in self._seen_errors:
                self._seen_errors.add(message)
                logger.warning("dashboard refresh failed reading %s", what, exc_info=True)
            else:
                logger.debug("dashboard refresh failed again: %s", message)
            snap.errors.append(message)

    def _safe_refresh(self) -> Snapshot | None:
        try:
            return self.refresh()
        except Exception:  # rendering bugs must not kill the thread either
            logger.exception("dashboard refresh failed")
            return None

    def _server_stopped(self) -> bool:
        snap = self.snapshot
        return snap is not None and snap.alive is False


def _refresh_loop(ref: weakref.ref, stop_event: threading.Event, refresh_s: float) -> None:
    """Refresh every `refresh_s` until stopped, the Dashboard is gone, or its server died."""
    while True:
        dashboard = ref()
        if dashboard is None:
            return
        dashboard._safe_refresh()
        if dashboard._server_stopped():  # that refresh showed it stopped: the final one
            dashboard.stop(reason="server stopped; dashboard refresh ended")
            return
        del dashboard  # no strong reference while waiting
        if stop_event.wait(refresh_s):
            return


def _stop_thread(stop_event: threading.Event, thread_box: list) -> None:
    """Finalizer: signal the refresh thread and wait briefly for it."""
    stop_event.set()
    thread = thread_box[0]
    if thread is not None and thread is not threading.current_thread():
        thread.join(STOP_JOIN_TIMEOUT_S)
