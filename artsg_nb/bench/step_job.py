"""The step benchmark's job, shared by its two legs: configuration, prompts, and the result row.

What it does: `StepBenchConfig` (the CLI's fields), `job_prompts` (the addition task's prompts both
frameworks train on) and `leg_result` (one CSV row with exactly `COLUMNS`, warm-up steps left out of
the medians).

What it does not do: run a leg (step.py runs artsg_nb's and orchestrates; step_trl.py runs TRL's).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal

import torch
import tyro

from ..tasks.registry import AdditionEnv
from ..models.tiny import default_model_dir
from .run import hardware_name

COLUMNS = ["framework", "engine", "model", "max_new_tokens", "steps", "step_s_median", "rollout_s_median",
           "train_s_median", "reload_s_median", "tokens_per_step", "reward_first", "reward_last", "hardware",
           "date"]
"""The step benchmark's CSV columns, in order (plots.plot_step_benchmark reads them by name)."""
FRAMEWORKS = ("artsg_nb", "trl")


@dataclass
class StepBenchConfig:
    """One step benchmark: which frameworks, which job, how many steps."""

    frameworks: tuple[Literal["artsg_nb", "trl"], ...] = FRAMEWORKS
    """"artsg_nb" and/or "trl"."""
    engine: Literal["cpu", "sglang", "vllm"] = "cpu"
    """artsg_nb's server: "sglang", "vllm" or "cpu" (TRL generates in-process either way)."""
    model_path: str | None = None
    """Base model directory; None: the offline tiny model."""
    max_new_tokens: tuple[int, ...] = (8, 256)
    """One job per completion budget."""
    steps: int = 10
    """GRPO steps per leg, warm-up included."""
    warmup: int = 1
    """Leading steps left out of the medians (first-call compilation, caches); 0 keeps all."""
    groups: int = 16
    """Prompts per step."""
    group_size: int = 8
    """G, samples per prompt (TRL num_generations)."""
    learning_rate: float = 2e-4
    """Constant AdamW learning rate."""
    lora_rank: int = 16
    """LoRA r."""
    lora_alpha: int = 32
    """LoRA alpha."""
    seed: int = 0
    """Seeds prompts, sampling and LoRA initialisation."""
    schedule: str | None = None
    """artsg_nb's rollout schedule; None: RunConfig's default."""
    verify_adapter: bool = False
    """artsg_nb's served-adapter probe after each reload (a check, not part of GRPO: off)."""
    api_key: str | None = None
    """Sent to artsg_nb's server."""
    isolate: bool = True
    """Each leg in its own process (Unsloth patches transformers; GPU memory is given back).
    False runs them here, one after the other (fine on CPU: the tests do)."""
    run_dir: str = "runs/bench-step"
    """Scratch directory for run directories and TRL output."""
    out: str | None = None
    """CSV path; None: benchmarks/results/<date>-step-<hardware>.csv."""
    results_dir: str = "benchmarks/results"
    """Where the default CSV goes."""
    extra: tyro.conf.Suppress[dict] = field(default_factory=dict)
    """Not measured; kept for callers that want to tag a run."""


def job_prompts(cfg: StepBenchConfig, n: int) -> list[AdditionEnv]:
    return [AdditionEnv(cfg.seed * 1_000_003 + i) for i in range(n)]


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def leg_result(cfg: StepBenchConfig, framework: str, engine: str, max_new: int, step_s, rollout_s, train_s,
                reload_s, tokens, rewards) -> dict:
    keep = slice(cfg.warmup if len(step_s) > cfg.warmup else 0, None)
    return {"framework": framework, "engine": engine, "model": Path(cfg.model_path or default_model_dir()).name,
            "max_new_tokens": max_new, "steps": len(step_s), "step_s_median": _median(step_s[keep]),
            "rollout_s_median": _median(rollout_s[keep]), "train_s_median": _median(train_s[keep]),
            "reload_s_median": _median(reload_s[keep]), "tokens_per_step": _median(tokens[keep]),
            "reward_first": rewards[0] if rewards else float("nan"),
            "reward_last": rewards[-1] if rewards else float("nan"),
            "hardware": hardware_name(engine if framework == "artsg_nb" else ("gpu" if torch.cuda.is_available() else "cpu")),
            "date": datetime.now().strftime("%Y-%m-%d")}
