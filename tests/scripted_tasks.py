"""Tasks whose reward signal the test controls, for tests that need every GRPO step to update.

What it does: `ADDITION_WITH_SIGNAL` is the addition task (same prompts, same max_new_tokens)
scored per group by position instead of by the answer: member i of a group earns i % 2. Every
group of two or more finished members then has a nonzero spread, so no step is skipped for lack
of signal (`update_skipped`) and each one publishes policy-step-N, whatever the model samples.
The reward depends only on the member's index, never on timing, so a redone or resumed step
earns exactly what the uninterrupted one did (test_server_faults compares them).

What it does not do: say anything about learning. A test of whether the reward rises uses the
real task (and the committed tiny model, so its numbers are the same on every machine).
"""
from __future__ import annotations

from dataclasses import replace

from artsg_nb.tasks import get_task


def alternating_reward(envs, trajectories) -> list[float]:
    """0, 1, 0, 1, ... over a group's finished members (a `Task.group_reward`)."""
    return [float(i % 2) for i in range(len(trajectories))]


ADDITION_WITH_SIGNAL = replace(get_task("addition"), name="addition-with-signal",
                               description="addition prompts, reward i % 2 for member i (scripted signal)",
                               group_reward=alternating_reward)
