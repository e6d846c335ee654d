"""The benchmark's synthetic workload: P prompts x G samples x T turns of chosen lengths.

What it does: `SyntheticTask` duck-types tasks.Task for rollout.collect_groups. Its texts are
built from the model's tokenizer (random token ids decoded to text: meaningless, fine for
throughput). Each seed is one group (same seed, same texts); env turns add a fixed-length user
message; the reward is always 0.

What it does not do: play or time the episodes (bench.run, through rollout.collect_groups) or
replay them without the toolkit (bench.raw).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from ..tasks.registry import StepResult


def synthetic_text(tokenizer, n_tokens: int, rng: random.Random) -> str:
    """About `n_tokens` tokens of text: random non-special ids, decoded, re-cut to length."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
    ids = tokenizer.encode(tokenizer.decode(rng.choices(vocab, k=n_tokens)), add_special_tokens=False)
    return tokenizer.decode(ids[:n_tokens], skip_special_tokens=True)


class SyntheticEnv:
    """One episode: an opening prompt, then a fixed-length user turn after each reply."""

    def __init__(self, task: "SyntheticTask", seed: int):
        self.task, self.seed, self.turn = task, seed, 0

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.task.text(self.seed, 0)}]

    def step(self, reply: str) -> StepResult:
        self.turn += 1
        if self.turn >= self.task.max_turns:
            return StepResult([], 0.0, True)
        return StepResult([{"role": "user", "content": self.task.text(self.seed, self.turn)}], None, False)


@dataclass
class SyntheticTask:
    """Duck-types tasks.Task for collect_groups: same seed → same texts, so a group shares them."""

    tokenizer: Any
    prompt_tokens: int = 1500
    """Target length of the turn-1 prompt, chat template included."""
    max_turns: int = 1
    """Model turns per episode."""
    env_tokens: int = 32
    """Length of each later user message."""
    max_new_tokens: int = 128
    name: str = "synthetic"
    _cache: dict = field(default_factory=dict, repr=False)

    def make_env(self, seed: int) -> SyntheticEnv:
        return SyntheticEnv(self, seed)

    def text(self, seed: int, turn: int) -> str:
        if (seed, turn) not in self._cache:
            overhead = len(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": ""}], tokenize=True, return_dict=False, add_generation_prompt=True))
            n = max(1, self.prompt_tokens - overhead) if turn == 0 else self.env_tokens
            self._cache[seed, turn] = synthetic_text(self.tokenizer, n, random.Random(seed * 1000 + turn))
        return self._cache[seed, turn]
