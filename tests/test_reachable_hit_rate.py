"""The hit rate beside what its submission path can reach (issue 46): metrics.reachable_hit_rate
from the reusable tokens rollouts record, the value checks the GPU smoke applies
(bench.checks), and on the CPU engine that the row, the step line and the panel say the path
the client actually took: the reachable value and the path can never disagree."""
import asyncio
from dataclasses import replace

import pytest

from artsg_nb.bench.checks import check_hit_rates, check_reloads, check_rows
from artsg_nb.rollout.trajectory import Trajectory, TrajectoryGroup
from artsg_nb.run.history import History
from artsg_nb.serving.metrics import reachable_hit_rate, reachable_text


def member(prompt, submission, reusable, cached=0, exact=True, turns=()):
    """A one- or multi-turn trajectory whose turn 1 was submitted as `submission`."""
    stats = [{"prompt_tokens": len(prompt), "cached_tokens": cached, "reusable_tokens": reusable,
              "submission": submission, "exact": exact}]
    stats += [{"prompt_tokens": p, "cached_tokens": 0, "reusable_tokens": r, "submission": "own history", "exact": True}
              for p, r in turns]
    return Trajectory(messages=[], token_ids=list(prompt) + [99], completion_mask=[0] * len(prompt) + [1],
                      logprobs=[0.0] * (len(prompt) + 1), reward=0.0, prompt_len=len(prompt), turn_stats=stats)


PROMPT = list(range(10))  # 10 tokens: a copy reads at most 9


def test_warm_up_first_reaches_the_prompt_less_its_last_token():
    group = TrajectoryGroup(0, [member(PROMPT, "warm-up first", 9) for _ in range(4)])
    reach = reachable_hit_rate([group])
    assert reach.rate == pytest.approx(0.9) and reach.path == "warm-up first" and reach.exact


def test_copies_prefilled_together_reach_nothing_and_say_why():
    group = TrajectoryGroup(0, [member(PROMPT, "prefilled together", 0) for _ in range(4)])
    reach = reachable_hit_rate([group])
    assert reach.rate == 0 and reach.path == "prefilled together"
    # the step line and the dashboard say it, with what the copies could still read across them
    assert reachable_text(reach.rate, reach.path, reach.shared) == " of 0.00 reachable + 0.68 shared (prefilled together)"


def test_a_leader_computes_what_its_followers_read():
    group = TrajectoryGroup(0, [member(PROMPT, "leader", 0)] + [member(PROMPT, "after leader", 9) for _ in range(3)])
    assert reachable_hit_rate([group]).rate == pytest.approx(27 / 40)
    assert reachable_hit_rate([group]).path == "leader first"


def test_every_request_at_once_is_only_an_upper_bound():
    group = TrajectoryGroup(0, [member(PROMPT, "unordered", 0, exact=False)] +
                            [member(PROMPT, "unordered", 9, exact=False) for _ in range(3)])
    reach = reachable_hit_rate([group])
    assert not reach.exact and reach.path == "unordered"


def test_later_turns_read_their_own_history():
    group = TrajectoryGroup(0, [member(PROMPT, "warm-up first", 9, turns=[(20, 12)])])
    reach = reachable_hit_rate([group])
    assert reach.rate == pytest.approx((9 + 12) / 30) and reach.path == "warm-up first + own history"


def test_a_prefix_shared_across_groups_is_counted_apart():
    # two groups whose prompts share a 6-token template; their copies were prefilled together
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9, 10]
    groups = [TrajectoryGroup(s, [member(p, "prefilled together", 0) for _ in range(2)]) for s, p in ((0, a), (1, b))]
    reach = reachable_hit_rate(groups)
    # b's first copy could read the 6-token template a cached; every second copy its group's first prompt
    assert reach.rate == 0 and reach.shared == pytest.approx((7 + 6 + 7) / 32)


def row(step, hit, reach, shared=0.0, path="warm-up first"):
    return {"step": step, "hit_rate": hit, "hit_rate_reachable": reach, "hit_rate_shared": shared,
            "hit_rate_path": path, "rollout_s": 0.1, "restarts": 0}


def test_the_check_fails_when_the_hit_rate_and_the_path_disagree():
    # the path says nothing could be reused, yet the server reports 0.8: the display would lie
    assert not check_hit_rates([row(1, 0.0, 0.0), row(2, 0.8, 0.0, path="prefilled together")]).passed
    # warm-up first reaches 0.9; a measured 0 means the warm-up did not cache the prompt
    assert not check_hit_rates([row(1, 0.0, 0.9), row(2, 0.0, 0.9)]).passed
    assert check_hit_rates([row(1, 0.0, 0.9), row(2, 0.88, 0.9)]).passed
    # copies meant to be prefilled together that missed their group's batch read the first's prompt:
    # counted in the shared share, so 0 is their lower bound, not their value
    together = TrajectoryGroup(0, [member(PROMPT, "prefilled together", 0) for _ in range(4)])
    assert reachable_hit_rate([together]).shared == pytest.approx(3 * 9 / 40)
    # above the reachable value only by the cross-group share the row states
    assert check_hit_rates([row(1, 0, 0), row(2, 0.3, 0.0, shared=0.28, path="prefilled together")]).passed
    assert not check_hit_rates([row(1, 0, 0), row(2, 0.5, 0.0, shared=0.28, path="prefilled together")]).passed
    # an upper bound only: anything up to it passes
    assert check_hit_rates([row(1, 0, 0), row(2, 0.2, 0.9, path="unordered")]).passed


