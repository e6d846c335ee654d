"""The card's floor under a GRPO step: how fast decoding and training could go at best, and how
close a measured step comes.

What it does: `CARDS` (HBM bandwidth and dense bf16 peak of the GPUs the benchmarks run on, from
the vendors' data sheets), `card_of(hardware)` (a CSV's `hardware` text → its card), `decode_floor_s`
and `train_floor_s` (the bounds for one step of a job), `job_floors` (both, from a model directory)
and `floor_shares(df)` (each step benchmark row's parts as shares of their floors).

The bounds:
  - decode: every decode step reads all the weights once (the whole step's samples decode in one
    batch), so `max_new_tokens` steps take at least max_new_tokens x weight bytes / HBM bandwidth.
    Completions that stop early make a real rollout shorter: the random-weight models never stop,
    SmolLM2's may. Prefill, the LoRA's reads and the KV cache's are left out (small at 16 x 8).
  - train: a frozen base costs 2 N FLOPs per token forward and 2 N backward (activation gradients,
    no weight gradients), the LoRA's P parameters 6 P; so (4 N + 6 P) x tokens / bf16 peak, with
    tokens the step's prompt + completion tokens (the CSV's tokens_per_step). The 6 N of a full
    fine-tune would be 1.5x this; the log-probs' forward for the loss is the same forward.
A share is floor / measured: 1.0 would be the card's limit, 0.25 a quarter of it.

What it does not do: measure the card (its figures are data-sheet peaks; a measured 8192^3 bf16
matmul reaches ~0.8 of them), or judge a result.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..serving.memory_estimate import ADAMW_BYTES_PER_PARAM, ModelMemory


@dataclass(frozen=True)
class Card:
    """A GPU's data-sheet limits."""

    name: str
    hbm_bytes_s: float
    """Memory bandwidth, bytes/s."""
    bf16_flops: float
    """Dense bf16 tensor-core peak, FLOP/s."""


CARDS = (  # the most specific name first: "H100 PCIe" before "H100"
    Card("H100 PCIe", 2.0e12, 756e12),
    Card("H100", 3.35e12, 989e12),  # SXM
    Card("H200", 4.8e12, 989e12),
)


def card_of(hardware: str) -> Card | None:
    """The card a `hardware` column names ("NVIDIA H100 80GB HBM3 x1"); None for a CPU or an unknown GPU."""
    text = str(hardware).upper()
    return next((c for c in CARDS if all(word in text for word in c.name.upper().split())), None)


def decode_floor_s(max_new_tokens: int, weight_bytes: float, card: Card) -> float:
    """Seconds to read the weights once per decode step."""
    return max_new_tokens * weight_bytes / card.hbm_bytes_s


def train_floor_s(tokens: float, params: float, lora_params: float, card: Card) -> float:
    """Seconds of (4 N + 6 P) FLOPs per token at the bf16 peak."""
    return tokens * (4 * params + 6 * lora_params) / card.bf16_flops


@dataclass(frozen=True)
class JobFloors:
    decode_s: float
    train_s: float


NAN_FLOORS = JobFloors(math.nan, math.nan)


def job_floors(model_dir: str | Path, hardware: str, max_new_tokens: int, tokens: float,
               lora_rank: int = 16) -> JobFloors:
    """Both floors for one step of a job on the card `hardware` names; NaN where the card or the
    model directory is unknown. Parameters are taken as bf16 (weight bytes / 2)."""
    card, model = card_of(hardware), ModelMemory.from_dir(model_dir, lora_rank)
    if card is None or model is None:
        return NAN_FLOORS
    lora_params = model.lora / ADAMW_BYTES_PER_PARAM
    return JobFloors(decode_floor_s(max_new_tokens, model.weights, card),
                     train_floor_s(tokens, model.weights / 2, lora_params, card) if not math.isnan(tokens) else math.nan)


def floor_shares(df: pd.DataFrame) -> pd.DataFrame:
    """Per step benchmark row: its rollout and train medians beside their floors, and floor / measured."""
    if df.empty or "decode_floor_s" not in df:
        return pd.DataFrame()
    out = df[["framework", "model", "max_new_tokens", "pipeline", "rollout_s_median", "decode_floor_s",
              "train_s_median", "train_floor_s", "step_s_median"]].copy()
    out["rollout_share"] = out["decode_floor_s"] / out["rollout_s_median"]
    out["train_share"] = out["train_floor_s"] / out["train_s_median"]
    out["step_share"] = (out["decode_floor_s"] + out["train_floor_s"]) / out["step_s_median"]
    return out
