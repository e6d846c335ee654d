"""bench.step: the CSV's exact columns, the legs and their order, the artsg_nb leg at RunConfig's
defaults, merging into an existing CSV, the ratios, TRL's config matching ours, the CPU stand-in
for TRL's fused log-prob kernel, and (slow) every leg end to end on the CPU engine."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from artsg_nb.bench import load_results, load_step_results, step, step_job, step_ratios, step_trl
from artsg_nb.rl.grpo import GRPOConfig
from artsg_nb.rl.logprobs import TorchLogProb
from artsg_nb.run.config import RunConfig


def test_cli_flags_parse():
    cfg = step.parse_args(["--engine", "sglang", "--max-new-tokens", "8", "256", "--steps", "5",
                           "--groups", "16", "--group-size", "8", "--frameworks", "trl"])
    assert (cfg.engine, cfg.max_new_tokens, cfg.steps, cfg.groups, cfg.group_size, cfg.frameworks) == (
        "sglang", (8, 256), 5, 16, 8, ("trl",))
    assert cfg.learning_rate == 2e-4
    assert (cfg.pipeline, cfg.verify_adapter, cfg.merge) == ((False, True), None, True)
    cfg = step.parse_args(["--frameworks", "artsg_nb", "--pipeline", "True", "--verify-adapter", "False", "--no-merge"])
    assert (cfg.frameworks, cfg.pipeline, cfg.verify_adapter, cfg.merge) == (("artsg_nb",), (True,), False, False)


def test_legs_run_per_job_sync_then_pipelined_then_trl_and_name_their_pipeline():
    cfg = step.StepBenchConfig(max_new_tokens=(8, 256), frameworks=("trl", "artsg_nb"), pipeline=(True, False))
    assert step.legs(cfg) == [("artsg_nb", 8, False), ("artsg_nb", 8, True), ("trl", 8, False),
                              ("artsg_nb", 256, False), ("artsg_nb", 256, True), ("trl", 256, False)]
    assert step.legs(dataclasses.replace(cfg, frameworks=("artsg_nb",), pipeline=(True,))) == [
        ("artsg_nb", 8, True), ("artsg_nb", 256, True)]
    assert step.legs(dataclasses.replace(cfg, frameworks=("trl",), pipeline=(True,))) == [("trl", 8, False), ("trl", 256, False)]
    for leg in step.legs(cfg):
        assert step.parse_leg_name(step.leg_name(*leg)) == leg
    assert step.leg_name("artsg_nb", 256, True) == "artsg_nb:256:pipe" and step.leg_name("trl", 8, False) == "trl:8"
    with pytest.raises(ValueError, match="FRAMEWORK:MAX_NEW"):
        step.parse_leg_name("artsg_nb:8:piped")


JOB_FIELDS = {"task", "engine", "model_path", "run_dir", "group_size", "groups_per_step", "max_new_tokens", "temperature",
              "learning_rate", "lora_rank", "lora_alpha", "seed", "pipeline", "grpo", "verbose"}
"""The RunConfig fields the artsg_nb leg sets; every other one stays at RunConfig's default."""


def test_the_artsg_nb_leg_runs_at_runconfig_defaults_but_the_job():
    cfg = step.StepBenchConfig(engine="sglang", max_new_tokens=(256,))
    default = RunConfig()
    for pipeline in (False, True):
        rc = step.artsg_run_config(cfg, 256, pipeline)
        assert rc.pipeline is pipeline and rc.max_new_tokens == rc.grpo.max_completion_length == 256
        changed = {f.name for f in dataclasses.fields(RunConfig) if getattr(rc, f.name) != getattr(default, f.name)}
        assert changed <= JOB_FIELDS, changed - JOB_FIELDS
        assert rc.verify_adapter is True and rc.api_key == default.api_key
    assert step.artsg_run_config(cfg, 8, False).run_dir != step.artsg_run_config(cfg, 8, True).run_dir
    off = step.artsg_run_config(dataclasses.replace(cfg, verify_adapter=False, schedule="prefix"), 8, False)
    assert (off.verify_adapter, off.schedule) == (False, "prefix")


