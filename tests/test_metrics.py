"""metrics.py on the /metrics text recorded from SGLang 0.5.14, on synthetic vLLM text, the
windowed hit-rate arithmetic on hand-worked numbers, and a batch's per-turn and theoretical hit
rates on hand-built trajectories."""

from __future__ import annotations

import pytest

from artsg_nb.serving.metrics import (TURN_COLUMNS, CacheCounters, HitRateTracker, MetricsError, cache_counters,
                              cumulative_hit_rate, hit_rate, parse_metrics, theoretical_hit_rate, turn_hit_rates)
from artsg_nb.rollout.trajectory import Trajectory, TrajectoryGroup, rollout_stats
from sglang_fixtures import fixture

# vLLM exposition: counters declared without _total, samples with it; labels model_name, engine.
VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="base"} 600.0
vllm:prefix_cache_queries_total{engine="1",model_name="base"} 400.0
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="base"} 300.0
vllm:prefix_cache_hits_total{engine="1",model_name="base"} 100.0
# HELP vllm:prompt_tokens Number of prefill tokens processed.
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="base"} 610.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="base"} 0.25
"""


def test_sglang_fixture_hit_rate_is_35_of_177():
    counters = cache_counters(fixture("metrics.txt"), "sglang")
    assert counters == CacheCounters(prompt_tokens=177.0, cached_tokens=35.0)
    assert cumulative_hit_rate(counters) == pytest.approx(35 / 177)
    assert cache_counters(fixture("metrics.txt"), "cpu") == counters  # the CPU engine uses SGLang's names


def test_sglang_gauge_is_not_the_cumulative_rate():
    # The recorded gauge reads 0.0 (last prefill batch) while the counters say 35/177.
    assert parse_metrics(fixture("metrics.txt"))["sglang:cache_hit_rate"] == 0.0


def test_parse_metrics_sums_over_labels_and_keeps_total_suffix():
    text = """\
