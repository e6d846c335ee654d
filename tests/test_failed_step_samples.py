"""A step that stops because nothing earned a reward still leaves its completions in
run_dir/rollouts (issue 50: "the failing step's completions are not saved, so the user cannot see
what broke it")."""
import asyncio
import json

import pytest

from artsg_nb import GRPORun, RunConfig, Task
from artsg_nb.rollout.trajectory import NoRewardError


def none_for_all(prompts, completions, **kw):
    return [None] * len(completions)


def test_a_step_without_rewards_saves_the_completions_it_stopped_on(tmp_path, tiny_model_dir):
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}]} for i in range(4)]
    task = Task.from_dataset(rows, reward_funcs=none_for_all, max_new_tokens=4, dry_run=False)
    run = GRPORun(RunConfig(engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"), task=task,
                            group_size=2, groups_per_step=2)).start()
    try:
        with pytest.raises(NoRewardError):
            asyncio.run(run.step())
    finally:
        run.stop()
    lines = (tmp_path / "run" / "rollouts" / "step-1.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all("completion" in json.loads(line) for line in lines)
