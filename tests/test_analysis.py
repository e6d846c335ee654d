"""analysis.py: per-turn hit rates on hand-built trajectories, and the benchmark results reader."""
import math

import pandas as pd
import pytest

from artsg_nb import analysis
from artsg_nb.rollout import Trajectory, TrajectoryGroup

OPENING = [1, 2, 3, 4]


def traj(segments, turn_stats, error=None):
    """A trajectory: the shared 4-token opening, then (kind, ids) segments; "m" = model tokens."""
    ids, mask = list(OPENING), [0] * len(OPENING)
    for kind, seg in segments:
        ids += seg
        mask += [1 if kind == "m" else 0] * len(seg)
    return Trajectory(messages=[], token_ids=ids, completion_mask=mask, logprobs=[0.0] * len(ids),
                      reward=0.0, error=error, turns=len(turn_stats), turn_stats=turn_stats)


def stats(prompt, cached):
    return {"prompt_tokens": prompt, "cached_tokens": cached}


@pytest.fixture
def two_turn_group():
    # a: opening(4) reply(2) env(2) reply(1): turn 2 prompt = 8 tokens, history to end of reply 1 = 6
    a = traj([("m", [10, 11]), ("e", [20, 21]), ("m", [12])], [stats(4, 0), stats(8, 6)])
    # b: opening(4) reply(1) env(1) reply(1): turn 2 prompt = 6 tokens, history = 5
    b = traj([("m", [13]), ("e", [22]), ("m", [14])], [stats(4, 3), stats(6, 5)])
    return [TrajectoryGroup(seed=0, trajectories=[a, b])]


def test_turn_hit_rates_sum_per_turn(two_turn_group):
    table = analysis.turn_hit_rates(two_turn_group).set_index("turn")
    assert table.loc[1, ["episodes", "prompt_tokens", "cached_tokens", "computed_tokens"]].tolist() == [2, 8, 3, 5]
    assert table.loc[1, "hit_rate"] == pytest.approx(3 / 8)
    assert table.loc[2, "hit_rate"] == pytest.approx(11 / 14)


def test_theoretical_turn_one_reuses_every_copy_but_the_first_later_turns_their_history(two_turn_group):
    table = analysis.turn_hit_rates(two_turn_group).set_index("turn")
    assert table.loc[1, "theoretical"] == pytest.approx(4 / 8)     # b reuses a's opening
    assert table.loc[2, "theoretical"] == pytest.approx((6 + 5) / (8 + 6))


def test_identical_openings_share_across_groups_and_failed_episodes_count_only_as_measured():
    a = traj([("m", [10])], [stats(4, 0)])
    b = traj([("m", [11])], [stats(4, 3)])
    failed = traj([], [stats(4, 3)], error="RolloutError: boom")
    table = analysis.turn_hit_rates([TrajectoryGroup(0, [a]), TrajectoryGroup(1, [b, failed])])
    assert table["episodes"].tolist() == [3]
    assert table["hit_rate"].iloc[0] == pytest.approx(6 / 12)
    assert table["theoretical"].iloc[0] == pytest.approx(4 / 8)


def test_no_turns_gives_an_empty_table():
    table = analysis.turn_hit_rates([TrajectoryGroup(0, [traj([], [], error="x")])])
    assert table.empty and list(table.columns) == analysis.TURN_COLUMNS


def test_plot_turn_hit_rates_groups_bars_by_schedule(two_turn_group):
    table = analysis.turn_hit_rates(two_turn_group)
    both = pd.concat([table.assign(schedule="naive"), table.assign(schedule="prefix")])
    fig = analysis.plot_turn_hit_rates(both)
    assert len(fig.axes[0].patches) == 4    # 2 turns x 2 schedules
    assert len(analysis.plot_turn_hit_rates(table).axes[0].patches) == 2


# ---------------------------------------------------------------------------- results reader

def bench_rows(engine="sglang", hardware="NVIDIA H200 x1", date="2026-12-01T10:00:00", **shape):
    base = {"date": date, "hardware": hardware, "engine": engine, "engine_version": "0.5.14",
            "flags": "--engine " + engine, "groups": 8, "group_size": 8, "prompt_tokens": 1500,
            "new_tokens": 128, "turns": 1, "stream_all": True, "radix": "on", **shape}
    return [{**base, "mode": mode, "schedule": schedule, "repeat": repeat, "out_tok_s": out,
             "hit_rate_server": 0.5, "hit_rate_theoretical": 0.875}
            for mode, schedule, repeat, out in [("toolkit", "naive", 0, 100.0), ("toolkit", "naive", 1, 200.0),
                                                ("raw", "naive", 0, 1000.0), ("toolkit", "prefix", 0, 300.0)]]


def write_csv(path, rows):
    pd.DataFrame(rows).to_csv(path, index=False)


def test_load_results_without_files_is_empty_with_the_bench_columns(tmp_path):
    df = analysis.load_results(tmp_path)
    assert df.empty and {"source", "gpu", "workload", "engine", "mode"} <= set(df.columns)
    assert analysis.latest_results(df).empty
    assert analysis.results_table(df).empty


def test_load_results_filters_by_gpu_and_keeps_the_newest_file_per_workload(tmp_path):
    write_csv(tmp_path / "old-sglang.csv", bench_rows(date="2026-11-01T10:00:00"))
    write_csv(tmp_path / "new-sglang.csv", bench_rows(date="2026-12-01T10:00:00"))
    write_csv(tmp_path / "prefill-sglang.csv", bench_rows(date="2026-10-01T10:00:00", prompt_tokens=6000))
    write_csv(tmp_path / "cpu.csv", bench_rows(engine="cpu", hardware="cpu x2"))
    df = analysis.load_results(tmp_path, gpu="h200")
    assert set(df["source"]) == {"old-sglang.csv", "new-sglang.csv", "prefill-sglang.csv"}
    latest = analysis.latest_results(df)
    assert set(latest["source"]) == {"new-sglang.csv", "prefill-sglang.csv"}  # older shape kept: different workload
    assert sorted(latest["workload"].unique()) == ["8x8, 1500-token prompts, 128 new tokens, 1 turn",
                                                   "8x8, 6000-token prompts, 128 new tokens, 1 turn"]


def test_a_gpu_column_and_a_workload_label_are_accepted(tmp_path):
    rows = [{**r, "gpu": r.pop("hardware"), "workload": "A", "stream_all": False} for r in bench_rows()]
    write_csv(tmp_path / "labelled.csv", rows)
    df = analysis.load_results(tmp_path, gpu="H200")
    assert (df["hardware"] == "NVIDIA H200 x1").all()
    assert df["workload"].iloc[0] == "A: 8x8, 1500-token prompts, 128 new tokens, 1 turn, leaders stream"
    assert analysis.results_table(df).index.get_level_values("workload").unique().tolist() == [df["workload"].iloc[0]]
    sources = analysis.result_sources(df)
    assert sources.loc["labelled.csv", ["engines", "engine_version", "rows"]].tolist() == ["sglang", "0.5.14", 4]


def test_results_table_averages_toolkit_repeats(tmp_path):
    table = analysis.results_table(pd.DataFrame(bench_rows()))
    naive = table.xs("naive", level="schedule")
    assert naive["out_tok_s"].iloc[0] == pytest.approx(150.0)  # (100 + 200) / 2; the raw row is left out
    assert naive["hit_rate"].iloc[0] == pytest.approx(0.5)
    assert len(table) == 2 and not math.isnan(table["hit_rate_theoretical"].iloc[0])