def bench_row(framework, max_new, pipeline=False, model="M", step_s=1.0, **extra):
    """A result row as a leg returns it (fake numbers)."""
    row = {c: 1.0 for c in step.COLUMNS}
    row.update(framework=framework, engine="sglang" if framework == "artsg_nb" else "transformers", model=model,
               max_new_tokens=max_new, pipeline=pipeline, step_s_median=step_s, hardware="NVIDIA H200 x1",
               date="2026-12-05", commit="abc1234", **extra)
    return row


def test_merge_replaces_the_legs_run_now_and_keeps_the_others(tmp_path):
    """A CSV from before the new columns: its rows count as synchronous; only the rows of the legs
    just run (framework, engine, model, max_new_tokens, pipeline) are replaced."""
    path = tmp_path / "step.csv"
    old_columns = step.COLUMNS[:step.COLUMNS.index("pipeline")]
    old = pd.DataFrame([bench_row("artsg_nb", 8, step_s=9.0), bench_row("trl", 8, step_s=7.0),
                        bench_row("artsg_nb", 256, step_s=8.0), bench_row("artsg_nb", 8, model="other", step_s=6.0)])
    old[old_columns].to_csv(path, index=False)
    earlier = step.earlier_rows(path)
    assert list(earlier.columns) == step.COLUMNS and not earlier["pipeline"].any() and earlier["commit"].isna().all()
    new = pd.DataFrame([bench_row("artsg_nb", 8, step_s=1.0), bench_row("artsg_nb", 8, pipeline=True, step_s=0.5),
                        bench_row("trl", 256, step_s=3.0)]).reindex(columns=step.COLUMNS)
    merged, replaced = step.merge_rows(earlier, new)
    assert list(replaced[["framework", "model", "max_new_tokens", "step_s_median"]].itertuples(index=False, name=None)) == [
        ("artsg_nb", "M", 8, 9.0)]
    got = list(merged[["framework", "model", "max_new_tokens", "pipeline", "step_s_median"]].itertuples(index=False, name=None))
    assert got == [("artsg_nb", "other", 8, False, 6.0), ("artsg_nb", "M", 8, False, 1.0), ("artsg_nb", "M", 8, True, 0.5),
                   ("trl", "M", 8, False, 7.0), ("artsg_nb", "M", 256, False, 8.0), ("trl", "M", 256, False, 3.0)]
    assert list(merged.columns) == step.COLUMNS
    again, replaced = step.merge_rows(merged, new)  # the same legs once more: replaced, not added
    assert len(again) == len(merged) and len(replaced) == len(new)
    (tmp_path / "other.csv").write_text("engine,mode\nsglang,raw\n")  # not a step benchmark CSV: nothing to keep
    assert step.earlier_rows(tmp_path / "other.csv").empty and step.earlier_rows(tmp_path / "missing.csv").empty


