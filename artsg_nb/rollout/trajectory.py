"""Trajectories: what a rollout hands the trainer, and the one definition of a valid one.

What it does: `Trajectory` (one episode's tokens, which of them the model produced, its logprobs,
reward and server counts), `TrajectoryGroup` (the G episodes of one env seed), `is_valid` /
`is_trainable` (used by the trainer and the history too), `require_rewards` (a step whose every
episode failed, or whose every played episode lacks a reward, stops with the cause named — the
task's env, the tokenizer, a timeout, or the server — and what to try) and `rollout_stats` (counts
and token totals).

What it does not do: play episodes or talk to a server (groups.py), build tensors (rl/trainer.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence


def is_valid(traj) -> bool:
    """What a valid trajectory is, the one definition: no error and a finite reward. Takes any
    object with `.error` and `.reward` (a rank process's copies, a test's stand-ins)."""
    return traj.error is None and traj.reward is not None and math.isfinite(traj.reward)


def is_trainable(traj) -> bool:
    """Valid, with at least one model token (completion mask 1) to train on."""
    return is_valid(traj) and sum(traj.completion_mask) > 0


class RolloutError(RuntimeError):
    """A rollout could not be played (recorded on the Trajectory, not raised to the caller)."""


class NoRewardError(RuntimeError):
    """Every episode of a step that played to the end has a `reward_error`: nothing to train on."""


class RolloutsFailedError(RuntimeError):
    """Every episode of a step failed (`Trajectory.error`); the message says where (env,
    tokenizer, a timeout, the server) from the first error."""


_FAILURE_HINTS = (
    ("TaskCodeTimeout", "the task's own code", "find where it waits, or raise RunConfig.reward_timeout_s"),
    ("EnvError", "the task's env", "call task.make_env(seed).reset() and .step(reply) by hand to see the traceback"),
    ("PromptTextError", "the prompt text", "fix the text the message names (the error says how)"),
    ("TokenizerError", "the tokenizer or its chat template",
     "render the opening messages with tokenizer.apply_chat_template(messages) by hand"),
)


@dataclass
class Trajectory:
    """One episode as the trainer sees it: tokens, which of them the model produced, the reward."""

    messages: list[dict]
    """The conversation: opening messages, then assistant replies (server text) and env messages."""
    token_ids: list[int]
    """prompt + (model tokens, env tokens)*, exactly as sent to and returned by the server."""
    completion_mask: list[int]
    """1 on model-generated tokens, 0 on prompt/env/turn-closing tokens; aligned with token_ids."""
    logprobs: list[float]
    """Server sampling logprobs (temperature-scaled) where mask == 1, 0.0 elsewhere."""
    reward: float | None = None
    """Final reward from the env; None when the episode failed."""
    error: str | None = None
    """Why the episode is unusable ("ExcType: message"); None for a valid episode."""
    turns: int = 0
    """Model turns played."""
    prompt_tokens: int = 0
    """Prompt tokens the server processed, summed over turns."""
    cached_tokens: int = 0
    """Prompt tokens served from the server's prefix cache, summed over turns."""
    truncated: bool = False
    """The length budget (max_seq_tokens) cut a reply or ended the episode early."""
    adapter: str | None = None
    """Adapter that generated the model tokens (None: base model)."""
    prompt_len: int = 0
    """Tokens before the first model token."""
    seed: int = 0
    """Env seed of the group."""
    finish_reasons: list[str] = field(default_factory=list)
    """Server finish reason per model turn: "stop" | "length" | "abort"."""
    reward_error: str | None = None
    """Why a played episode has no reward from its task's group scoring (`Task.group_reward`: a
    reward function raised, or returned None/NaN for it); such an episode is left out of the
    advantages like a failed one, but counted apart (history column `reward_errors`)."""
    turn_stats: list[dict] = field(default_factory=list)
    """Per model turn: {"prompt_tokens", "cached_tokens"} as the server reported them (the sums
    are `prompt_tokens` / `cached_tokens`); metrics.turn_hit_rates tabulates them."""
    reward_parts: dict[str, float | None] | None = None
    """Each reward function's own value for this episode, by function name, before weighting (a
    dataset task's group scoring, tasks/dataset.py); None for tasks that pay one reward."""
    success: float | None = None
    """The task's success function's value for this episode (`Task.from_dataset(success=...)`),
    what evaluation's pass@k compares; None when the task names none (pass@k then reads reward)."""

    @property
    def valid(self) -> bool:
        """Usable for training: no error and a finite reward (`is_valid`)."""
        return is_valid(self)

    def model_segments(self) -> list[tuple[int, int]]:
        """(start, end) of each run of model tokens (mask 1) in `token_ids`, in order: model
        turn k's prompt is `token_ids[:start_k]`, its reply `token_ids[start_k:end_k]`."""
        runs, start = [], None
        for i, m in enumerate(self.completion_mask + [0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                runs.append((start, i))
                start = None
        return runs


@dataclass
class TrajectoryGroup:
    """The G episodes of one env seed; GRPO compares rewards within it."""

    seed: int
    """Env seed shared by the group."""
    trajectories: list[Trajectory]
    """All members, failed ones included (see Trajectory.valid)."""

    @property
    def valid(self) -> list[Trajectory]:
        return [t for t in self.trajectories if t.valid]


def require_rewards(groups: Sequence[TrajectoryGroup]) -> None:
    """Raise RolloutsFailedError when every episode failed, naming where from the first error;
    NoRewardError when every played episode lacks a reward (a task whose reward functions return
    None for everything, or always raise), naming the first reason."""
    trajs = [t for g in groups for t in g.trajectories]
    if trajs and all(t.error is not None for t in trajs):
        first = trajs[0].error
        where, hint = "the server's answers", "read the server log (server.log_tail())"
        for kind, name, what in _FAILURE_HINTS:
            if first.startswith(kind + ":"):
                where, hint = name, what
                break
        raise RolloutsFailedError(f"all {len(trajs)} rollouts of the step failed in {where}: {first}. Try: {hint}.")
    played = [t for t in trajs if t.error is None]
    if played and all(t.reward_error is not None for t in played):
        raise NoRewardError(
            f"none of the {len(played)} completions got a reward: {played[0].reward_error}. Try: check the task's "
            "reward functions on a few completions by hand (a TRL reward function returns None where it does not "
            "apply; at least one function must score each completion), and that they read columns the dataset has.")


def rollout_stats(groups: Sequence[TrajectoryGroup]) -> dict:
    """Counts and token totals of a batch of groups (for history rows and benchmarks)."""
    trajs = [t for g in groups for t in g.trajectories]
    prompt = sum(t.prompt_tokens for t in trajs)
    cached = sum(t.cached_tokens for t in trajs)
    return {"trajectories": len(trajs), "failed": sum(t.error is not None for t in trajs),
            "truncated": sum(t.truncated for t in trajs),
            "reward_errors": sum(t.reward_error is not None for t in trajs),
            "completion_tokens": sum(sum(t.completion_mask) for t in trajs),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else None}
