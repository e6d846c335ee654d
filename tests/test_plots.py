"""Plots: every panel on real-looking, empty and NaN data; the grid; LivePlot; bench bars."""

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from artsg_nb.view import plots  # noqa: E402
from artsg_nb.run.history import COLUMNS  # noqa: E402

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
    # 8 panels always, no KL (all NaN), the IS ratio because its band reaches 0.9-1.2
    assert isinstance(fig, Figure) and len(fig.axes) == 9
    assert plots.plot_training(pd.DataFrame(), fig=fig) is fig
    assert len(fig.axes) == 8  # cleared, not stacked


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
    assert len(live.fig.axes) == 9


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
    monkeypatch.setattr("artsg_nb.view.widgets.in_jupyter", lambda: True)
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


def test_hit_rate_panel_ticks_each_steps_theoretical_maximum():
    df = history_df(4).assign(theoretical_hit_rate=[0.875, 0.875, np.nan, 0.8])
    ax = plots.plot_hit_rate(df)
    [ticks] = [c for c in ax.collections if c.get_label() == "theoretical"]
    assert [round(seg[0][1], 3) for seg in ticks.get_segments()] == [0.875, 0.875, 0.8]  # none for the NaN step
    assert not [c for c in plots.plot_hit_rate(history_df(4)).collections if c.get_label() == "theoretical"]


def test_hit_rate_panel_draws_a_line_per_worker():
    df = history_df(3)
    df["worker_hit_rates"] = [[0.7, 0.8], [0.75, None], [0.72, 0.81]]  # a step where worker 1 got nothing
    ax = plots.plot_hit_rate(df)
    workers = [line for line in ax.get_lines() if line.get_label().startswith("worker")]
    assert [line.get_label() for line in workers] == ["worker 0", "worker 1"]
    assert np.isnan(workers[1].get_ydata()[1]) and workers[0].get_ydata()[2] == 0.72
    plain = plots.plot_hit_rate(history_df(3)).get_lines()
    assert not [line for line in plain if line.get_label().startswith("worker")]


def titles(fig):
    return [ax.get_title() for ax in fig.axes]


def test_panels_that_say_nothing_leave_the_grid():
    flat = history_df().assign(is_ratio_min=0.999, is_ratio_max=1.001)  # on-policy, beta = 0
    fig = plots.plot_training(flat)
    assert "KL" not in titles(fig) and "IS ratio (trainer / server)" not in titles(fig)
    assert "no KL term" in fig._suptitle.get_text() and "IS ratio within" in fig._suptitle.get_text()
    fig = plots.plot_training(flat.assign(kl=0.01 * np.arange(5)))  # beta > 0: KL has values
    assert "KL" in titles(fig)
    assert "clip fraction" not in titles(plots.plot_training(flat.assign(clip_frac=0.0)))  # never clipped
    assert "nothing clipped" in plots.plot_training(flat.assign(clip_frac=0.0))._suptitle.get_text()
    for wanted in ("completion length", "generation throughput", "step time", "clip fraction",
                   "grad norm", "prefix-cache hit rate per step"):
        assert wanted in titles(fig)


def full_history(steps=4):
    return history_df(steps).assign(completion_tokens=[640.0, 600, 520, 480], samples=64,
                                    rollout_s=[4.0, 4, 3, 3], train_s=2.0, clip_frac=0.1, grad_norm=0.5,
                                    eval_reward=[np.nan, 0.3, np.nan, 0.6])


def test_derived_panels_compute_length_throughput_and_stack_times():
    df = full_history()
    line = plots.plot_completion_length(df).lines[0]
    assert list(line.get_ydata()) == [10.0, 9.375, 8.125, 7.5]  # completion_tokens / samples
    assert list(plots.plot_tokens_per_s(df).lines[0].get_ydata()) == [160.0, 150.0, 520 / 3, 160.0]
    ax = plots.plot_step_times(df)
    tops = sorted({round(p.get_y() + p.get_height(), 6) for p in ax.patches})
    assert tops[-1] == 4.0 + 2.0 + 0.04  # rollout + train + reload stacked
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["rollout", "train", "reload"]


def test_reward_shows_eval_and_per_sample_boxes(tmp_path):
    df = full_history()
    ax = plots.plot_reward(df)
    assert "eval" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert ax.collections  # ± std band without samples
    write_rollouts(tmp_path, steps=(1, 2))
    samples = plots.load_rollouts(tmp_path)
    assert len(samples) == 8 and set(samples["step"]) == {1, 2}
    ax = plots.plot_reward(df, samples=samples)
    assert len(ax.patches) == 2  # one box per step that has samples