def test_run_step_bench_merges_calls_into_one_csv_and_logs_what_it_replaced(tmp_path, monkeypatch, caplog):
    """The GPU session's two calls: synchronous + TRL, then the pipelined legs, into one file; a
    rerun replaces its own rows; merge=False starts the file afresh."""
    calls = []

    def fake_leg(cfg, framework, max_new, pipeline=False):
        calls.append(step.leg_name(framework, max_new, pipeline))
        return bench_row(framework, max_new, pipeline, step_s=len(calls))

    monkeypatch.setattr(step, "run_leg", fake_leg)
    out = tmp_path / "step.csv"
    cfg = step.StepBenchConfig(max_new_tokens=(8, 256), pipeline=(False,), out=str(out), isolate=False)
    step.run_step_bench(cfg)
    assert calls == ["artsg_nb:8", "trl:8", "artsg_nb:256", "trl:256"]
    with caplog.at_level(logging.INFO, logger=step.__name__):
        df = step.run_step_bench(dataclasses.replace(cfg, frameworks=("artsg_nb",), pipeline=(True,)))
    assert "replacing" not in caplog.text
    saved = pd.read_csv(out, dtype={"commit": str})
    assert list(saved.columns) == step.COLUMNS and saved["commit"].eq("abc1234").all()
    assert list(zip(saved["framework"], saved["max_new_tokens"], saved["pipeline"], saved["step_s_median"])) == [
        ("artsg_nb", 8, False, 1), ("artsg_nb", 8, True, 5), ("trl", 8, False, 2),
        ("artsg_nb", 256, False, 3), ("artsg_nb", 256, True, 6), ("trl", 256, False, 4)]
    assert list(df["step_s_median"]) == list(saved["step_s_median"])
    assert step_ratios(df).loc[(256, True), "speedup_vs_trl"] == pytest.approx(4 / 6)
    with caplog.at_level(logging.INFO, logger=step.__name__):
        step.run_step_bench(dataclasses.replace(cfg, max_new_tokens=(8,), frameworks=("trl",)))
    assert caplog.text.count("replacing the earlier row") == 1 and "trl transformers M max_new_tokens=8" in caplog.text
    assert list(pd.read_csv(out)["step_s_median"]) == [1, 5, 7, 3, 6, 4]
    step.run_step_bench(dataclasses.replace(cfg, max_new_tokens=(8,), frameworks=("trl",), merge=False))
    assert list(pd.read_csv(out)["step_s_median"]) == [8]


def test_commit_names_the_checkout_and_never_fails(monkeypatch):
    monkeypatch.delenv("ARTSG_COMMIT", raising=False)
    step_job.source_commit.cache_clear()
    try:
        commit = step_job.source_commit()
        assert isinstance(commit, str)
        if commit:  # a git checkout (this repository's tests run in one)
            assert re.fullmatch(r"[0-9a-f]{4,40}(-dirty)?", commit), commit
        step_job.source_commit.cache_clear()
        monkeypatch.setenv("PATH", "")  # no git at all
        assert step_job.source_commit() == ""
    finally:
        step_job.source_commit.cache_clear()


def test_commit_is_the_one_the_device_command_names(monkeypatch):
    """A GPU host's copy of the tree has a stale .git: the commit the command names wins."""
    step_job.source_commit.cache_clear()
    monkeypatch.setenv("ARTSG_COMMIT", "abc1234")
    try:
        assert step_job.source_commit() == "abc1234"
    finally:
        step_job.source_commit.cache_clear()


