"""Plots: every panel on real-looking, empty and NaN data; the grid; LivePlot; bench bars."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from artsg_nb import plots  # noqa: E402
from artsg_nb.history import COLUMNS  # noqa: E402

PANELS = [plots.plot_reward, plots.plot_loss, plots.plot_kl, plots.plot_is_ratio,
          plots.plot_hit_rate, plots.plot_reload_time]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def history_df(steps=5):
    step = np.arange(steps)
    return pd.DataFrame({
        "step": step, "adapter": [f"policy-step-{s}" for s in step],
        "reward_mean": 0.1 * step, "reward_std": np.full(steps, 0.05), "loss": 0.01 / (step + 1),
        "kl": np.full(steps, np.nan), "is_ratio_mean": np.ones(steps),
        "is_ratio_min": np.full(steps, 0.9), "is_ratio_max": np.full(steps, 1.2),
        "hit_rate": np.linspace(0.5, 0.9, steps), "reload_s": np.full(steps, 0.04),
    })


def texts(ax):
    return [t.get_text() for t in ax.texts]


@pytest.mark.parametrize("plot", PANELS, ids=lambda f: f.__name__)
def test_panel_draws_data(plot):
    ax = plot(history_df())
    assert isinstance(ax, Axes)
    if plot is plots.plot_kl:  # all-NaN column: the run had no KL term
        assert texts(ax) == ["no KL term (beta = 0)"]
        lo, hi = ax.get_xlim()  # on the steps' axis like the panels beside it, not 0..1
        assert lo <= history_df()["step"].min() and hi >= history_df()["step"].max() > 1
    else:
        assert ax.lines and "no data" not in texts(ax)


@pytest.mark.parametrize("plot", PANELS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("df", [pd.DataFrame(), pd.DataFrame(columns=list(COLUMNS)),
                                history_df().assign(**{c: np.nan for c in COLUMNS[2:]
                                                       if c != "adapter"})],
                         ids=["no columns", "no rows", "all NaN"])
def test_panel_handles_empty_and_nan(plot, df):
    _, ax = plt.subplots()
    assert plot(df, ax=ax) is ax
    kl_off = plot is plots.plot_kl and len(df) > 0
    assert texts(ax) == ["no KL term (beta = 0)" if kl_off else "no data"]


def test_bands_and_theoretical_line():
    df = history_df()
    assert plots.plot_reward(df).collections  # ± std band
    assert plots.plot_is_ratio(df).collections  # min–max band
    ax = plots.plot_hit_rate(df, theoretical=0.875)
    assert any(line.get_linestyle() == "--" and line.get_ydata()[0] == 0.875 for line in ax.lines)


def test_plot_training_grid_and_reuse():
    fig = plots.plot_training(history_df(), theoretical_hit_rate=0.9)
    assert isinstance(fig, Figure) and len(fig.axes) == 6
    assert plots.plot_training(pd.DataFrame(), fig=fig) is fig
    assert len(fig.axes) == 6  # cleared, not stacked


def test_save_training_plot(tmp_path):
    path = plots.save_training_plot(history_df(), tmp_path / "sub" / "curves.png", dpi=30)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_liveplot_outside_ipython_writes_png(tmp_path):
    live = plots.LivePlot(path=tmp_path / "live.png", dpi=30)
    assert not live.notebook
    live.update(history_df(2))
    first = (tmp_path / "live.png").stat().st_mtime_ns
    live.update(history_df(4))
    assert (tmp_path / "live.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "live.png").stat().st_mtime_ns >= first
    assert len(live.fig.axes) == 6


def test_liveplot_in_notebook_uses_one_display_handle(monkeypatch):
    shown = []

    class Handle:
        def update(self, obj):
            shown.append(("update", obj))

    def fake_display(obj, display_id=False):
        assert display_id is True
        shown.append(("display", obj))
        return Handle()

    import IPython.display
    monkeypatch.setattr("artsg_nb.widgets.in_jupyter", lambda: True)
    monkeypatch.setattr(IPython.display, "display", fake_display)
    live = plots.LivePlot(dpi=30)  # shows the empty grid at once
    live.update(history_df(2))
    assert [kind for kind, _ in shown] == ["display", "update"]
    assert all(obj.data[:4] == b"\x89PNG" for _, obj in shown)
    assert live.path is None and plt.get_fignums() == []  # closed: nothing for pyplot to flush


def bench_df():
    rows = []
    for engine, tok_s in (("sglang", 900.0), ("vllm", 700.0)):
        for schedule in ("prefix", "random"):
            rows.append(dict(engine=engine, schedule=schedule, radix=True, out_tok_s=tok_s,
                             total_tok_s=2 * tok_s, ttft_p50_s=0.05, ttft_p95_s=0.1,
                             e2e_p50_s=1.0, hit_rate_server=0.8 if schedule == "prefix" else 0.3,
                             hit_rate_requests=np.nan, hit_rate_theoretical=0.875,
                             reload_s=0.04))
    rows.append(dict(rows[0], radix=False, hit_rate_server=0.0, reload_s=np.nan))
    return pd.DataFrame(rows)


def test_plot_engine_comparison():
    fig = plots.plot_engine_comparison(bench_df())
    assert isinstance(fig, Figure) and len(fig.axes) == 4
    throughput, _, hit, reload_ax = fig.axes
    assert len(throughput.patches) == 5  # 3 groups × sglang + 2 groups × vllm
    assert [t.get_text() for t in throughput.get_xticklabels()] == [
        "prefix", "random", "prefix, no radix"]
    assert len(hit.collections) >= 5  # a dashed theoretical tick per bar
    assert len(reload_ax.patches) == 4  # the NaN reload is not drawn as a zero bar


def test_plot_engine_comparison_on_given_axes_and_empty():
    fig, axes = plt.subplots(2, 2)
    assert plots.plot_engine_comparison(pd.DataFrame(), axes=axes.ravel()) is fig
    assert all(texts(ax) == ["no data"] for ax in axes.ravel())
    with pytest.raises(ValueError, match="4 panels"):
        plots.plot_engine_comparison(bench_df(), axes=axes.ravel()[:2])


def test_returned_figures_are_closed_for_pyplot():
    plt.close("all")
    plots.plot_training(history_df())
    plots.plot_engine_comparison(bench_df())
    assert plt.get_fignums() == []  # so the inline backend does not show them a second time


def test_plot_turn_hit_rates_groups_bars_by_schedule():
    table = pd.DataFrame({"turn": [1, 2], "episodes": [2, 2], "prompt_tokens": [8, 14], "cached_tokens": [3, 11],
                          "computed_tokens": [5, 3], "hit_rate": [3 / 8, 11 / 14], "theoretical": [0.5, 11 / 14]})
    both = pd.concat([table.assign(schedule="naive"), table.assign(schedule="prefix")])
    fig = plots.plot_turn_hit_rates(both)
    assert len(fig.axes[0].patches) == 4    # 2 turns x 2 schedules
    assert len(plots.plot_turn_hit_rates(table).axes[0].patches) == 2


def step_df():
    row = dict(model="tiny", steps=4, tokens_per_step=300.0, reward_first=0.4, reward_last=0.5, hardware="cpu x2",
               date="2026-12-03")
    return pd.DataFrame([
        {**row, "framework": "artsg_nb", "engine": "cpu", "max_new_tokens": 8, "step_s_median": 1.0,
         "rollout_s_median": 0.5, "train_s_median": 0.3, "reload_s_median": 0.15},
        {**row, "framework": "trl", "engine": "transformers", "max_new_tokens": 8, "step_s_median": 1.1,
         "rollout_s_median": 0.6, "train_s_median": 0.5, "reload_s_median": 0.0},
        {**row, "framework": "artsg_nb", "engine": "cpu", "max_new_tokens": 256, "step_s_median": 5.0,
         "rollout_s_median": 3.0, "train_s_median": 1.4, "reload_s_median": 0.26},
        {**row, "framework": "trl", "engine": "transformers", "max_new_tokens": 256, "step_s_median": 17.0,
         "rollout_s_median": 15.0, "train_s_median": 2.0, "reload_s_median": float("nan")}])


def test_plot_step_benchmark_stacks_phases_per_framework_and_job():
    plt.close("all")
    fig = plots.plot_step_benchmark(step_df())
    assert plt.get_fignums() == []
    ax = fig.axes[0]
    assert len(ax.patches) == 2 * 2 * 3  # 2 frameworks x 2 jobs x (rollout, train, reload)
    heights = sorted(round(p.get_height(), 3) for p in ax.patches)
    assert 15.0 in heights and 0.15 in heights  # the NaN reload is a zero-height segment, not an error
    tops = {round(p.get_y() + p.get_height(), 3) for p in ax.patches}
    assert {0.95, 1.1, 4.66, 17.0} <= tops  # segments stack: rollout + train + reload
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8 new tokens", "256 new tokens"]
    assert any("trl\n17.00 s" == t.get_text() for t in ax.texts)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["rollout", "train", "reload"]


def test_plot_step_benchmark_empty():
    fig = plots.plot_step_benchmark(pd.DataFrame())
    assert [t.get_text() for t in fig.axes[0].texts] == ["no data"]