def write_rollouts(run_dir, steps=(1,)):
    folder = run_dir / "rollouts"
    folder.mkdir(parents=True, exist_ok=True)
    for step in steps:
        rows = [{"step": step, "seed": 7, "reward": r, "prompt": "What is 2 + 3?",
                 "completion": "5" if r else "The sum is 5." + " long" * 60, "finish_reason": "stop",
                 "prompt_tokens": 12, "completion_tokens": 2 + 10 * (r == 0)} for r in (1.0, 0.0, 1.0, 0.5)]
        (folder / f"step-{step}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{cut off")


def test_sample_table_shows_a_steps_completions(tmp_path):
    write_rollouts(tmp_path, steps=(1, 2))
    styler = plots.sample_table(tmp_path, n=3)
    table = styler.data
    assert list(table.columns) == ["seed", "reward", "finish", "tokens", "prompt", "completion"]
    assert len(table) == 3 and list(table["reward"]) == [1.0, 1.0, 0.5]  # best first, n of them
    html = styler.to_html()
    assert "step 2" in html and "What is 2 + 3?" in html
    assert all(len(c) <= 160 for c in plots.sample_table(tmp_path, step=1).data["completion"])
    with pytest.raises(FileNotFoundError, match="steps recorded"):
        plots.sample_table(tmp_path, step=9)
    with pytest.raises(FileNotFoundError, match="did not record"):
        plots.sample_table(tmp_path / "elsewhere")


def test_compare_runs_draws_each_run_in_each_panel(tmp_path):
    for name, shift in (("a", 0.0), ("b", 0.2)):
        (tmp_path / name).mkdir()
        rows = full_history().assign(reward_mean=lambda d: d["reward_mean"] + shift).to_dict("records")
        (tmp_path / name / "history.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    fig = plots.compare_runs([tmp_path / "a", tmp_path / "b"])
    reward = fig.axes[0]
    assert [line.get_label() for line in reward.lines] == ["a", "b"]
    assert reward.lines[1].get_ydata()[0] - reward.lines[0].get_ydata()[0] == pytest.approx(0.2)
    assert all(len(ax.lines) == 2 for ax in fig.axes)
    import artsg_nb as ag
    assert ag.compare_runs is plots.compare_runs and plt.get_fignums() == []
    with pytest.raises(ValueError, match="labels"):
        plots.compare_runs([tmp_path / "a"], labels=["x", "y"])


def test_live_training_bar_runs_blue_then_green_or_red(monkeypatch):
    shown = []

    class Handle:
        def update(self, obj):
            shown.append(obj)

    def fake_display(obj, display_id=False):
        shown.append(obj)
        return Handle()

    import IPython.display
    monkeypatch.setattr("artsg_nb.view.widgets.in_jupyter", lambda: True)
    monkeypatch.setattr(IPython.display, "display", fake_display)
    live = plots.LiveTraining(2)
    live.step_done(history_df(1))
    bars = [o.data for o in shown if isinstance(o, IPython.display.HTML)]
    assert 'data-state="running"' in bars[-1] and "step 1/2" in bars[-1] and "ETA" in bars[-1]
    live.step_done(history_df(2))
    live.finish(ok=True)
    assert 'data-state="done"' in shown[-1].data and "#2a2" in shown[-1].data  # green
    images = [o for o in shown if isinstance(o, IPython.display.Image)]
    assert len(images) == 3 and images[1].data != images[2].data  # empty grid, step 1, step 2
    failed = plots.LiveTraining(3)
    failed.finish(ok=False)
    assert 'data-state="failed"' in shown[-1].data and "#c22" in shown[-1].data  # red
    stopped = plots.LiveTraining(3)
    stopped.finish(ok=False, state="interrupted")  # the stop button: no error, say so
    assert 'data-state="interrupted"' in shown[-1].data and "interrupted" in shown[-1].data


def test_a_run_without_rollouts_files_falls_back_to_the_history(tmp_path):
    """LivePlot(run_dir=...) of a run that wrote no rollouts/ draws mean ± std, no boxes."""
    empty = plots.load_rollouts(tmp_path)
    assert len(empty) == 0
    df = full_history()
    assert plots.plot_completion_length(df, samples=empty).lines
    live = plots.LivePlot(path=tmp_path / "live.png", run_dir=tmp_path, dpi=30)
    live.update(df)
    assert (tmp_path / "live.png").exists()


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


def test_plot_step_benchmark_names_a_pipelined_row_and_draws_its_measured_step():
    """A pipelined row's phases overlap (rollout 0.5 + train 0.3 + reload 0.2 = 1.0 s of phases in
    a 0.6 s step): its bar is the step time split in proportion, so it never draws a longer step."""
    plt.close("all")
    df = step_df()
    pipe = {**df.iloc[0].to_dict(), "pipeline": True, "step_s_median": 0.6, "rollout_s_median": 0.5,
            "train_s_median": 0.3, "reload_s_median": 0.2}
    df = pd.concat([df.assign(pipeline=False), pd.DataFrame([pipe])], ignore_index=True)
    ax = plots.plot_step_benchmark(df).axes[0]
    assert len(ax.patches) == 3 * 2 * 3  # artsg_nb, artsg_nb pipelined, trl x 2 jobs x 3 phases
    texts = [t.get_text() for t in ax.texts]
    assert "artsg_nb (cpu, pipelined)\n0.60 s" in texts and "artsg_nb (cpu)\n1.00 s" in texts and "trl\n1.10 s" in texts
    dashed = [p for p in ax.patches if p.get_linestyle() not in ("-", "solid")]
    assert len(dashed) == 2 * 3  # the pipelined label's segments, both jobs (256: none measured, zero height)
    heights = sorted(round(p.get_height(), 3) for p in dashed if p.get_height() > 0)
    assert heights == [0.12, 0.18, 0.3]  # 0.6 s split 5 : 3 : 2
    assert round(max(p.get_y() + p.get_height() for p in dashed), 3) == 0.6
    synced = {round(p.get_y() + p.get_height(), 3) for p in ax.patches if p not in dashed}
    assert {0.95, 1.1, 4.66, 17.0} <= synced  # the synchronous rows still stack as measured


def test_plot_step_benchmark_draws_each_job_of_a_file_apart():
    """A file with rows of two job shapes (an older job beside today's) draws a bar group per job,
    named under its tick; before, the second job's rows collided with the first's."""
    plt.close("all")
    old, new = step_df().assign(job="16x8 r16/32 lr0.0002 seed0"), step_df().assign(job="addition_chat 16x8 r16/32")
    new["step_s_median"] = new["step_s_median"] / 2
    ax = plots.plot_step_benchmark(pd.concat([old, new], ignore_index=True)).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "8 new tokens\n16x8 r16/32 lr0.0002 seed0", "8 new tokens\naddition_chat 16x8 r16/32",
        "256 new tokens\n16x8 r16/32 lr0.0002 seed0", "256 new tokens\naddition_chat 16x8 r16/32"]
    assert len(ax.patches) == 2 * 4 * 3
    texts = [t.get_text() for t in ax.texts]
    assert "artsg_nb (cpu)\n0.50 s" in texts and "artsg_nb (cpu)\n1.00 s" in texts


