"""Dashboard: text and HTML rendering, refresh, the background thread's lifecycle and robustness."""

import gc
import logging
import threading
import time
from types import SimpleNamespace

import pytest

from artsg_nb.view import widgets
from artsg_nb.serving.gpus import GpuInfo, GpuPlan
from artsg_nb.view.widgets import Dashboard, sparkline
from waiting import wait_until

GIB = 1024  # MiB


class FakeServer:
    def __init__(self, engine="sglang", url="http://127.0.0.1:30000"):
        self.url, self.config, self.is_alive = url, SimpleNamespace(engine=engine), True

    def alive(self):
        return self.is_alive


class FakeTracker:
    def __init__(self):
        self.rates = [0.5, 0.75, 0.875]
        self.fail = False
        self.reads = 0  # refreshes that read the hit rate

    def cumulative(self):
        self.reads += 1
        if self.fail:
            raise RuntimeError("metrics endpoint unreachable")
        return sum(self.rates) / len(self.rates)

    def last_window(self):
        return self.rates[-1]

    def trend(self, n):
        return self.rates[-n:]


def split_plan():
    return GpuPlan(mode="split", server_gpus=(0,), trainer_gpus=(1,))


def cpu_plan():
    return GpuPlan(mode="cpu")


def gpu(index, used_gib):
    return GpuInfo(index=index, name="NVIDIA H200", uuid=f"GPU-{index}",
                   mem_total_mib=140 * GIB, mem_used_mib=used_gib * GIB)


def two_gpus():
    return [gpu(0, 100), gpu(1, 35)]


@pytest.fixture
def dashboards():
    """Dashboards made in a test, stopped afterwards even if it fails."""
    made = []
    yield lambda *args, **kw: made.append(Dashboard(*args, **kw)) or made[-1]
    for dashboard in made:
        dashboard.stop()


def test_sparkline_fixed_scale_and_gaps():
    assert sparkline([0.0, 0.5, 1.0, None, float("nan"), 2.0]) == "▁▅█  █"


def test_text_on_cpu_plan(dashboards):
    server = FakeServer(engine="cpu", url="http://127.0.0.1:31000")
    text = dashboards(cpu_plan(), server, FakeTracker(), adapter_fn=lambda: "policy-step-3",
                      gpu_reader=lambda: pytest.fail("no GPU reads on CPU")).render_text()
    assert "CPU engine" in text and "GPU 0" not in text
    assert "server  cpu  http://127.0.0.1:31000  running  adapter policy-step-3" in text
    # the trend is scaled to its own range (0.50-0.88), said in numbers beside it
    assert "cumulative 0.71 · last step 0.88 · trend ▁▆█ (0.50–0.88 over 3 steps)" in text


def test_text_on_split_plan_with_fake_memory(dashboards):
    lines = dashboards(split_plan(), FakeServer(), gpu_reader=two_gpus).render_text().splitlines()
    gpu0, gpu1 = lines[1], lines[2]
    assert "GPU 0" in gpu0 and "server " in gpu0 and "100.0 / 140.0 GiB" in gpu0
    assert "GPU 1" in gpu1 and "trainer" in gpu1 and "35.0 / 140.0 GiB" in gpu1
    assert gpu0.count("█") == 14 and gpu1.count("█") == 5  # of 20 cells
    assert "hit rate" not in "\n".join(lines)  # no tracker, no hit-rate line


def test_roles_colocated_idle_and_unreadable():
    plan = SimpleNamespace(mode="colocated", server_gpus=[0], trainer_gpus=[0, 2])
    rows = widgets.gpu_rows(plan, two_gpus())
    assert [(r.index, r.role) for r in rows] == [(0, "server+trainer"), (1, "idle"),
                                                 (2, "trainer")]
    assert widgets._memory_label(rows[2]) == "memory unavailable"


def test_refresh_updates_html_with_stable_classes(dashboards):
    tracker = FakeTracker()
    dashboard = dashboards(split_plan(), FakeServer(), tracker, gpu_reader=two_gpus)
    dashboard.refresh()
    value = dashboard.widget.value
    assert 'class="artsg-dashboard"' in value and value.count('class="artsg-gpu-row"') == 2
    assert 'data-role="server"' in value and 'data-engine="sglang"' in value
    assert 'class="artsg-hit-rate artsg-hit-rate-cumulative" data-value="0.7083"' in value
    tracker.rates.append(1.0)
    dashboard.refresh()
    assert dashboard.widget.value != value and 'data-value="0.7812"' in dashboard.widget.value


