"""The live dashboard (ipywidgets) and its rendering: render.py turns one refresh (a Snapshot)
into HTML or text; dashboard.py holds the widget and its refresh thread. The names below are
the package's public ones (`from artsg_nb.view.widgets import Dashboard`)."""

from .dashboard import STOP_JOIN_TIMEOUT_S, Dashboard
from .render import (SERIES_POINTS, SPARK_BLOCKS, TREND_POINTS, GpuRow, Snapshot, _memory_label, gpu_role,
                     gpu_rows, in_jupyter, render_html, snapshot_text, sparkline, svg_sparkline, trend_range)

__all__ = ["Dashboard", "GpuRow", "SERIES_POINTS", "SPARK_BLOCKS", "STOP_JOIN_TIMEOUT_S", "Snapshot",
           "TREND_POINTS", "gpu_role", "gpu_rows", "in_jupyter", "render_html", "snapshot_text", "sparkline",
           "svg_sparkline", "trend_range"]
