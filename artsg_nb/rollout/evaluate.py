"""Evaluation: the served adapter on prompts it is not trained on, as mean reward and pass@k.

What it does: `evaluate(...)` plays `n` prompts with `k` samples each (greedy: k = 1 at
temperature 0) under the adapter the server holds now, and returns a summary dict
(`eval_reward_mean`, `eval_reward_std`, `pass_at_k`, `k`, `n`, `failed`, `split`) and the samples
as a DataFrame (samples.py's columns). Which prompts (`eval_seeds`):
- a task that exposes splits (`task.split("eval")` returning a task-like object, as datasets do;
  duck-typed: any `split` method) is evaluated on that split's rows: seeds 0..n-1, n defaulting to
  the split's length when it has one;
- a task without splits (the generated demo tasks) is evaluated on env seeds from EVAL_SEED_BASE
  on; training draws its seeds below 2**30 (run.source.RolloutSource.seeds), so the two ranges are disjoint.
pass@k: the fraction of prompts where at least one of the k samples scores >= `success_reward`
(with greedy decoding, k = 1: the fraction answered correctly). The score is the task's success
function's value when it names one (`Task.from_dataset(success=...)`, on `Trajectory.success`),
else the reward, which for several reward functions is their weighted sum.

What it does not do: train, save, load or unload an adapter (evaluation only reads the served
one), or write the history (run/step.py puts `eval_reward` / `eval_pass_at_k` on the step's row).
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ..engines import SamplingParams
from ..tasks.task_code import DEFAULT_TIMEOUT_S
from .groups import collect_groups
from .samples import sample_records, samples_frame

EVAL_SEED_BASE = 1 << 30
"""First env seed of the held-out range for tasks without an eval split (training seeds are below)."""
EVAL_SAMPLING_SEED = 7_777_777
"""Sampling seed base of every evaluation: the same adapter gives the same samples each time."""


@dataclass
class EvalResult:
    """What `evaluate` returns: the summary (also what goes into the history) and the samples."""

    summary: dict
    """eval_reward_mean, eval_reward_std, pass_at_k, k, n, failed, split, adapter."""
    samples: pd.DataFrame
    """One row per trajectory (samples.SAMPLE_COLUMNS)."""


def eval_task_and_seeds(task, split: str, n: int | None, default_n: int) -> tuple[object, list[int]]:
    """The task to play and its seeds for `split` (see the module docstring)."""
    split_fn = getattr(task, "split", None)
    if callable(split_fn) and getattr(task, "source", None) is not None:  # a dataset task: held-out rows
        part = split_fn(split)
        size = _length(part)
        count = n if n is not None else (size if size is not None else default_n)
        if size is not None and count > size:
            raise ValueError(f"evaluate(n={count}) but the {split!r} split has {size} rows; ask for n <= {size}")
        return part, list(range(count))
    count = n if n is not None else default_n
    if split == "eval":
        return task, list(range(EVAL_SEED_BASE, EVAL_SEED_BASE + count))
    raise ValueError(f"task {getattr(task, 'name', task)!r} has no splits (not a dataset task), so only "
                     f"split='eval' (held-out seeds from {EVAL_SEED_BASE}) is defined; got split={split!r}")


async def evaluate(client, task, tokenizer, adapter: str | None, *, split: str = "eval", n: int | None = None,
                   k: int = 1, greedy: bool = True, temperature: float = 1.0, max_new_tokens: int | None = None,
                   max_seq_tokens: int = 2048, concurrency: int = 64, success_reward: float = 1.0,
                   default_n: int = 16, task_timeout_s: float | None = DEFAULT_TIMEOUT_S) -> EvalResult:
    """Play the eval prompts under `adapter` and summarise (module docstring). `greedy` samples at
    temperature 0, so k must be 1 (k greedy samples would be k copies of one)."""
    if greedy and k != 1:
        raise ValueError(f"greedy=True gives one answer per prompt; k={k} needs greedy=False (sampling)")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    played, seeds = eval_task_and_seeds(task, split, n, default_n)
    params = SamplingParams(max_new_tokens=max_new_tokens or played.max_new_tokens,
                            temperature=0.0 if greedy else temperature)
    groups = await collect_groups(client, played, tokenizer, seeds, k, params, adapter=adapter,
                                  concurrency=concurrency, schedule="naive" if k == 1 else "prefix",
                                  max_seq_tokens=max_seq_tokens, sampling_seed_base=EVAL_SAMPLING_SEED,
                                  task_timeout_s=task_timeout_s)
    by_success = getattr(getattr(played, "source", None), "success", None) is not None
    return EvalResult(summarise(groups, k, success_reward, split, adapter, by_success),
                      samples_frame(sample_records(groups)))


def summarise(groups, k: int, success_reward: float, split: str, adapter: str | None,
              by_success: bool = False) -> dict:
    """Mean/std reward over valid samples (failed ones are counted, not scored) and pass@k, which
    reads each trajectory's `success` value instead of its reward with `by_success`."""
    rewards = [t.reward for g in groups for t in g.trajectories if t.valid]
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    std = (sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1)) ** 0.5 if rewards else float("nan")
    solved = [any(_passed(t, success_reward, by_success) for t in g.trajectories) for g in groups]
    return {"eval_reward_mean": mean, "eval_reward_std": std,
            "pass_at_k": sum(solved) / len(solved) if solved else float("nan"), "k": k, "n": len(groups),
            "failed": sum(t.error is not None for g in groups for t in g.trajectories),
            "split": split, "adapter": adapter}


def _passed(traj, success_reward: float, by_success: bool) -> bool:
    """A valid trajectory whose score (success value or reward) reaches `success_reward`."""
    score = traj.success if by_success else traj.reward
    return traj.valid and score is not None and score >= success_reward


def history_fields(summary: dict) -> dict:
    """The eval columns of a history row (history.COLUMNS: eval_reward, eval_pass_at_k)."""
    return {"eval_reward": summary["eval_reward_mean"], "eval_pass_at_k": summary["pass_at_k"]}


def _length(part) -> int | None:
    """Rows of a split, or None when it does not say (no __len__)."""
    try:
        return len(part)
    except TypeError:
        return None

