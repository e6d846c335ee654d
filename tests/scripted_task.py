"""A task whose reward the test controls, not the model: for tests that need a GRPO signal but
must not depend on what the tiny model samples (issue 23).

`SCRIPTED`: one user turn, one reply of at most 4 tokens; the reward alternates 1, 0, 1, 0, ...
over the envs of a process (so every group of 2 or more has a non-zero advantage), whatever the
reply says. Importable as "scripted_task:SCRIPTED" by a subprocess with tests/ on sys.path.
"""
from __future__ import annotations

import itertools

from artsg_nb.episode import StepResult
from artsg_nb.tasks import Task

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
