"""The environment protocol a rollout drives: `Env.reset()` gives the opening messages,
`Env.step(reply)` the environment's answer as a `StepResult` (and, at the end, the reward).

What it does: names the types a task author implements. Either method may be `async def` (a
tool call can hit an API); rollout.py awaits what they return. Plain methods run on a worker thread,
one call at a time, under RunConfig.reward_timeout_s (tasks/task_code.py): one that needs the
event loop should be `async def`. What it does not do: define tasks
(registry.py, dataset.py) or play them (rollout/groups.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Protocol

Messages = list[dict]
"""Chat messages: {"role": "system" | "user" | "assistant" | "tool", "content": str}."""


@dataclass
class StepResult:
    """What the environment answers to one model reply."""

    messages: Messages
    """Next user/tool messages to append (empty when done)."""
    reward: float | None
    """Final reward when done, else None. A task with a group reward (`Task.group_reward`, e.g.
    a dataset task) leaves it None: the whole group is scored at once after its episodes end."""
    done: bool
    """True when the episode is over."""


class Env(Protocol):
    """One episode of a task. `reset` and `step` may also be coroutines (`async def`)."""

    def reset(self) -> Messages | Awaitable[Messages]: ...

    def step(self, reply: str) -> StepResult | Awaitable[StepResult]: ...
