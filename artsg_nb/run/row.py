"""One step's history row, typed: the one schema of a row and how a step's results fill it in.

What it does: `StepRow` is the row (docs/internals.md, "History columns"), its optional groups
(`MemoryFields`, `PipelineFields`, `EvalFields`, `FleetFields`, the task-named `RewardFields`) in
their places; `COLUMNS` is it flattened, in row order, and `TEXT_COLUMNS` those left as they are in
a DataFrame. `step_row(...)` builds a step's row from its trajectory groups, the trainer's metrics
and the step's seconds; its reward statistics are float64, NaN (stored as null) when not finite,
never an overflow that loses the row (`reward_stats`).

What it does not do: keep or write rows (run/history.py), compute the trainer's metrics (rl/) or
the hit rates (serving/metrics.py).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, fields

import numpy as np

from ..rollout.trajectory import is_valid
from ..serving.metrics import reachable_hit_rate, theoretical_hit_rate

logger = logging.getLogger(__name__)


# ---- the step row: the one schema (docs/internals.md, "History columns") ---------------------------
@dataclass
class MemoryFields:
    """Seconds to give the server's GPU memory back before training and take it again after;
    None (NaN in .df) when the run does not release (RunConfig.release_memory). Always in a row."""

    release_s: float | None = None
    resume_s: float | None = None


@dataclass
class PipelineFields:
    """A pipelined step's columns (RunConfig.pipeline; absent from a synchronous row)."""

    staleness: int
    """0: the rollouts were sampled under the adapter the update started from; 1: one version
    older, sampled ahead during the previous update."""
    ahead_wait_s: float | None = None
    """How long the update, once done, waited for the next step's rollouts (None without them)."""
    reload_wait_s: float | None = None
    """How long the step waited for its reload once both its update and the rollouts ahead had
    ended (None on a step that skipped its update)."""


@dataclass
class EvalFields:
    """The held-out evaluation after this step (evaluate.py; RunConfig.eval_every)."""

    eval_reward: float | None
    eval_pass_at_k: float | None


@dataclass
class FleetFields:
    """A fleet's per-worker figures since the last step's scrape (serving.fleet.worker_stats)."""

    worker_hit_rates: list
    worker_prompt_tokens: list


@dataclass
class RewardFields:
    """Each reward function's part of the reward, over the step's completions, as TRL logs it
    (`rewards/<fn>/mean`, `rewards/<fn>/std`): a dataset task's functions before weighting
    (Trajectory.reward_parts), None values left out (TRL's nanmean). Its columns are named by the
    task's functions, so they are not in COLUMNS; .df puts them after those."""

    means: dict[str, float | None]
    """Function name -> mean of its values (None when it gave none)."""
    stds: dict[str, float | None]
    """Function name -> sample standard deviation of its values (None when it gave none)."""

    def columns(self) -> dict[str, float | None]:
        """The row's keys: `rewards/<fn>/mean` and `rewards/<fn>/std` per function."""
        return {f"rewards/{name}/{what}": value for name in self.means
                for what, value in (("mean", self.means[name]), ("std", self.stds.get(name)))}


def reward_fields(groups) -> RewardFields | None:
    """Per-function means and stds of the parts on `groups`' played trajectories; None when no
    trajectory carries parts (tasks that pay one reward)."""
    parts = [t.reward_parts for g in groups for t in g.trajectories
             if t.error is None and getattr(t, "reward_parts", None)]
    if not parts:
        return None
    names = list(dict.fromkeys(name for p in parts for name in p))
    means, stds = {}, {}
    for name in names:
        values = [p[name] for p in parts if p.get(name) is not None]
        mean = sum(values) / len(values) if values else None
        means[name] = mean
        stds[name] = ((sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)) ** 0.5
                      if values else None)
    return RewardFields(means, stds)


@dataclass
class StepRow:
    """One step's history row, typed: what `step_row` fills in and `History.append` writes (as
    `as_dict()`: these keys in this order, a group's in its place; an absent optional group
    (pipeline, eval, fleet) and an absent trainer_ranks are left out of the row)."""

    step: int
    adapter: str | None
    """The adapter version the step trained (served after it, or left to the next step of run())."""
    reward_mean: float
    """Mean reward of the step's valid trajectories (NaN when none)."""
    reward_std: float
    loss: float | None
    kl: float | None
    clip_frac: float | None
    is_ratio_mean: float | None
    """The importance-sampling weight the loss applied (grpo.policy_loss, after is_mode's cap,
    e.g. <= is_clip_max = 3), None without IS."""
    is_ratio_min: float | None
    is_ratio_max: float | None
    is_raw_ratio_mean: float | None
    """The raw ratio π_θ / π_server on model tokens (on-policy ≈ 1; a pipelined step's max can be
    far above the cap)."""
    is_raw_ratio_min: float | None
    is_raw_ratio_max: float | None
    grad_norm: float | None
    tokens: int | None
    completion_tokens: int | None
    rollout_s: float | None
    train_s: float | None
    reload_s: float | None
    hit_rate: float | None
    """Share of the step's prompt tokens served from the prefix cache, from the server's own count
    per sampling request (serving/metrics.py)."""
    hit_rate_reachable: float | None
    """What the step's submission path can reach (metrics.reachable_hit_rate)."""
    hit_rate_shared: float | None
    """What the cache could serve on top of that, across groups (a shared template or prefix)."""
    hit_rate_path: str | None
    """How the step's prompts were submitted ("warm-up first", "prefilled together", ...)."""
    theoretical_hit_rate: float | None
    """The older within-batch bound: every copy after the first of an identical prompt."""
    memory: MemoryFields
    zero_adv_groups: int | None
    groups: int
    update_skipped: bool
    failed_rollouts: int
    samples: int
    reward_errors: int
    truncated: int
    restarts: int
    probe_mad: float | None
    probe_moved: float | None
    trainer_ranks: int | None
    """Trainer processes; only in the row of a run with trainer_ranks > 1."""
    time: float
    pipeline: PipelineFields | None = None
    eval: EvalFields | None = None
    fleet: FleetFields | None = None
    rewards: RewardFields | None = None
    """Per reward function columns (`rewards/<fn>/mean|std`), dataset tasks only."""

    def as_dict(self) -> dict:
        row = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in NAMED_BY_TASK:
                row.update(value.columns() if value else {})
            elif f.name in GROUPS:
                row.update({g.name: getattr(value, g.name) for g in fields(GROUPS[f.name])} if value else {})
            elif value is not None or f.name != "trainer_ranks":
                row[f.name] = value
        return row