def test_the_artsg_nb_leg_imports_unsloth_first():
    """bench.step, and the session its artsg_nb leg runs, import nothing of transformers, PEFT or TRL:
    Unsloth must be imported before them (it patches them), and the trainer imports it when it loads
    the model. A fresh interpreter, since this one has imported them already."""
    import subprocess
    import sys

    code = ("import sys, artsg_nb.bench.step, artsg_nb.run.session; "
            "print(sorted(m for m in ('transformers', 'peft', 'trl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_trl_config_is_our_job(tmp_path):
    cfg = step.StepBenchConfig(groups=3, group_size=4, steps=7)
    t = step_trl.trl_config(cfg, 32, str(tmp_path))
    ours = GRPOConfig()
    assert (t.num_generations, t.per_device_train_batch_size, t.steps_per_generation, t.num_iterations) == (4, 12, 1, 1)
    assert (t.loss_type, t.beta, t.epsilon, t.epsilon_high, t.scale_rewards) == (
        ours.loss_type, ours.beta, ours.epsilon_low, ours.epsilon_high, ours.scale_rewards)
    assert (t.max_completion_length, t.temperature, t.learning_rate, t.max_steps) == (32, 1.0, 2e-4, 7)
    assert t.use_vllm is False and t.gradient_checkpointing is False
    assert getattr(t.lr_scheduler_type, "value", t.lr_scheduler_type) == "constant"


def test_trl_reward_func_is_the_task_reward_of_each_rows_episode():
    from artsg_nb.tasks.registry import get_task
    cfg = step.StepBenchConfig()
    assert cfg.task == "addition_chat"
    rows = step_job.job_prompts(cfg, 3)
    envs = [get_task("addition_chat").make_env(r["seed"]) for r in rows]
    assert [r["prompt"] for r in rows] == [e.reset() for e in envs]  # the episodes artsg_nb's task would ask
    replies = [f"{envs[0].a} + {envs[0].b} = {envs[0].answer}", f"It is {envs[1].answer + 1}.", "seven"]
    completions = [[{"role": "assistant", "content": c}] for c in replies]
    seeds = [r["seed"] for r in rows]
    assert step_job.task_reward_func("addition_chat")(completions, seed=seeds) == [1.0, 0.4, 0.0]
    strict = step_job.task_reward_func("addition")  # the bare number only
    assert strict(completions, seed=seeds)[0] == 0.0 and strict([[{"role": "assistant", "content": f" {envs[0].answer} "}]],
                                                                 seed=seeds[:1]) == [1.0]
    assert step_job.job_label(cfg).startswith("addition_chat 16x8 ")
    assert step.artsg_run_config(cfg, 8, False).task == "addition_chat"


def test_torch_logprob_matches_log_softmax():
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8)
    targets = torch.randint(0, 11, (5,))
    lp, ent, *_ = TorchLogProb.apply(hidden, weight, None, targets, 0.7, 4, None, 1.0, ("entropy",))
    ref = torch.log_softmax(hidden @ weight.t() / 0.7, -1)
    assert torch.allclose(lp, ref.gather(-1, targets[:, None])[:, 0], atol=1e-6)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)
    lp.sum().backward()
    assert hidden.grad is not None


def test_trl_scores_in_plain_torch_without_a_gpu_even_where_triton_imports(monkeypatch):
    """A fresh CPU machine gets Triton with torch: TRL's kernel imports but has no driver to run on."""
    from artsg_nb.bench import step_trl
    monkeypatch.setattr(step_trl.trl_utils, "_ChunkedLogProbFunction", object())  # Triton imported
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    step_trl.scoring_without_triton()
    assert step_trl.trl_utils._ChunkedLogProbFunction is TorchLogProb


def test_ratios_per_job_and_pipeline_setting_against_trl():
    rows = [bench_row("artsg_nb", 8, step_s=2.0, first_train_s=2.5, reload_s_median=0.1),
            bench_row("artsg_nb", 8, pipeline=True, step_s=1.0, first_train_s=2.6, reload_s_median=0.2),
            bench_row("trl", 8, step_s=3.0, first_train_s=9.0), bench_row("artsg_nb", 256, pipeline=True, step_s=5.0),
            bench_row("trl", 256, step_s=20.0)]
    r = step_ratios(pd.DataFrame(rows))
    assert list(r.index) == [(8, False), (8, True), (256, True)]
    assert list(r.columns) == ["artsg_nb_step_s", "trl_step_s", "speedup_vs_trl", "reload_s_median",
                               "reload_wait_s_median", "first_train_s", "overlap_median"]
    assert list(r["speedup_vs_trl"]) == [pytest.approx(1.5), pytest.approx(3.0), pytest.approx(4.0)]
    assert list(r["trl_step_s"]) == [3.0, 3.0, 20.0]
    assert (r.loc[(8, True), "first_train_s"], r.loc[(8, False), "reload_s_median"]) == (2.6, 0.1)  # artsg_nb's, not TRL's
    text = pd.DataFrame(rows).astype({"pipeline": str})  # "True"/"False", as a CSV column with gaps reads
    assert list(step_ratios(text).index) == list(r.index)
    no_trl = step_ratios(pd.DataFrame([bench_row("artsg_nb", 8, pipeline=True)]))
    assert no_trl.empty


