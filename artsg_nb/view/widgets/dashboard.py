"""A live dashboard for a run: GPU roles, utilisation, memory and power over time, server status,
prefix-cache hit rate.

`Dashboard(plan, server, tracker).show()` displays one ipywidgets HTML widget in Jupyter and
refreshes it from a background daemon thread; outside Jupyter `show()` prints a text rendering
once. The thread only assigns `HTML.value` (a trait set, safe from any thread); it never writes
through an Output widget's context manager, which would send output to whatever cell is running.
Each refresh samples NVML (gpus.list_gpus) and keeps the last SERIES_POINTS samples per GPU, so
the view shows utilisation, memory and power over time, not just now.

It stops on `.stop()` (GRPORun.stop calls it after stopping the server, so the last refresh
says "stopped"), when the server it watches is no longer alive (after a final refresh), when the
Dashboard is garbage-collected, and at interpreter exit. An error while refreshing is logged and
shown as a status line; the thread keeps going.

It only reads: NVML, `server.alive()`, the tracker's hit rates. It does not plan GPUs, sample
/metrics or control the server.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from typing import Any, Callable, Sequence

import ipywidgets
from IPython.display import display

from artsg_nb.serving.gpus import list_gpus

from .render import SERIES_POINTS, TREND_POINTS, Snapshot, gpu_rows, in_jupyter, render_html, snapshot_text

logger = logging.getLogger(__name__)

STOP_JOIN_TIMEOUT_S = 5.0
SERVER_STOPPED = "server stopped; dashboard refresh ended"
"""The note of a dashboard whose refresh thread saw its server stop (and ended itself)."""


# ---------------------------------------------------------------- the widget and its thread

class Dashboard:
    """GPU roles and memory, server status and prefix-cache hit rate, refreshed live.

    plan: has `.mode` ("split" | "colocated" | "cpu"), `.server_gpus`, `.trainer_gpus`.
    server: has `.alive()`, `.url`, `.config.engine` (or None).
    tracker: has `.cumulative()`, `.last_window()`, `.trend(n)` hit rates (or None).
    refresh_s: seconds between background refreshes; None refreshes only on `.refresh()`.
    adapter_fn: returns the adapter name the server is serving now (or None).
    rows_fn: returns the run's history rows so far (dicts with `hit_rate`, `hit_rate_reachable`,
        `hit_rate_path`, `hit_rate_shared`): "last step" and its trend are then the steps' own hit rates, beside what
        each step's submission path can reach (serving/metrics.py); without it, the tracker's
        windows between scrapes.
    gpu_reader: returns objects with `.index .name .mem_used_mib .mem_total_mib` (and, when
        known, `.util_pct .power_w .power_limit_w`), read live; defaults to `gpus.list_gpus`
        (nvidia-ml-py); tests pass a fake.
    """

    def __init__(self, plan: Any, server: Any = None, tracker: Any = None,
                 refresh_s: float | None = 2.0, adapter_fn: Callable[[], str | None] | None = None,
                 gpu_reader: Callable[[], Sequence[Any]] = list_gpus,
                 rows_fn: Callable[[], Sequence[dict]] | None = None):
        self.plan, self.server, self.tracker = plan, server, tracker
        self.rows_fn = rows_fn
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
        self._series: dict[int, deque] = {}  # GPU index -> recent (time_s, util, mem fraction, power)
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
        if not self._note or (self._note == SERVER_STOPPED and reason != SERVER_STOPPED):
            # the owner's reason ("run stopped") says more than the thread's own, which may have
            # seen the server stop first
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
                snap, "gpus", self._with_series(gpu_rows(self.plan, self.gpu_reader()), snap.time_s)))
        if self.server is not None:
            snap.has_server = True
            self._guard(snap, "server", lambda: self._read_server(snap))
        if self.tracker is not None:
            snap.has_tracker = True
            self._guard(snap, "hit rate", lambda: self._read_tracker(snap))
        return snap

    def _with_series(self, rows: list, time_s: float) -> list:
        """Append this reading to each GPU's series and attach the series to its row."""
        for row in rows:
            series = self._series.setdefault(row.index, deque(maxlen=SERIES_POINTS))
            memory = row.mem_used_mib / row.mem_total_mib if row.mem_used_mib is not None and row.mem_total_mib else None
            series.append((time_s, row.util_pct, memory, row.power_w))
            row.series = list(series)
        return rows

    def _read_server(self, snap: Snapshot) -> None:
        snap.engine = getattr(getattr(self.server, "config", None), "engine", None)
        snap.url = getattr(self.server, "url", None)
        snap.alive = bool(self.server.alive())
        if self.adapter_fn is not None:
            snap.adapter = self.adapter_fn()

    def _read_tracker(self, snap: Snapshot) -> None:
        snap.hit_cumulative = self.tracker.cumulative()
        rows = [r for r in (self.rows_fn() if self.rows_fn is not None else []) if _number(r.get("hit_rate"))]
        if not rows:
            snap.hit_last = self.tracker.last_window()
            snap.hit_trend = list(self.tracker.trend(TREND_POINTS))
            return
        last = rows[-1]
        snap.hit_last, snap.hit_trend = last["hit_rate"], [r["hit_rate"] for r in rows[-TREND_POINTS:]]
        snap.hit_reachable = last.get("hit_rate_reachable") if _number(last.get("hit_rate_reachable")) else None
        snap.hit_path = last.get("hit_rate_path")
        snap.hit_shared = last.get("hit_rate_shared") if _number(last.get("hit_rate_shared")) else None

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
            dashboard.stop(reason=SERVER_STOPPED)
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


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and value == value  # not None, not NaN
