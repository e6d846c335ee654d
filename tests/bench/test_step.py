"""bench.step: the CSV's exact columns, the ratios, TRL's config matching ours, the CPU
stand-in for TRL's fused log-prob kernel, and (slow) both frameworks end to end on the CPU engine."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from artsg_nb.bench import load_results, load_step_results, step, step_ratios, step_trl
from artsg_nb.rl.grpo import GRPOConfig


def test_cli_flags_parse():
    cfg = step.parse_args(["--engine", "sglang", "--max-new-tokens", "8", "256", "--steps", "5",
                           "--groups", "16", "--group-size", "8", "--frameworks", "trl"])
    assert (cfg.engine, cfg.max_new_tokens, cfg.steps, cfg.groups, cfg.group_size, cfg.frameworks) == (
        "sglang", (8, 256), 5, 16, 8, ("trl",))
    assert cfg.learning_rate == 2e-4


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


def test_reward_func_is_the_task_reward():
    completions = [[{"role": "assistant", "content": "7"}], [{"role": "assistant", "content": " 6 "}],
                   [{"role": "assistant", "content": "seven"}]]
    assert step_trl.addition_reward_func(completions, answer=[7, 7, 7]) == [1.0, 0.4, 0.0]


def test_torch_logprob_matches_log_softmax():
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8)
    targets = torch.randint(0, 11, (5,))
    lp, ent, *_ = step_trl.TorchLogProb.apply(hidden, weight, None, targets, 0.7, 4, None, 1.0, ("entropy",))
    ref = torch.log_softmax(hidden @ weight.t() / 0.7, -1)
    assert torch.allclose(lp, ref.gather(-1, targets[:, None])[:, 0], atol=1e-6)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)
    lp.sum().backward()
    assert hidden.grad is not None


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
    row = {c: 1.0 for c in step.COLUMNS}
    for name, hw, t in [("20261201-step-h200.csv", "NVIDIA H200 x1", 9.0), ("20261203-step-h200.csv", "NVIDIA H200 x1", 2.0),
                        ("20261203-step-cpu.csv", "cpu 2 cores", 7.0)]:
        pd.DataFrame([{**row, "framework": fw, "hardware": hw, "max_new_tokens": 8,
                       "step_s_median": t * (3 if fw == "trl" else 1)} for fw in ("artsg_nb", "trl")]).to_csv(tmp_path / name, index=False)
    df = load_step_results(tmp_path)
    assert sorted(set(df["source"])) == ["20261203-step-cpu.csv", "20261203-step-h200.csv"]
    r = step_ratios(df)
    assert list(r["speedup_vs_trl"]) == [pytest.approx(3.0)] * 2 and r.loc[("20261203-step-h200.csv", 8), "artsg_nb_step_s"] == 2.0
    assert load_results(tmp_path).empty


@pytest.mark.slow
def test_cpu_step_bench_both_frameworks(tmp_path, tiny_model_dir):
    out = tmp_path / "step.csv"
    cfg = step.StepBenchConfig(engine="cpu", model_path=str(tiny_model_dir), max_new_tokens=(8,), steps=2,
                               groups=2, group_size=2, run_dir=str(tmp_path / "runs"), out=str(out), isolate=False)
    df = step.run_step_bench(cfg)
    saved = pd.read_csv(out)
    assert list(saved.columns) == step.COLUMNS
    assert list(saved["framework"]) == ["artsg_nb", "trl"] and (saved["steps"] == 2).all()
    for row in saved.itertuples():
        assert row.step_s_median > 0 and row.rollout_s_median > 0 and row.train_s_median > 0
        assert row.tokens_per_step > 0 and 0 <= row.reward_first <= 1 and 0 <= row.reward_last <= 1
    assert saved.loc[0, "reload_s_median"] > 0 and saved.loc[1, "reload_s_median"] == 0
    assert not math.isnan(step_ratios(df).loc[8, "speedup_vs_trl"])