def test_show_outside_jupyter_prints_text_once(dashboards, capsys):
    dashboard = dashboards(cpu_plan(), refresh_s=0.01)
    assert dashboard.show() is dashboard
    assert "CPU engine" in capsys.readouterr().out
    assert not dashboard.running  # nothing to refresh outside Jupyter


def test_thread_starts_refreshes_and_stops_within_a_second(dashboards):
    tracker = FakeTracker()
    dashboard = dashboards(split_plan(), FakeServer(), tracker, refresh_s=0.02,
                           gpu_reader=two_gpus)
    dashboard.start()
    assert dashboard.running
    tracker.rates.append(0.0)
    assert wait_until(lambda: 'data-value="0.5312"' in dashboard.widget.value)
    started = time.monotonic()
    dashboard.stop()
    dashboard.stop()  # idempotent
    assert time.monotonic() - started < 5.0 and not dashboard.running  # the 0.02 s refresh ends at once, not a timeout
    assert "dashboard stopped" in dashboard.widget.value
    assert not [t for t in threading.enumerate() if t.name == "artsg-dashboard"]


def test_stops_after_a_final_refresh_when_server_dies(dashboards):
    server = FakeServer()
    dashboard = dashboards(split_plan(), server, refresh_s=0.02, gpu_reader=two_gpus)
    dashboard.start()
    assert wait_until(lambda: "running" in dashboard.widget.value)
    server.is_alive = False
    assert wait_until(lambda: not dashboard.running)
    assert dashboard.snapshot.alive is False
    assert "stopped" in dashboard.widget.value and "server stopped" in dashboard.render_text()


def test_tracker_error_is_shown_and_logged_but_thread_survives(dashboards, caplog):
    tracker = FakeTracker()
    tracker.fail = True
    dashboard = dashboards(split_plan(), FakeServer(), tracker, refresh_s=0.02,
                           gpu_reader=two_gpus)
    with caplog.at_level(logging.WARNING, logger="artsg_nb.view.widgets"):
        dashboard.start()
        assert wait_until(lambda: "metrics endpoint unreachable" in dashboard.widget.value)
        failing = tracker.reads
        wait_until(lambda: tracker.reads >= failing + 3)  # several more failing refreshes
    assert dashboard.running
    assert 'class="artsg-gpu-row"' in dashboard.widget.value  # the rest still renders
    assert len([r for r in caplog.records if "hit rate" in r.getMessage()]) == 1  # logged once
    tracker.fail = False
    assert wait_until(lambda: "metrics endpoint unreachable" not in dashboard.widget.value)


def test_gpu_reader_error_does_not_break_refresh(dashboards):
    def broken():
        raise OSError("NVML driver gone")

    text = dashboards(split_plan(), FakeServer(), gpu_reader=broken).render_text()
    assert "! GPU memory: OSError: NVML driver gone" in text
    assert "GPU 0" not in text and "server  sglang" in text


def test_thread_ends_when_dashboard_is_dropped():
    dashboard = Dashboard(cpu_plan(), refresh_s=0.02)
    dashboard.start()
    thread = dashboard._thread
    del dashboard
    gc.collect()
    thread.join(1.0)
    assert not thread.is_alive()


def test_server_health_error_shows_unknown_and_keeps_refreshing(dashboards):
    server, asked = FakeServer(), []
    server.alive = lambda: asked.append(1) or (_ for _ in ()).throw(ConnectionError("refused"))
    dashboard = dashboards(cpu_plan(), server, refresh_s=0.02)
    dashboard.start()
    assert wait_until(lambda: "unknown" in dashboard.widget.value)
    assert "! server: ConnectionError: refused" in dashboard.render_text()
    before = len(asked)
    wait_until(lambda: len(asked) >= before + 2)  # refreshed again, twice
    assert dashboard.running  # an unreadable server is not a dead one


def test_with_the_real_hit_rate_tracker(dashboards):
    from artsg_nb.serving.metrics import CacheCounters, HitRateTracker

    tracker = HitRateTracker(engine="sglang")
    text = dashboards(cpu_plan(), tracker=tracker).render_text()
    assert "cumulative — · last step — · trend " in text  # before any scrape
    for prompt, cached in ((0, 0), (100, 50), (200, 140), (400, 320)):
        tracker.add_counters(CacheCounters(prompt_tokens=prompt, cached_tokens=cached))
    text = dashboards(cpu_plan(), tracker=tracker).render_text()
    assert "cumulative 0.80 · last step 0.90 · trend ▁██ (0.50–0.90 over 3 steps)" in text