def test_ratios_and_default_path(tmp_path):
    df = pd.DataFrame([{"framework": "artsg_nb", "max_new_tokens": 8, "step_s_median": 1.0, "hardware": "NVIDIA H200 x1"},
                       {"framework": "trl", "max_new_tokens": 8, "step_s_median": 1.5, "hardware": "NVIDIA H200 x1"}])
    r = step_ratios(df)
    assert r.loc[8, "speedup_vs_trl"] == pytest.approx(1.5)
    path = step.default_path(df, str(tmp_path))
    assert path.parent == tmp_path and path.name.endswith("-step-nvidia-h200-x1.csv")
    assert step_ratios(df[df.framework == "trl"]).empty


def test_committed_step_results_newest_per_hardware_and_kept_apart(tmp_path):
    """load_step_results takes each hardware's newest step CSV; load_results (the engine bench's
    tables) never mixes step CSVs in."""
    row = {**{c: 1.0 for c in step.COLUMNS}, "pipeline": False}
    for name, hw, t in [("20261201-step-h200.csv", "NVIDIA H200 x1", 9.0), ("20261203-step-h200.csv", "NVIDIA H200 x1", 2.0),
                        ("20261203-step-cpu.csv", "cpu 2 cores", 7.0)]:
        pd.DataFrame([{**row, "framework": fw, "hardware": hw, "max_new_tokens": 8,
                       "step_s_median": t * (3 if fw == "trl" else 1)} for fw in ("artsg_nb", "trl")]).to_csv(tmp_path / name, index=False)
    df = load_step_results(tmp_path)
    assert sorted(set(df["source"])) == ["20261203-step-cpu.csv", "20261203-step-h200.csv"]
    r = step_ratios(df)
    assert list(r["speedup_vs_trl"]) == [pytest.approx(3.0)] * 2 and r.loc[("20261203-step-h200.csv", 8, False), "artsg_nb_step_s"] == 2.0
    assert load_results(tmp_path).empty


def test_medians_leave_out_the_steps_without_that_part():
    """A skipped update has no reload (NaN): statistics.median's answer with a NaN in the list
    depends on where it sits."""
    nan = float("nan")
    assert {step_job._median(xs) for xs in ([nan, 0.1, 0.2, 0.3], [0.1, nan, 0.2, 0.3], [0.1, 0.2, 0.3, nan])} == {0.2}
    assert math.isnan(step_job._median([nan]))


def test_overlap_pairs_each_update_with_the_rollouts_it_sampled_ahead():
    """Build item 5 per step: step k's update overlaps step k+1's rollouts (reported in row k+1).
    Pairing a row's own rollouts instead would give step 2 0.44 / 0.2 = 2.2."""
    step_s, rollout_s, train_s, ahead = [1.0, 0.44, 0.36, 0.30], [0.5, 0.2, 0.4, 0.3], [0.5, 0.1, 0.3, 0.25], [0, 1, 1, 1]
    ratios = step_job.overlap_ratios(step_s, rollout_s, train_s, ahead)
    assert math.isnan(ratios[0])  # step 1 rolled out afresh: not an overlapped step
    assert ratios[1:3] == [pytest.approx(0.44 / 0.4), pytest.approx(0.36 / 0.3)] and math.isnan(ratios[3])
    assert step_job.overlap_ratios(step_s, rollout_s, train_s, [1] * 4)[0] == pytest.approx(2.0)
    cfg = step.StepBenchConfig(warmup=1)
    leg = lambda pipeline, warmup=1, staleness=ahead: step_job.leg_result(  # noqa: E731
        dataclasses.replace(cfg, warmup=warmup), "artsg_nb", "sglang", 8, step_s, rollout_s, train_s, [0.01] * 4,
        [100.0] * 4, [0.5] * 4, pipeline=pipeline, staleness=staleness)
    assert leg(True)["overlap_median"] == pytest.approx((1.1 + 1.2) / 2)  # steps 2 and 3; the last has no pair
    assert leg(True, staleness=[1] * 4)["overlap_median"] == pytest.approx(1.15)  # the warm-up step (2.0) left out
    assert leg(True, warmup=0, staleness=[1] * 4)["overlap_median"] == pytest.approx(1.2)  # ... and kept
    assert leg(True, warmup=0)["overlap_median"] == pytest.approx((1.1 + 1.2) / 2)  # step 1 is not overlapped
    assert math.isnan(leg(False, staleness=None)["overlap_median"])


