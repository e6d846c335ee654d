"""`addition_chat`: the addition task's questions for chat models that explain before they answer.

What it does: `AdditionChatEnv` asks registry.AdditionEnv's question ("What is 3 + 4?") and reads
the reply's last number as its answer ("3 + 4 = 7." -> 7), as GSM8K-style checkers read one,
once the question's two operands are set aside where the reply restates them ("3 + 4 =", cut off
there, has no answer: its 4 is an operand, not a guess), scored by `addition_reward` (1.0 right,
partial credit for a near miss). SmolLM2-135M-Instruct almost never replies with a bare number,
so `addition` pays it nothing and GRPO gets no signal; here about half its groups have one within
8 new tokens. The step benchmark's job. `ADDITION_CHAT` is registered with the built-in tasks when
`artsg_nb.tasks` is imported.

What it does not do: enter the tiny model's pretraining (no teacher). It lives outside
registry.py on purpose: the tiny model's build recipe hashes that file (models/tiny.py), and this
task changes nothing the tiny model learns.
"""
from __future__ import annotations

import re

from .episode import StepResult
from .registry import ADDITION_MAX_OPERAND, AdditionEnv, Task, addition_reward

_NUMBER = re.compile(r"(?<![0-9])[0-9]{1,9}(?![0-9])")  # ASCII digits; 9 of them bound int()


def addition_chat_reward(reply: str, a: int, b: int) -> float:
    """`addition_reward` of the reply's answer to "a + b" (`reply_answer`); 0.0 without one."""
    answer = reply_answer(reply, a, b)
    return addition_reward(str(answer), a + b) if answer is not None else 0.0


def reply_answer(reply: str, a: int, b: int) -> int | None:
    """The reply's last number once every restatement of the question's operands is set aside.

    "3 + 4 = 7." -> 7; "7, as 3 + 4 makes" -> 7; "The sum of 3 and 4 is" -> None (cut off before an
    answer: crediting its 4 would pay a model for echoing the question); "3 + 4 = 3 + 4" -> None.
    The operands go only as neighbouring numbers, in either order, so "4" answers "0 + 4" and
    "0 + 4 = 4" keeps its second 4.
    """
    numbers = [int(n) for n in _NUMBER.findall(reply)] if isinstance(reply, str) else []
    kept, i = [], 0
    while i < len(numbers):
        if numbers[i:i + 2] in ([a, b], [b, a]):
            i += 2
        else:
            kept.append(numbers[i])
            i += 1
    return kept[-1] if kept else None


class AdditionChatEnv(AdditionEnv):
    """`AdditionEnv`'s question; the reply's last number is its answer (`addition_chat_reward`)."""

    def step(self, reply: str) -> StepResult:
        return StepResult(messages=[], reward=addition_chat_reward(reply, self.a, self.b), done=True)


ADDITION_CHAT = Task("addition_chat", f"single turn: add two numbers from 0..{ADDITION_MAX_OPERAND}, answer in "
                     "any words (the reply's last number counts)", max_turns=1, max_new_tokens=32,
                     factory=AdditionChatEnv)
