"""Tasks whose reward signal the test controls, for tests that need every GRPO step to update.

What it does: `SCRIPTED` is a one-turn task whose reward alternates 1, 0, 1, 0, ... over the envs
of a process, whatever the reply (importable as "scripted_tasks:SCRIPTED" by a subprocess with
tests/ on sys.path). `ADDITION_WITH_SIGNAL` is the addition task (same prompts, same max_new_tokens)
scored per group by position instead of by the answer: member i of a group earns i % 2. Every
group of two or more finished members then has a nonzero spread, so no step is skipped for lack
of signal (`update_skipped`) and each one publishes policy-step-N, whatever the model samples.
The reward depends only on the member's index, never on timing, so a redone or resumed step
earns exactly what the uninterrupted one did (test_server_faults compares them).

What it does not do: say anything about learning. A test of whether the reward rises uses the
real task (and the committed tiny model, so its numbers are the same on every machine).
"""
from __future__ import annotations

import itertools
from dataclasses import replace

from artsg_nb.tasks.episode import StepResult
from artsg_nb.tasks.registry import Task, get_task

_COUNTER = itertools.count()


class ScriptedEnv:
    def __init__(self, seed: int):
        self.reward = float(next(_COUNTER) % 2)

    def reset(self):
        return [{"role": "user", "content": "Say one word."}]

    def step(self, reply: str) -> StepResult:
        return StepResult(messages=[], reward=self.reward, done=True)


SCRIPTED = Task("scripted", "a reward that alternates 1, 0 whatever the reply", max_turns=1, max_new_tokens=4,
                factory=ScriptedEnv)


def alternating_reward(envs, trajectories) -> list[float]:
    """0, 1, 0, 1, ... over a group's finished members (a `Task.group_reward`)."""
    return [float(i % 2) for i in range(len(trajectories))]


ADDITION_WITH_SIGNAL = replace(get_task("addition"), name="addition-with-signal",
                               description="addition prompts, reward i % 2 for member i (scripted signal)",
                               group_reward=alternating_reward)
