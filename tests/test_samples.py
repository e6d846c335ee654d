"""Samples: every step's trajectories in rollouts/step-N.jsonl, run.samples() as a DataFrame, the
zero-advantage count in the progress line, and a step without signal that trains nothing."""
import asyncio
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from artsg_nb.run.history import History
from artsg_nb.rollout.samples import constant_groups
from artsg_nb.run.session import GRPORun, RunConfig
from artsg_nb.tasks.registry import StepResult
from scripted_tasks import alternating_reward


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    cfg = RunConfig(task="addition", engine="cpu", model_path=str(tiny_model_dir),
                    run_dir=str(tmp_path_factory.mktemp("samples") / "run"), group_size=4, groups_per_step=2,
                    verify_adapter=False, verbose=True)
    with GRPORun(cfg) as r:
        yield r


def test_step_writes_every_trajectory_and_samples_reads_them(run, capsys):
    row = asyncio.run(run.step())
    step = row["step"]
    path = run.run_dir / "rollouts" / f"step-{step}.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2 * 4
    assert {(r["group"], r["member"]) for r in lines} == {(g, m) for g in range(2) for m in range(4)}
    first = lines[0]
    assert first["messages"][0]["role"] == "user" and first["messages"][-1]["role"] == "assistant"
    assert first["completion"] == first["messages"][-1]["content"] and first["prompt"].startswith("What is")
    assert first["finish_reason"] in ("stop", "length") and first["completion_tokens"] > 0
    assert first["prompt_tokens"] > 0 and first["error"] is None and first["adapter"] == "policy-step-0"
    df = run.samples()
    assert len(df) == 8 and list(df.columns[:8]) == ["step", "group", "seed", "member", "prompt", "completion",
                                                   "reward", "finish_reason"]
    assert df["reward"].mean() == pytest.approx(row["reward_mean"])
    assert len(run.samples(step=step, k=3)) == 3
    with pytest.raises(FileNotFoundError, match="saved steps"):
        run.samples(step=999)
    out = capsys.readouterr().out
    assert f"step {step} |" in out
    zero = row["zero_adv_groups"]
    assert (f"zero-adv {zero}/2" in out) == (zero > 0)


def test_step_without_signal_skips_the_update_and_keeps_the_served_adapter(run, monkeypatch):
    real_task = run.task
    # Every reply earns 0.5: every group's rewards are identical, so every advantage is zero.
    flat = replace(real_task, factory=lambda seed: _FlatEnv(real_task.make_env(seed)))
    monkeypatch.setattr(run, "task", flat)
    monkeypatch.setattr(run.trainer, "train_step", lambda groups: pytest.fail("no backward pass expected"))
    before_step, served = run.trainer.step, run.adapter
    weights = {k: v.clone() for k, v in run.trainer.model.state_dict().items() if "lora_" in k}
    row = asyncio.run(run.step())
    assert row["update_skipped"] is True and row["zero_adv_groups"] == 2 and row["loss"] is None
    assert run.trainer.step == before_step + 1 == row["step"]
    assert run.adapter == served == row["adapter"]  # the served adapter stays
    assert set(asyncio.run(run.client.list_adapters())) == {served}
    after = run.trainer.model.state_dict()
    assert all(torch.equal(weights[k], after[k]) for k in weights)
    # The step is checkpointed (resume restores it) and recorded.
    assert (run.run_dir / "adapters" / f"policy-step-{row['step']}" / "trainer" / "trainer_state.json").exists()
    assert History.load(run.run_dir).last["update_skipped"] is True
    assert "no update (no signal)" in History.format_row(row)
    # The next step with a signal (scripted, member i earns i % 2) trains again and publishes a new version.
    monkeypatch.undo()
    monkeypatch.setattr(run, "task", replace(real_task, group_reward=alternating_reward))
    row = asyncio.run(run.step())
    assert not row["update_skipped"] and row["adapter"] == f"policy-step-{row['step']}" == run.adapter


class _FlatEnv:
    def __init__(self, env):
        self.env = env

    def reset(self):
        return self.env.reset()

    def step(self, reply):
        return StepResult(messages=[], reward=0.5, done=True)


def _traj(reward, error=None):
    return SimpleNamespace(reward=reward, error=error, valid=error is None and reward is not None)


def test_constant_groups_counts_groups_without_signal():
    g = lambda *ts: SimpleNamespace(trajectories=list(ts))  # noqa: E731
    assert constant_groups([g(_traj(1.0), _traj(0.0)), g(_traj(1.0), _traj(1.0))]) == (1, False)
    assert constant_groups([g(_traj(1.0), _traj(1.0)), g(_traj(0.0), _traj(0.0, "boom"))]) == (2, True)
    # Every rollout failed: not "no signal" (the trainer raises, so the failure is seen).
    assert constant_groups([g(_traj(None, "boom"))]) == (1, False)


def test_chat_answers_with_the_served_adapter_and_with_the_base_model(run):
    """run.chat: the notebook's before/after cell, against the live server (issue 50 item 4)."""
    asyncio.run(run.step())
    trained = asyncio.run(run.chat("What is 2+3?", max_new_tokens=6))
    base = asyncio.run(run.chat([{"role": "user", "content": "What is 2+3?"}], base=True, max_new_tokens=6))
    assert isinstance(trained, str) and isinstance(base, str)
    assert trained == asyncio.run(run.chat("What is 2+3?", max_new_tokens=6)), "greedy: the same reply twice"
