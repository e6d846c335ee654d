"""What one GRPO update measured, added up over micro-batches and over trainer ranks.

What it does: `StepStats` sums micro-batch losses, token-weights the loss's metrics (clip
fractions, KL...) and tracks the importance-sampling ratio's mean and extremes;
`StepStats.merged` adds up the parts several ranks computed of one batch
(distributed.ddp_train_step), so their row equals one process's. `is_ratio_stats` is one
micro-batch's raw ratio π_θ / π_server on model tokens, reported as `is_raw_ratio_mean/min/max`;
grpo's `is_ratio_mean/min/max` keep their meaning, the IS weight the loss applied (after
is_mode's truncation or mask; NaN, so absent, without IS correction). `batch_counts` a batch's sizes.

What it does not do: compute the loss (grpo.py) or run the update (trainer.py).
"""
from __future__ import annotations

import math

import torch

from .grpo import zero_advantage_groups


def is_ratio_stats(logps, sampling_logps, mask) -> tuple[float, float, float, int]:
    """Σ, min, max of the token-level ratio π_θ / π_server on model tokens (on-policy ≈ 1)."""
    sel = mask.bool() & torch.isfinite(sampling_logps)
    if not sel.any():
        return 0.0, math.inf, -math.inf, 0
    r = torch.exp(logps[sel] - sampling_logps[sel])
    return float(r.sum()), float(r.min()), float(r.max()), int(sel.sum())


def batch_counts(batch) -> dict:
    """A step's batch sizes for its history row (`batch`: a trainer.Batch)."""
    return {"sequences": batch.input_ids.shape[0], "tokens": int(batch.attention_mask.sum()),
            "completion_tokens": int(batch.completion_mask.sum().clamp(min=1)),
            "zero_adv_groups": zero_advantage_groups(batch.rewards, batch.group_ids)}


# grpo's per-micro-batch extremes of the IS weight: combined by min / max, not token-averaged.
_EXTREMES = {"is_ratio_min": min, "is_ratio_max": max}


class StepStats:
    """Sums micro-batch losses, token-weights metrics, and tracks IS ratio extremes; `merged`
    adds up the stats of several ranks' parts of one batch."""

    def __init__(self):
        self.loss, self.weight, self.metrics, self.extremes = 0.0, 0.0, {}, {}
        self.is_sum, self.is_n, self.is_min, self.is_max = 0.0, 0, math.inf, -math.inf

    def add(self, loss: float, metrics: dict, tokens: float, is_stats) -> None:
        self.loss += loss
        self.weight += tokens
        for k, v in metrics.items():
            if k in _EXTREMES and isinstance(v, (int, float)) and math.isfinite(v):
                self.extremes[k] = _EXTREMES[k](self.extremes.get(k, v), v)
            elif k != "tokens" and isinstance(v, (int, float)) and math.isfinite(v):
                self.metrics[k] = self.metrics.get(k, 0.0) + v * tokens
        s, lo, hi, n = is_stats
        self.is_sum, self.is_n = self.is_sum + s, self.is_n + n
        self.is_min, self.is_max = min(self.is_min, lo), max(self.is_max, hi)

    @classmethod
    def merged(cls, parts: list["StepStats"]) -> "StepStats":
        out = cls()
        for p in parts:
            out.loss, out.weight = out.loss + p.loss, out.weight + p.weight
            for k, v in p.metrics.items():
                out.metrics[k] = out.metrics.get(k, 0.0) + v
            for k, v in p.extremes.items():
                out.extremes[k] = _EXTREMES[k](out.extremes.get(k, v), v)
            out.is_sum, out.is_n = out.is_sum + p.is_sum, out.is_n + p.is_n
            out.is_min, out.is_max = min(out.is_min, p.is_min), max(out.is_max, p.is_max)
        return out

    def to_dict(self) -> dict:
        """JSON-able (ranks exchange stats as JSON, distributed.all_gather_json; ±inf is allowed)."""
        return {"loss": self.loss, "weight": self.weight, "metrics": self.metrics, "extremes": self.extremes,
                "is_sum": self.is_sum,
                "is_n": self.is_n, "is_min": self.is_min, "is_max": self.is_max}

    @classmethod
    def from_dict(cls, d: dict) -> "StepStats":
        out = cls()
        out.loss, out.weight = float(d["loss"]), float(d["weight"])
        out.metrics = {k: float(v) for k, v in d["metrics"].items()}
        out.extremes = {k: float(v) for k, v in d["extremes"].items()}
        out.is_sum, out.is_n = float(d["is_sum"]), int(d["is_n"])
        out.is_min, out.is_max = float(d["is_min"]), float(d["is_max"])
        return out

    def result(self) -> dict:
        w = max(self.weight, 1.0)
        out = {"loss": self.loss, **{k: v / w for k, v in self.metrics.items()}, **self.extremes}
        if self.is_n:  # the raw ratio under its own names: grpo's is_ratio_* are the weights applied
            out.update(is_raw_ratio_mean=self.is_sum / self.is_n, is_raw_ratio_min=self.is_min,
                       is_raw_ratio_max=self.is_max)
        return out