GROUPS = {"memory": MemoryFields, "pipeline": PipelineFields, "eval": EvalFields, "fleet": FleetFields}
"""StepRow's groups: fields whose columns are their dataclass's fields."""
NAMED_BY_TASK = {"rewards": RewardFields}
"""StepRow's groups whose columns the task names (`columns()`): not in COLUMNS."""

COLUMNS: tuple[str, ...] = tuple(
    name for f in fields(StepRow) if f.name not in NAMED_BY_TASK
    for name in ([g.name for g in fields(GROUPS[f.name])] if f.name in GROUPS else [f.name]))
"""Every column a step row may have, in row order (StepRow flattened). Rows may carry extra keys
(a hand-made row, an older version's); .df puts them after these."""

TEXT_COLUMNS = frozenset(
    f.name for cls in (StepRow, *GROUPS.values()) for f in fields(cls)
    if f.name not in GROUPS and ("str" in str(f.type) or "list" in str(f.type)))
"""Columns .df leaves as they are (names, per-worker lists); the others become floats."""


def reward_stats(step: int, rewards: list) -> tuple[float, float]:
    """(mean, sample std) of a step's rewards in float64, NaN when there are none. A statistic
    that is not finite (a huge reward overflows its square) is NaN, stored as null, with a
    warning: never an OverflowError that would lose the step's row."""
    if not rewards:
        return float("nan"), float("nan")
    with np.errstate(over="ignore", invalid="ignore"):
        try:
            r = np.asarray(rewards, dtype=np.float64)
        except OverflowError:  # an int beyond float64
            r = np.full(len(rewards), np.inf)
        mean = float(np.mean(r))
        std = float(np.sqrt(np.sum(np.square(r - mean)) / max(len(r) - 1, 1)))
    bad = [name for name, v in (("reward_mean", mean), ("reward_std", std)) if not math.isfinite(v)]
    if bad:
        logger.warning("step %d: %s not finite (rewards from %g to %g overflow float64); recorded as null",
                       step, " and ".join(bad), float(np.min(r)), float(np.max(r)))
    return (mean if math.isfinite(mean) else float("nan")), (std if math.isfinite(std) else float("nan"))


def step_row(step: int, adapter: str | None, groups, metrics: dict, *, hit_rate: float | None = None,
             rollout_s: float | None = None, train_s: float | None = None, reload_s: float | None = None,
             probe: dict | None = None, memory: MemoryFields | None = None, restarts: int = 0,
             pipeline: PipelineFields | None = None, eval: EvalFields | None = None,
             fleet: FleetFields | None = None, kv_tokens: int | None = None,
             in_flight: int | None = None) -> StepRow:
    """One step's row: rewards of its trajectory groups, the trainer's metrics, its hit rate and
    seconds, the served-adapter probe, the memory released around the update, restarts, and the
    optional groups."""
    trajs = [t for g in groups for t in g.trajectories]
    mean, std = reward_stats(step, [t.reward for t in trajs if is_valid(t)])
    reach = reachable_hit_rate(groups, kv_tokens, in_flight)  # kv_tokens: the server's KV cache, when known
    m, probe = metrics.get, probe or {}
    return StepRow(
        step=step, adapter=adapter, reward_mean=mean, reward_std=std,
        loss=m("loss"), kl=m("kl"), clip_frac=m("clip_frac"),
        is_ratio_mean=m("is_ratio_mean"), is_ratio_min=m("is_ratio_min"), is_ratio_max=m("is_ratio_max"),
        is_raw_ratio_mean=m("is_raw_ratio_mean"), is_raw_ratio_min=m("is_raw_ratio_min"),
        is_raw_ratio_max=m("is_raw_ratio_max"), grad_norm=m("grad_norm"),
        tokens=m("tokens"), completion_tokens=m("completion_tokens"),
        rollout_s=rollout_s, train_s=train_s, reload_s=reload_s, hit_rate=hit_rate,
        hit_rate_reachable=reach.rate, hit_rate_shared=reach.shared if reach.rate is not None else None,
        hit_rate_path=reach.path if reach.rate is not None else None,
        theoretical_hit_rate=theoretical_hit_rate(groups), memory=memory or MemoryFields(),
        zero_adv_groups=m("zero_adv_groups"), groups=len(groups), update_skipped=bool(m("update_skipped")),
        failed_rollouts=sum(t.error is not None for t in trajs), samples=len(trajs),
        reward_errors=sum(t.reward_error is not None for t in trajs),
        truncated=sum(bool(t.truncated) for t in trajs), restarts=restarts,
        probe_mad=probe.get("probe_mad"), probe_moved=probe.get("probe_moved"),
        trainer_ranks=m("ranks"), time=time.time(), pipeline=pipeline, eval=eval, fleet=fleet,
        rewards=reward_fields(groups))