# TYPE sglang:cached_tokens counter
sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="m"} 30.0
sglang:cached_tokens_total{cache_source="host",engine_type="unified",model_name="m"} 12.0
sglang:cached_tokens_total{cache_source="storage",engine_type="unified",model_name="m"} 3.0
sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",model_name="m"} 80.0
sglang:prompt_tokens_total{engine_type="unified",is_streaming="true",model_name="m"} 20.0
"""
    values = parse_metrics(text)
    assert values["sglang:cached_tokens_total"] == 45.0 and values["sglang:prompt_tokens_total"] == 100.0
    assert cache_counters(text, "sglang") == CacheCounters(100.0, 45.0)


def test_parse_metrics_of_named_samples_reads_only_those_with_the_same_values():
    text = fixture("metrics.txt")
    everything = parse_metrics(text)
    names = ["sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:e2e_request_latency_seconds_sum"]
    assert parse_metrics(text, names) == {name: everything[name] for name in names}
    assert parse_metrics(text, ["sglang:no_such_counter_total"]) == {}


def test_the_step_hit_rate_sums_what_the_server_reported_for_every_episode():
    ok = Trajectory(messages=[], token_ids=[1, 2, 3], completion_mask=[0, 0, 1], logprobs=[0.0, 0.0, -1.0],
                    prompt_tokens=30, cached_tokens=20)
    failed = Trajectory(messages=[], token_ids=[1], completion_mask=[0], logprobs=[0.0], prompt_tokens=10, cached_tokens=0,
                        error="x")
    assert rollout_stats([TrajectoryGroup(0, [ok]), TrajectoryGroup(1, [failed])])["hit_rate"] == pytest.approx(20 / 40)
    assert rollout_stats([TrajectoryGroup(0, [])])["hit_rate"] is None


def test_vllm_counters_sum_over_engines():
    counters = cache_counters(VLLM_METRICS, "vllm")
    assert counters == CacheCounters(prompt_tokens=1000.0, cached_tokens=400.0)
    assert cumulative_hit_rate(counters) == pytest.approx(0.4)


def test_vllm_old_gpu_prefix_cache_names():
    text = ('vllm:gpu_prefix_cache_queries_total{model_name="base"} 50.0\n'
            'vllm:gpu_prefix_cache_hits_total{model_name="base"} 20.0\n')
    assert cache_counters(text, "vllm") == CacheCounters(50.0, 20.0)


def test_counters_absent_before_first_request_read_as_zero():
    text = 'sglang:num_running_reqs{model_name="m"} 0.0\n'
    assert cache_counters(text, "sglang") == CacheCounters(0.0, 0.0)
    assert cumulative_hit_rate(CacheCounters(0.0, 0.0)) is None


def test_wrong_engine_text_is_an_error():
    with pytest.raises(MetricsError, match="no vllm:"):
        cache_counters(fixture("metrics.txt"), "vllm")
    with pytest.raises(ValueError, match="unknown engine"):
        cache_counters(fixture("metrics.txt"), "tgi")
    with pytest.raises(MetricsError, match="no sglang:"):  # named only in a comment: not SGLang's text
        cache_counters("# HELP sglang:prompt_tokens_total is SGLang's\n" + VLLM_METRICS, "sglang")


def test_indented_sample_lines_are_read_as_the_parser_reads_them():
    text = "  sglang:prompt_tokens_total 10.0\n  sglang:cached_tokens_total 4.0\n"
    assert cache_counters(text, "sglang") == CacheCounters(10.0, 4.0)


@pytest.mark.parametrize("before, after, expected", [
    (CacheCounters(100, 20), CacheCounters(300, 120), 0.5),    # 100 cached of 200 new prompt tokens
    (CacheCounters(100, 20), CacheCounters(100, 20), None),    # no new prompt tokens
    (CacheCounters(0, 0), CacheCounters(177, 35), 35 / 177),
    (CacheCounters(500, 400), CacheCounters(40, 10), 0.25),   # restart: counters reset, after is the window
])
def test_windowed_hit_rate(before, after, expected):
    assert hit_rate(before, after) == (None if expected is None else pytest.approx(expected))


def test_tracker_windows_trend_and_cumulative():
    tracker = HitRateTracker(engine="sglang", max_samples=4)
    assert tracker.cumulative() is None and tracker.last_window() is None and tracker.trend(5) == []
    assert tracker.add_counters(CacheCounters(100, 0), t=1.0) is None
    assert tracker.add_counters(CacheCounters(200, 50), t=2.0) == pytest.approx(0.5)
    assert tracker.add_counters(CacheCounters(200, 50), t=3.0) is None   # idle window
    assert tracker.add_counters(CacheCounters(400, 200), t=4.0) == pytest.approx(0.75)
    assert tracker.trend() == [pytest.approx(0.5), None, pytest.approx(0.75)]
    assert tracker.trend(2) == [None, pytest.approx(0.75)]
    assert tracker.windows(1) == [(4.0, pytest.approx(0.75))]
    assert tracker.cumulative() == pytest.approx(0.5)
    tracker.add_counters(CacheCounters(500, 300), t=5.0)                  # the oldest scrape drops out
    assert len(tracker.samples) == 4 and tracker.trend() == [None, pytest.approx(0.75), pytest.approx(1.0)]


def test_tracker_reads_metrics_text():
    tracker = HitRateTracker(engine="sglang")
    tracker.add_sample(fixture("metrics.txt"))
    assert tracker.cumulative() == pytest.approx(35 / 177) and tracker.last_window() is None


# ---------------------------------------------------------------------------- a batch's hit rates

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
    table = turn_hit_rates(two_turn_group).set_index("turn")
    assert table.loc[1, ["episodes", "prompt_tokens", "cached_tokens", "computed_tokens"]].tolist() == [2, 8, 3, 5]
    assert table.loc[1, "hit_rate"] == pytest.approx(3 / 8)
    assert table.loc[2, "hit_rate"] == pytest.approx(11 / 14)


def test_theoretical_turn_one_reuses_every_copy_but_the_first_later_turns_their_history(two_turn_group):
    table = turn_hit_rates(two_turn_group).set_index("turn")
    assert table.loc[1, "theoretical"] == pytest.approx(4 / 8)     # b reuses a's opening
    assert table.loc[2, "theoretical"] == pytest.approx((6 + 5) / (8 + 6))


def test_identical_openings_share_across_groups_and_failed_episodes_count_only_as_measured():
    a = traj([("m", [10])], [stats(4, 0)])
    b = traj([("m", [11])], [stats(4, 3)])
    failed = traj([], [stats(4, 3)], error="RolloutError: boom")
    table = turn_hit_rates([TrajectoryGroup(0, [a]), TrajectoryGroup(1, [b, failed])])
    assert table["episodes"].tolist() == [3]
    assert table["hit_rate"].iloc[0] == pytest.approx(6 / 12)
    assert table["theoretical"].iloc[0] == pytest.approx(4 / 8)


def test_no_turns_gives_an_empty_table():
    table = turn_hit_rates([TrajectoryGroup(0, [traj([], [], error="x")])])
    assert table.empty and list(table.columns) == TURN_COLUMNS


def test_theoretical_hit_rate_by_hand():
    def traj(mask):
        return Trajectory(messages=[], token_ids=list(range(len(mask))), completion_mask=mask,
                          logprobs=[0.0] * len(mask))
    # two samples of a 4-token prompt, 2 model tokens, 3 env tokens, 2 model tokens
    mask = [0] * 4 + [1] * 2 + [0] * 3 + [1] * 2
    group = TrajectoryGroup(0, [traj(mask), traj(mask)])
    # prompts: 4 + 9 per sample = 26; reusable: 4 (second sample's turn 1) + 6 + 6 (turn-2 history)
    assert theoretical_hit_rate([group]) == pytest.approx(16 / 26)


def test_overall_theoretical_rate_is_the_token_weighted_mean_of_the_turns(two_turn_group):
    by_turn = theoretical_hit_rate(two_turn_group, by_turn=True)
    assert by_turn == pytest.approx({1: 4 / 8, 2: (6 + 5) / (8 + 6)})
    assert theoretical_hit_rate(two_turn_group) == pytest.approx((4 + 6 + 5) / (8 + 14))


def test_theoretical_hit_rate_without_prompts_is_none():
    failed = traj([], [], error="RolloutError: boom")
    assert theoretical_hit_rate([TrajectoryGroup(0, [failed])]) is None
    assert theoretical_hit_rate([TrajectoryGroup(0, [failed])], by_turn=True) == {}