def test_overlap_leaves_out_steps_that_rolled_out_afresh():
    """A skipped update (no signal: train_s 0, no rollouts ahead) and the step after it, which rolls
    out afresh (staleness 0), are not overlapped steps; a NaN train_s neither."""
    nan = float("nan")
    ratios = step_job.overlap_ratios([0.3, 0.2, 0.5, 0.3, 0.3], [0.2, 0.2, 0.2, 0.2, 0.2], [0.25, 0.0, 0.25, 0.25, nan],
                                     [1, 1, 0, 1, 1])
    assert math.isnan(ratios[1]) and math.isnan(ratios[2]) and math.isnan(ratios[4])
    assert ratios[0] == pytest.approx(1.2) and ratios[3] == pytest.approx(1.2)


def test_rows_from_before_reload_wait_say_what_they_can(tmp_path):
    """A synchronous artsg_nb row waited for all of its reload, TRL for none; a pipelined one is unknown."""
    rows = [{**{c: 1.0 for c in step.COLUMNS[:step.COLUMNS.index("job") + 1]}, "framework": fw, "pipeline": pipe,
             "hardware": "H100", "reload_s_median": 0.08, "commit": "abc"}
            for fw, pipe in [("artsg_nb", False), ("artsg_nb", True), ("trl", False)]]
    pd.DataFrame(rows).to_csv(tmp_path / "20261201-step-h100.csv", index=False)  # no reload_wait_s_median
    for df in (load_step_results(tmp_path), step.earlier_rows(tmp_path / "20261201-step-h100.csv")):
        wait = list(df["reload_wait_s_median"])
        assert wait[0] == 0.08 and math.isnan(wait[1]) and wait[2] == 0.0, wait


def test_a_commit_of_digits_and_one_e_is_read_back_as_text(tmp_path):
    """`5683e12` (a real hash) read as a number became 5.683e+15 in notebook 03's table."""
    row = {**{c: 1.0 for c in step.COLUMNS}, "framework": "artsg_nb", "hardware": "NVIDIA H100 x1",
           "pipeline": False, "commit": "5683e12"}
    pd.DataFrame([row]).to_csv(tmp_path / "20261206-step-h100.csv", index=False)
    assert list(load_step_results(tmp_path)["commit"]) == ["5683e12"]


@pytest.fixture(scope="module")
def cpu_bench(tmp_path_factory, tiny_model_dir):
    """Every leg once on the CPU engine (artsg_nb synchronous and pipelined, TRL), 3 steps each:
    (its config, the returned frame, the CSV as saved)."""
    tmp = tmp_path_factory.mktemp("step")
    out = tmp / "step.csv"
    cfg = step.StepBenchConfig(engine="cpu", model_path=str(tiny_model_dir), max_new_tokens=(8,), steps=3,
                               groups=2, group_size=2, run_dir=str(tmp / "runs"), out=str(out), isolate=False)
    df = step.run_step_bench(cfg)
    return cfg, df, pd.read_csv(out, dtype={"commit": str}, keep_default_na=False)


