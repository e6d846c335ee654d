"""Token-level losses on whole sequences (Tinker's `Datum`): cross-entropy and importance sampling.

What it does: a `Datum` is one sequence with what its loss needs, aligned as Tinker aligns it:
position i of `input_tokens` predicts `target_tokens[i]` (the full sequence shifted by one), with
per-token `weights` (cross_entropy) or the sampler's `logprobs` and per-token `advantages`
(importance_sampling). `token_loss_backward` scores the targets with the experiment's trainer (its
micro-batching by token budget, its logprob scoring at the GRPO temperature) and accumulates the
gradients of the *summed* loss, Tinker's definitions:

    cross_entropy        L = -Σ_t w_t · log p_θ(x_t)
    importance_sampling  L = -Σ_t exp(log p_θ(x_t) - log q(x_t)) · A_t

What it does not do: GRPO (rl/grpo.py, through rl.trainer.Trainer), the optimizer step, or choose
the adapter (trainer.py's MultiTrainer does, before calling here).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..rl.trainer import _micro_batches

LOSS_FNS = ("grpo", "importance_sampling", "cross_entropy")
"""The losses MultiTrainer.forward_backward takes."""
_NEEDS = {"cross_entropy": ("weights",), "importance_sampling": ("logprobs", "advantages")}


@dataclass
class Datum:
    """One sequence for a token loss: `input_tokens[i]` predicts `target_tokens[i]`."""

    input_tokens: list[int]
    """The model's input (the full sequence less its last token)."""
    target_tokens: list[int]
    """The token to predict at each input position (the full sequence less its first)."""
    weights: list[float] | None = None
    """cross_entropy: each target's weight (0 on the prompt, 1 on the completion)."""
    logprobs: list[float] | None = None
    """importance_sampling: the sampler's logprob of each target (q)."""
    advantages: list[float] | None = None
    """importance_sampling: each target's advantage (0 on the prompt)."""

    def check(self, loss_fn: str, index: int) -> None:
        """Raise ValueError naming the datum unless it is aligned and has what `loss_fn` needs."""
        n = len(self.input_tokens)
        if n == 0 or len(self.target_tokens) != n:
            raise ValueError(f"datum {index}: {n} input tokens and {len(self.target_tokens)} targets; a datum needs "
                             "as many targets as inputs (input = sequence[:-1], target = sequence[1:])")
        if list(self.target_tokens[:-1]) != list(self.input_tokens[1:]):
            raise ValueError(f"datum {index}: target_tokens must be input_tokens shifted by one (input = "
                             "sequence[:-1], target = sequence[1:]); other targets are not supported")
        for field in _NEEDS[loss_fn]:
            values = getattr(self, field)
            if values is None or len(values) != n:
                raise ValueError(f"datum {index}: loss_fn={loss_fn!r} needs {field} of length {n}, got "
                                 f"{'none' if values is None else len(values)}")

    def sequence(self) -> list[int]:
        return [*self.input_tokens, self.target_tokens[-1]]


def token_loss(logps: torch.Tensor, weights: torch.Tensor, sampling: torch.Tensor, advantages: torch.Tensor,
               loss_fn: str) -> torch.Tensor:
    """The summed loss of (b, n) target logprobs (0 on padding, where weights and advantages are 0)."""
    if loss_fn == "cross_entropy":
        return -(logps * weights).sum()
    ratio = torch.exp(logps - sampling)  # p_θ / q per token; padding: exp(0 - 0) · 0
    return -(ratio * advantages).sum()


def token_loss_backward(trainer, data: list[Datum], loss_fn: str, budget: int) -> dict:
    """Forward and backward of `loss_fn` over `data` in micro-batches of `budget` tokens on
    `trainer` (rl.trainer.Trainer, its adapter active); the summed loss, each datum's target
    logprobs, and counts."""
    for i, d in enumerate(data):
        d.check(loss_fn, i)
    trainer.model.train()
    total, logprobs = 0.0, [None] * len(data)
    for idx in _micro_batches([len(d.input_tokens) + 1 for d in data], budget):
        part = [data[i] for i in idx]
        ids, mask, weights, sampling, advantages = (t.to(trainer.device) for t in _tensors(part))
        logps = trainer.score(ids, mask)  # (b, L-1): log p_θ of each target, 0 past each sequence's end
        loss = token_loss(logps, weights, sampling, advantages, loss_fn)
        loss.backward()
        total += loss.item()
        for row, i in enumerate(idx):
            logprobs[i] = logps[row, :len(data[i].target_tokens)].detach().float().tolist()
    return {"loss": total, "logprobs": logprobs, "sequences": len(data),
            "tokens": sum(len(d.input_tokens) + 1 for d in data)}


def _tensors(part: list[Datum]) -> tuple[torch.Tensor, ...]:
    """(ids, attention mask) (b, L) and (weights, sampling logprobs, advantages) (b, L-1), right-padded."""
    length = max(len(d.input_tokens) + 1 for d in part)
    ids = torch.zeros((len(part), length), dtype=torch.long)
    mask = torch.zeros((len(part), length), dtype=torch.long)
    per_token = torch.zeros((3, len(part), length - 1), dtype=torch.float32)
    for row, d in enumerate(part):
        n = len(d.input_tokens)
        ids[row, :n + 1] = torch.tensor(d.sequence())
        mask[row, :n + 1] = 1
        for k, values in enumerate((d.weights, d.logprobs, d.advantages)):
            if values is not None:
                per_token[k, row, :n] = torch.tensor([float(v) for v in values])
    return ids, mask, per_token[0], per_token[1], per_token[2]