def test_the_checks_count_loads_and_unloads_in_the_server_log():
    rows = [row(1, 0.9, 0.9) | {"reload_s": 0.02}, row(2, 0.9, 0.9) | {"reload_s": 0.02}]
    line = '[t] INFO:     127.0.0.1:1 - "POST /{}_lora_adapter HTTP/1.1" 200 OK\n'
    assert check_reloads(rows, line.format("load") * 3 + line.format("unload") * 2).passed
    assert not check_reloads(rows, line.format("load") * 3 + line.format("unload") * 1).passed
    names = {c.name for c in check_rows(rows, reward_rising=True, log_text="")}
    assert {"hit_rate", "restarts", "reward_rising", "reloads"} <= names


@pytest.mark.parametrize("warm_up, path", [("always", "warm-up first"), ("never", "prefilled together")])
def test_a_cpu_run_shows_the_path_its_client_took(tmp_path, tiny_model_dir, warm_up, path):
    """The balanced submission (the CPU engine made to miscount n > 1 references like SGLang):
    the row's reachable value and path come from what the client did, and the step line and the
    panel say it."""
    from artsg_nb import GRPORun, RunConfig
    from artsg_nb.view.plots.panels import plot_hit_rate

    cfg = RunConfig(engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"), group_size=4,
                    groups_per_step=2, prompt_warm_up=warm_up, server_args=("--fault", "lora-n-counter"))
    run = GRPORun(cfg).start()
    try:
        rows = [asyncio.run(run.step()) for _ in range(2)]
        # a notebook (and the GPU smoke) replaces the config between steps: the next step follows it
        run.cfg = replace(run.cfg, schedule="prefix")
        led = asyncio.run(run.step())
    finally:
        run.stop()
    assert led["hit_rate_path"] == "leader first"
    for r in rows:
        assert r["hit_rate_path"] == path
        if warm_up == "always":  # every copy reads the prompt the warm-up cached: measured = reachable
            assert r["hit_rate_reachable"] > 0.8 and r["hit_rate"] == pytest.approx(r["hit_rate_reachable"], abs=0.05)
        else:  # the CPU engine prefills a batch's copies in order (SGLang together): only the label is checked
            assert r["hit_rate_reachable"] == 0
    line = History.format_row(rows[-1])
    assert f"of {rows[-1]['hit_rate_reachable']:.2f} reachable" in line and f"({path})" in line
    ax = plot_hit_rate(run.history.df.iloc[:2])  # the two steps under the path being checked
    assert any(path.split()[0] in t.get_text() for t in ax.texts)


def test_a_misspelt_prompt_warm_up_is_refused_when_the_config_is_built():
    from artsg_nb import RunConfig
    from artsg_nb.run.config_checks import ConfigError

    with pytest.raises(ConfigError, match="did you mean 'always'"):
        RunConfig(engine="cpu", prompt_warm_up="alway")


def test_a_step_that_needs_more_kv_cache_than_the_server_holds_is_only_an_upper_bound():
    """7B at 1024 new tokens on one H100 (2026-12-07): 128 sequences of ~1,060 tokens against a KV
    cache of ~40k tokens ran in waves, and the hit rate read 0.86 of 0.97: prompts were evicted."""
    group = TrajectoryGroup(0, [member(PROMPT, "warm-up first", 9) for _ in range(4)])  # prompt 10 once + 4 x 1
    assert reachable_hit_rate([group], kv_tokens=14).exact
    short = reachable_hit_rate([group], kv_tokens=13)
    assert not short.exact and short.kv_short == (14, 13) and short.path.endswith("KV short")
    # no more groups at once than requests in flight (RunConfig.concurrency)
    assert reachable_hit_rate([group, group, group], kv_tokens=30, in_flight=2).exact
    assert reachable_text(short.rate, short.path, short.shared) == " of 0.90 reachable (warm-up first, KV short)"
    assert check_hit_rates([row(1, 0, 0), row(2, 0.86, 0.97, path=short.path)]).passed


def test_the_tracker_reads_the_kv_cache_size_from_sglang_metrics():
    from pathlib import Path

    from artsg_nb.serving.metrics import HitRateTracker

    text = (Path(__file__).parent / "fixtures" / "sglang-0.5.14" / "metrics.txt").read_text()
    tracker = HitRateTracker("sglang")
    tracker.add_sample(text)
    assert tracker.kv_tokens == 6002616