@pytest.mark.slow
def test_cpu_step_bench_every_leg(cpu_bench):
    cfg, df, saved = cpu_bench
    assert list(saved.columns) == step.COLUMNS
    assert list(zip(saved["framework"], saved["pipeline"])) == [("artsg_nb", False), ("artsg_nb", True), ("trl", False)]
    assert (saved["steps"] == 3).all()
    for row in saved.itertuples():
        assert row.step_s_median > 0 and row.rollout_s_median > 0 and row.train_s_median > 0
        assert row.tokens_per_step > 0 and 0 <= row.reward_first <= 1 and 0 <= row.reward_last <= 1
        assert row.start_s > 0 and row.first_step_s > 0 and row.first_train_s > 0
        assert row.first_train_s < row.first_step_s  # an update is part of its step
        assert isinstance(row.commit, str) and row.commit == step_job.source_commit()
    assert (saved.loc[:1, "reload_s_median"] > 0).all() and saved.loc[2, "reload_s_median"] == 0
    # waited for: all of a synchronous reload, part of a pipelined one (its history's reload_wait_s), none for TRL
    assert saved.loc[0, "reload_wait_s_median"] == saved.loc[0, "reload_s_median"]
    assert saved.loc[2, "reload_wait_s_median"] == 0
    history = Path(step.artsg_run_config(cfg, 8, True).run_dir) / "history.jsonl"
    waits = [json.loads(line)["reload_wait_s"] for line in history.read_text().splitlines()]
    assert saved.loc[1, "reload_wait_s_median"] == pytest.approx(step_job._median(waits[cfg.warmup:])), waits
    assert saved.loc[0, "overlap_median"] == "" and saved.loc[2, "overlap_median"] == ""  # NaN: synchronous, TRL
    steps = [json.loads(line) for line in history.read_text().splitlines()]
    # step 2 (after the warm-up) paired with step 3's rollouts, which it awaited along with its update: >= 1
    assert len(steps) == 3 and 1.0 <= float(saved.loc[1, "overlap_median"]) < math.inf
    r = step_ratios(df)
    assert list(r.index) == [(8, False), (8, True)] and r["speedup_vs_trl"].notna().all()
    assert not math.isnan(r.loc[(8, True), "first_train_s"])


@pytest.mark.slow
def test_cpu_step_bench_pipelined_leg_samples_ahead(cpu_bench):
    """The pipelined leg really ran RunConfig(pipeline=True): its second step trained on rollouts
    sampled during the first update (history column staleness), the synchronous one's did not."""
    cfg = cpu_bench[0]
    history = {p: Path(step.artsg_run_config(cfg, 8, p).run_dir) / "history.jsonl" for p in (False, True)}
    staleness = {p: [json.loads(line).get("staleness", 0) for line in h.read_text().splitlines()] for p, h in history.items()}
    assert staleness == {False: [0, 0, 0], True: [0, 1, 1]}


def test_rows_of_another_job_shape_are_neither_replaced_nor_compared():
    """A rerun with other groups / group size is a different job: its rows sit beside the earlier
    ones, and each artsg_nb row is compared with the TRL row of its own job."""
    big, small = "16x8 r16/32 lr0.0002 seed0", "4x4 r16/32 lr0.0002 seed0"
    earlier = pd.DataFrame([bench_row("artsg_nb", 8, step_s=1.0, job=big),
                            bench_row("trl", 8, step_s=2.0, job=big)]).reindex(columns=step.COLUMNS)
    new = pd.DataFrame([bench_row("artsg_nb", 8, step_s=0.1, job=small)]).reindex(columns=step.COLUMNS)
    merged, replaced = step.merge_rows(earlier, new)
    assert replaced.empty and sorted(merged["job"]) == sorted([small, big, big])
    merged = pd.concat([merged, pd.DataFrame([bench_row("trl", 8, step_s=0.4, job=small)])], ignore_index=True)
    ratios = step_ratios(merged)
    assert ratios.loc[(8, big, False), "speedup_vs_trl"] == pytest.approx(2.0)
    assert ratios.loc[(8, small, False), "speedup_vs_trl"] == pytest.approx(4.0)