def eight_h200_readings(tick):
    """An 8 x H200 split as NVML would report it at refresh `tick`: the server GPU busy in bursts,
    the trainers busy between them, each with its power draw."""
    readings = []
    for i in range(8):
        busy = (tick % 3 == 0) == (i == 0)
        readings.append(GpuInfo(index=i, name="NVIDIA H200", uuid=f"GPU-{i}", mem_total_mib=140 * GIB,
                                mem_used_mib=(120 if i == 0 else 60 + 5 * i) * GIB, util_pct=95.0 if busy else 7.0,
                                power_w=650.0 if busy else 120.0, power_limit_w=700.0))
    return readings


def eight_h200_dashboard(dashboards, ticks=6):
    plan = GpuPlan(mode="split", server_gpus=(0,), trainer_gpus=tuple(range(1, 8)))
    tick = iter(range(ticks))
    dashboard = dashboards(plan, FakeServer(), FakeTracker(), refresh_s=None,
                           gpu_reader=lambda: eight_h200_readings(next(tick)))
    for _ in range(ticks):
        dashboard.refresh()
    return dashboard


def test_gpu_view_samples_utilisation_memory_and_power_over_time(dashboards):
    dashboard = eight_h200_dashboard(dashboards)
    rows = dashboard.snapshot.gpus
    assert [r.role for r in rows] == ["server"] + ["trainer"] * 7
    assert [len(r.series) for r in rows] == [6] * 8  # one sample per refresh
    assert [u for _, u, _, _ in rows[0].series] == [95.0, 7.0, 7.0, 95.0, 7.0, 7.0]
    html = widgets.render_html(dashboard.snapshot)
    assert html.count('<tr class="artsg-gpu-row"') == 8  # one table: the columns line up
    assert html.count("<polyline") >= 8 * 3  # utilisation, memory and power over time per GPU
    assert "650 / 700 W" in html or "120 / 700 W" in html
    text = widgets.snapshot_text(dashboard.snapshot)
    lines = [line for line in text.splitlines() if line.startswith("GPU ")]
    assert len(lines) == 8 and len({line.index("mem ") for line in lines}) == 1  # aligned
    assert "util   7%" in lines[0] and "W" in lines[0]


def test_gpu_view_without_utilisation_or_power_says_so(dashboards):
    text = dashboards(split_plan(), gpu_reader=two_gpus, refresh_s=None).render_text()
    assert "util    —" in text and "power —" in text


def test_hit_rate_trend_is_scaled_to_its_own_range():
    """0.86-0.88 on a 0-1 scale was one solid block; on its own range it has a shape."""
    low, high = widgets.trend_range([0.86, 0.88, 0.87])
    assert (low, high) == pytest.approx((0.86, 0.88))
    assert sparkline([0.86, 0.88, 0.87], low, high) == "▁█▅"
    assert widgets.trend_range([0.5, 0.5]) == pytest.approx((0.49, 0.51))  # flat: a minimum span


def test_the_step_line_and_the_dashboard_say_the_reachable_rate_in_the_same_words(dashboards):
    """One wording (metrics.reachable_text) beside the hit rate in the step line, the text view and
    the HTML; before, the dashboard left out the share across groups the step line gives."""
    import html

    from artsg_nb.run.history import History
    from artsg_nb.serving.metrics import reachable_text

    row = {"step": 3, "hit_rate": 0.3, "hit_rate_reachable": 0.0, "hit_rate_shared": 0.28,
           "hit_rate_path": "prefilled together"}
    words = reachable_text(0.0, "prefilled together", 0.28)
    assert words == " of 0.00 reachable + 0.28 shared (prefilled together)"
    assert f"hit 0.30{words}" in History.format_row(row)
    dashboard = dashboards(cpu_plan(), FakeServer(), FakeTracker(), refresh_s=None, rows_fn=lambda: [row])
    assert f"last step 0.30{words}" in dashboard.render_text()
    dashboard.refresh()
    assert words in html.unescape(dashboard.widget.value)
    assert reachable_text(None, "warm-up first", 0.5) == "" and reachable_text(float("nan"), None) == ""
