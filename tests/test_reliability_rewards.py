"""Rewards the float32 training math cannot hold, and tasks config.json cannot name.

  - a reward of 1e39 (finite in Python, inf in float32) under `python -O`, which drops asserts:
    the update stays finite (rewards are normalised in float64) and a reward whose advantages are
    still not finite raises ValueError before anything is trained (before: only compute_advantages'
    assert guarded it, and under -O a NaN adapter was saved; every later step failed);
  - a Task defined in `__main__` while multiprocessing has aliased it as `__mp_main__` is recorded
    with the "not importable" note (before: "__mp_main__:ATTR", which no process can import).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)

UNDER_O = r'''
import math, sys, torch
assert not __debug__ or sys.exit("run under python -O")
from artsg_nb.rl.trainer import Trainer, TrainerConfig
from test_distributed import _groups
trainer = Trainer(TrainerConfig(model_path=sys.argv[1], lora_rank=4, lora_alpha=8, seed=0))
groups = _groups()
groups[0].trajectories[0].reward = 1e39
trainer.train_step(groups)
bad = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
print("nonfinite", len(bad))
for t in groups[1].trajectories[:2]:
    t.reward = 1.7e308  # their sum overflows even float64: the group mean is inf
try:
    trainer.train_step(groups)
    print("trained")
except ValueError as e:
    print("refused", "non-finite advantages" in str(e))
'''


def test_a_huge_reward_never_makes_a_non_finite_update_under_python_O(tiny_model_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-O", "-c", UNDER_O, str(tiny_model_dir)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["nonfinite 0", "refused True"], out.stdout


MP_MAIN = r'''
import sys
from artsg_nb.tasks.registry import NOT_IMPORTABLE, Task, task_spec
my_task = Task("mine", "defined in __main__", 1, 4, factory=lambda seed: None)
sys.modules["__mp_main__"] = sys.modules["__main__"]  # what multiprocessing does in a notebook kernel
print(task_spec(my_task) == ("mine", NOT_IMPORTABLE), task_spec(my_task))
'''


def test_a_task_in_main_aliased_as_mp_main_is_recorded_as_not_importable():
    out = subprocess.run([sys.executable, "-c", MP_MAIN], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("True"), out.stdout


def test_a_finite_but_huge_reward_keeps_every_row(tmp_path, tiny_model_dir):
    """Rewards of 1e200 (finite): the step trains, saves and serves, and its row is written with
    reward_std recorded as null (before: OverflowError squaring them while the row was built,
    after the step was served; history went on [1, 4])."""
    import asyncio
    import math
    from dataclasses import replace

    from artsg_nb.run.session import GRPORun, RunConfig
    from scripted_tasks import ADDITION_WITH_SIGNAL

    task = replace(ADDITION_WITH_SIGNAL, name="huge-reward",
                   group_reward=lambda envs, trajs: [1e200 * (i % 2) for i in range(len(trajs))])
    cfg = RunConfig(task=task, engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"),
                    group_size=2, groups_per_step=2, lora_rank=4, lora_alpha=8, seed=5, verbose=False)
    with GRPORun(cfg) as run:
        rows = [asyncio.run(run.step()) for _ in range(2)]
        assert [r["step"] for r in run.history.rows] == [1, 2] and run.adapter == "policy-step-2"
    assert all(math.isclose(r["reward_mean"], 5e199) and math.isnan(r["reward_std"]) for r in rows), rows