def test_plot_step_benchmark_draws_the_mean_of_a_leg_measured_twice():
    """A file holding two runs of each leg (two calls merged, as bench.step_ratios averages them)
    draws one bar per leg at their mean; before, the repeated rows stopped the chart with
    "cannot reindex on an axis with duplicate labels"."""
    plt.close("all")
    first, second = step_df(), step_df()
    second[["step_s_median", "rollout_s_median"]] = second[["step_s_median", "rollout_s_median"]] * 3
    ax = plots.plot_step_benchmark(pd.concat([first, second], ignore_index=True)).axes[0]
    assert len(ax.patches) == 2 * 2 * 3
    texts = [t.get_text() for t in ax.texts]
    assert "artsg_nb (cpu)\n2.00 s" in texts and "trl\n34.00 s" in texts, texts
    tops = {round(p.get_y() + p.get_height(), 3) for p in ax.patches}
    assert 1.45 in tops  # artsg_nb at 8 tokens: rollout (0.5 + 1.5) / 2 + train 0.3 + reload 0.15


def test_plot_step_benchmark_keeps_the_rows_of_two_machines_apart():
    """Rows of two machines in one frame (two files concatenated) are two bars per framework, the
    hardware in their labels; before, a leg's rows of both were drawn at their mean, a figure no
    machine measured."""
    plt.close("all")
    cpu, gpu = step_df(), step_df().assign(hardware="NVIDIA H100 80GB HBM3 x1")
    gpu[["step_s_median", "rollout_s_median"]] = gpu[["step_s_median", "rollout_s_median"]] / 10
    ax = plots.plot_step_benchmark(pd.concat([cpu, gpu], ignore_index=True)).axes[0]
    assert len(ax.patches) == 4 * 2 * 3  # 2 frameworks x 2 machines, 2 jobs, 3 phases
    texts = [t.get_text() for t in ax.texts]
    assert "artsg_nb (cpu) · cpu x2\n1.00 s" in texts, texts
    assert "artsg_nb (cpu) · NVIDIA H100 80GB HBM3 x1\n0.10 s" in texts, texts
    older = step_df().assign(hardware=None)  # a file from before the hardware column
    texts = [t.get_text() for t in plots.plot_step_benchmark(pd.concat([cpu, older], ignore_index=True)).axes[0].texts]
    assert "artsg_nb (cpu) · hardware not recorded\n1.00 s" in texts, texts
