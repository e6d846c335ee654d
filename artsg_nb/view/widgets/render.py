"""What the dashboard shows, as data and as HTML or text: pure functions, no thread, no I/O.

A `Snapshot` is one refresh: GPU rows (role, utilisation, memory, power, and each GPU's recent
samples as a small time series), the server's status, the adapter in service and the
prefix-cache hit rate with its per-step trend. `render_html` lays the GPUs out as a table
(aligned columns, an SVG sparkline per series); `snapshot_text` is the plain-text fallback.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from IPython import get_ipython

from ...serving.metrics import reachable_text

SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
TREND_POINTS = 12
TREND_MIN_SPAN = 0.02
"""The hit-rate trend is scaled to its own range, at least this wide: 0.86-0.88 is a shape, not a block."""
TEXT_BAR_WIDTH = 20
SERIES_POINTS = 60
ROLE_COLORS = {"server": "#1f77b4", "trainer": "#ff7f0e", "server+trainer": "#9467bd"}


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
    util_pct: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    series: list[tuple[float, float | None, float | None, float | None]] = field(default_factory=list)
    """Recent samples, oldest first: (time_s, util_pct, memory fraction, power_w)."""


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
    hit_reachable: float | None = None  # what the last step's submission path can reach
    hit_path: str | None = None         # that path ("warm-up first", "prefilled together", ...)
    hit_shared: float | None = None     # what the cache could serve on top of it, across groups
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
    rows = [GpuRow(r.index, r.name, gpu_role(r.index, plan), r.mem_used_mib, r.mem_total_mib,
                   getattr(r, "util_pct", None), getattr(r, "power_w", None), getattr(r, "power_limit_w", None))
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
        util = [u for _, u, _, _ in row.series]
        lines.append(f"GPU {row.index}  {row.name:<22} {row.role:<15} util {_pct(row.util_pct):>4} "
                     f"{sparkline(util[-TREND_POINTS:], 0, 100):<{TREND_POINTS}}  mem {_text_bar(row)} "
                     f"{_memory_label(row):<18} {_power_label(row)}")
    if snap.has_server:
        adapter = f"  adapter {snap.adapter}" if snap.adapter else ""
        lines.append(f"server  {snap.engine}  {snap.url}  {_status_word(snap)}{adapter}")
    if snap.has_tracker:
        low, high = trend_range(snap.hit_trend)
        lines.append(f"prefix-cache hit rate  cumulative {_rate(snap.hit_cumulative)}"
                     f" · last step {_rate(snap.hit_last)}{_reachable(snap)}"
                     f" · trend {sparkline(snap.hit_trend, low, high)} {_trend_label(snap.hit_trend)}")
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
        parts.append(_gpu_table(snap.gpus))
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


def _gpu_table(rows: Sequence[GpuRow]) -> str:
    """One table row per GPU: index, name, role, then utilisation, memory and power, each with
    its value now and a sparkline of the recent samples (columns line up whatever the names)."""
    head = "".join(f'<th style="text-align:left;padding:0 8px 0 0;font-weight:normal;color:#666">{h}</th>'
                   for h in ("GPU", "name", "role", "utilisation", "memory", "power"))
    return (f'<table class="artsg-gpu-table" style="border-collapse:collapse;font-family:monospace;'
            f'font-size:12px"><tr>{head}</tr>' + "".join(_gpu_html(row) for row in rows) + "</table>")


def _gpu_html(row: GpuRow) -> str:
    color = ROLE_COLORS.get(row.role, "#999")
    util = [u for _, u, _, _ in row.series]
    memory = [m for _, _, m, _ in row.series]
    power = [p for _, _, _, p in row.series]
    cell = '<td style="padding:0 10px 0 0;white-space:nowrap">'
    return (f'<tr class="artsg-gpu-row" data-gpu-index="{row.index}" data-role="{row.role}">'
            f'{cell}{row.index}</td>{cell}<span class="artsg-gpu-name">{_esc(row.name)}</span></td>'
            f'{cell}<span class="artsg-gpu-role" style="color:{color}"><b>{row.role}</b></span></td>'
            f'{cell}<span class="artsg-gpu-util">{_pct(row.util_pct):>4}</span> '
            f'{svg_sparkline(util, 0, 100, color)}</td>'
            f'{cell}{_bar(_fraction(row), color)} <span class="artsg-gpu-mem">{_memory_label(row)}</span> '
            f'{svg_sparkline(memory, 0, 1, color)}</td>'
            f'{cell}<span class="artsg-gpu-power">{_power_label(row)}</span> '
            f'{svg_sparkline(power, 0, row.power_limit_w or max([p for p in power if p] or [1]), color)}</td></tr>')


def _bar(fraction: float | None, color: str, width_px: int = 110) -> str:
    return (f'<span class="artsg-mem-bar" style="display:inline-block;width:{width_px}px;height:10px;'
            f'background:#eee;vertical-align:middle;border:1px solid #ccc">'
            f'<span style="display:block;height:100%;width:{100 * (fraction or 0):.1f}%;'
            f'background:{color}"></span></span>')


def svg_sparkline(values: Sequence[float | None], low: float, high: float, color: str = "#1f77b4",
                  width_px: int = 90, height_px: int = 16) -> str:
    """A small inline SVG line of `values` on [low, high] (gaps for None); empty under 2 points."""
    points = [(i, v) for i, v in enumerate(values) if v is not None and v == v]
    if len(points) < 2 or high <= low:
        return f'<svg class="artsg-spark" width="{width_px}" height="{height_px}"></svg>'
    step = width_px / max(len(values) - 1, 1)
    coords = " ".join(f"{i * step:.1f},{height_px - 1 - (min(max((v - low) / (high - low), 0), 1)) * (height_px - 2):.1f}"
                      for i, v in points)
    return (f'<svg class="artsg-spark" width="{width_px}" height="{height_px}" style="vertical-align:middle;'
            f'background:#f6f6f6"><polyline fill="none" stroke="{color}" stroke-width="1.3" '
            f'points="{coords}"/></svg>')


def trend_range(values: Sequence[float | None]) -> tuple[float, float]:
    """The scale of the hit-rate trend: its own min–max, widened to TREND_MIN_SPAN, within 0..1."""
    finite = [v for v in values if v is not None and v == v]
    if not finite:
        return 0.0, 1.0
    low, high = min(finite), max(finite)
    pad = max(TREND_MIN_SPAN - (high - low), 0) / 2
    return max(low - pad, 0.0), min(high + pad, 1.0)


def _trend_label(values: Sequence[float | None]) -> str:
    finite = [v for v in values if v is not None and v == v]
    if not finite:
        return ""
    return f"({min(finite):.2f}–{max(finite):.2f} over {len(values)} steps)"


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

    low, high = trend_range(snap.hit_trend)
    reachable = (f' <span class="artsg-hit-rate-reachable" data-value="{snap.hit_reachable:.4f}" '
                 f'style="color:#666">{_esc(_reachable(snap))}</span>') if snap.hit_reachable is not None else ""
    return (f'<div class="artsg-hit-rate-row">prefix-cache hit rate · cumulative '
            f'{value("artsg-hit-rate artsg-hit-rate-cumulative", snap.hit_cumulative)} · '
            f'last step {value("artsg-hit-rate-last", snap.hit_last)}{reachable} · trend '
            f'<span class="artsg-sparkline">{svg_sparkline(snap.hit_trend, low, high, "#17becf")}</span> '
            f'<span style="color:#666">{_esc(_trend_label(snap.hit_trend))}</span></div>')


def _reachable(snap: Snapshot) -> str:
    return reachable_text(snap.hit_reachable, snap.hit_path, snap.hit_shared)


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


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}%"


def _power_label(row: GpuRow) -> str:
    if row.power_w is None:
        return "power —"
    limit = f" / {row.power_limit_w:.0f}" if row.power_limit_w else ""
    return f"{row.power_w:.0f}{limit} W"


def _rate(rate: float | None) -> str:
    return "—" if rate is None else f"{rate:.2f}"


def _esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


