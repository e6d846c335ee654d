"""How many experiments fit: the memory a sweep needs, checked before anything starts.

What it does: `sweep_fit(model_dir, experiments, rank, device_bytes, gpu)` estimates, from the
model directory (serving.memory_estimate.ModelMemory: nothing is loaded), what a sweep of N
experiments holds at once, and `SweepFit.check()` refuses one that does not fit with the numbers:

  shared (once)       the server's base weights (on a GPU: its memory share, at least weights + KV
                      headroom), the trainer's base weights, and the activations of its smallest
                      micro-batch (updates are time-shared: one experiment's at a time), plus
                      the CUDA launch reserve on a GPU
  per experiment      its LoRA's weights, gradients and two AdamW moments (fp32, 16 bytes a
                      parameter) in the trainer, and two versions of its adapter in the server
                      (the served one and the next, during a reload; fp32 on the CPU engine)

Against: the memory free now, on the GPU (nvidia-ml-py's reading) or on the CPU (psutil).

What it does not do: measure anything or read the GPU (serving.gpus does), or count a hub id's
model (no config.json to read: the sweep then starts without the check, and says so).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..serving.gpus import COLOCATED_MEM_FRACTION, LAUNCH_RESERVE_MIB
from ..serving.memory_estimate import (ADAMW_BYTES_PER_PARAM, GIB, KV_HEADROOM_TOKENS, MIN_MICRO_BATCH_TOKENS,
                                       ModelMemory)

SERVED_VERSIONS = 2
"""Adapter versions of one experiment the server may hold at once (the served one, the next while it loads)."""


class TooManyExperimentsError(RuntimeError):
    """A sweep's experiments do not fit the memory there is (message: the numbers and what to change)."""


@dataclass(frozen=True)
class SweepFit:
    """What a sweep of `experiments` needs, in GiB, against what there is."""

    experiments: int
    where: str
    """"GPU" or "CPU" (the memory counted against)."""
    available_gib: float
    weights_gib: float
    """One copy of the base weights."""
    shared_gib: float
    """Held once whatever the number of experiments (module docstring)."""
    per_experiment_gib: float
    """Each experiment's LoRA, its gradients and AdamW moments, and its versions in the server."""

    @property
    def needed_gib(self) -> float:
        return self.shared_gib + self.experiments * self.per_experiment_gib

    @property
    def most(self) -> int:
        """How many experiments fit (0 when not even the shared part does)."""
        room = self.available_gib - self.shared_gib
        return max(0, math.floor(room / self.per_experiment_gib)) if self.per_experiment_gib > 0 else 0

    def fits(self) -> bool:
        return self.needed_gib <= self.available_gib

    def describe(self) -> str:
        return (f"{self.experiments} experiments need {self.needed_gib:.2f} GiB of {self.where} memory: "
                f"{self.shared_gib:.2f} GiB once (server and trainer weights, {self.weights_gib:.2f} GiB each, KV "
                f"and activations) + {self.experiments} x {self.per_experiment_gib:.3f} GiB (each one's LoRA with "
                f"gradients and AdamW moments, and {SERVED_VERSIONS} served versions); {self.available_gib:.2f} GiB "
                f"free on the {self.where}")

    def check(self) -> "SweepFit":
        """Self when it fits, else TooManyExperimentsError with the numbers and what to try."""
        if self.fits():
            return self
        fix = (f"at most {self.most} experiments at this rank, a smaller LoRA rank, or a smaller model"
               if self.most > 0 else "a smaller model, or a machine with more memory")
        raise TooManyExperimentsError(f"refused before starting anything: {self.describe()}. Try: {fix}.")


def sweep_fit(model_dir: str | Path, experiments: int, rank: int, gpu_total_bytes: int | None = None,
              available_bytes: int | None = None, server_share: float = COLOCATED_MEM_FRACTION) -> SweepFit | None:
    """The estimate for `experiments` LoRAs of `rank` on the model at `model_dir`: on a GPU of
    `gpu_total_bytes` (server and trainer colocated, the server with `server_share` of it) against
    `available_bytes` of it free (default: all of it), else on the CPU against `available_bytes`
    (default: psutil's available memory now). None when `model_dir` is not a model directory (a hub id)."""
    model = ModelMemory.from_dir(model_dir, lora_rank=rank)
    if model is None:
        return None
    lora_params = model.lora / ADAMW_BYTES_PER_PARAM
    activations = model.activations_per_token * MIN_MICRO_BATCH_TOKENS
    if gpu_total_bytes is not None:
        server = max(server_share * gpu_total_bytes, model.weights + KV_HEADROOM_TOKENS * model.kv_per_token)
        shared = server + model.weights + activations + LAUNCH_RESERVE_MIB * 2**20
        per = model.lora + SERVED_VERSIONS * 2 * lora_params  # bf16 in SGLang's pool
        where, available = "GPU", available_bytes if available_bytes is not None else gpu_total_bytes
    else:
        shared = 2 * model.weights + activations  # the CPU engine's copy and the trainer's
        per = model.lora + SERVED_VERSIONS * 4 * lora_params
        where = "CPU"
        available = available_bytes if available_bytes is not None else psutil.virtual_memory().available
    return SweepFit(experiments, where, available / GIB, model.weights / GIB, shared / GIB, per / GIB)
