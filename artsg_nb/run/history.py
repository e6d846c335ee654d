"""One row of training metrics per GRPO step, kept in memory and on disk.

`History` is what the training loop appends to and what the plots and the progress line read.
Every row is also written as one JSON line to `<run_dir>/history.jsonl`, whole or not at all (a
write that fails, e.g. ENOSPC, is cut back off the file), so a crashed kernel loses at most the step
it was in; `History.load(run_dir)` resumes from that file, drops a last line cut off mid-write and
refuses a damaged line before the last, naming it. A row's reward statistics are float64 and
recorded as null when not finite, never an overflow that loses the row.

It does not compute metrics (the training step does) and does not draw anything (see plots.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..files import write_atomic
from ..rollout.trajectory import is_valid
from ..serving.metrics import reachable_hit_rate, reachable_text, theoretical_hit_rate

logger = logging.getLogger(__name__)

HISTORY_FILE = "history.jsonl"


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



class History:
    """Per-step metrics of one run, mirrored to `<run_dir>/history.jsonl`.

    `History(run_dir)` starts an empty history; if that directory already holds a non-empty
    history file it is moved aside (`history.<timestamp>.jsonl`, logged) rather than mixed with
    the new run. To continue a run use `History.load(run_dir)`.
    """

    COLUMNS = COLUMNS

    def __init__(self, run_dir: str | Path, rows: list[dict] | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / HISTORY_FILE
        self._rows: list[dict] = list(rows or [])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if rows is None:
            _move_aside_if_present(self.path)

    @classmethod
    def load(cls, run_dir: str | Path) -> History:
        """Resume from `<run_dir>/history.jsonl` (an absent file gives an empty history).

        A last line cut off by a crash is dropped and trimmed from the file, so the next
        `append` starts on a clean line.
        """
        path = Path(run_dir) / HISTORY_FILE
        rows = _read_rows(path) if path.exists() else []
        return cls(run_dir, rows=rows)

    def append(self, row: dict[str, Any]) -> dict:
        """Add one step's row (missing `step` = previous step + 1) and write it to disk now."""
        row = {key: _plain(value) for key, value in row.items()}
        if row.get("step") is None:
            row["step"] = self._rows[-1]["step"] + 1 if self._rows else 0
        row = {"step": row.pop("step"), **row}
        _append_whole_line(self.path, (json.dumps(row, allow_nan=False) + "\n").encode("utf-8"))
        self._rows.append(row)
        return row

    def truncate(self, last_step: int) -> int:
        """Drop rows after `last_step` (resuming from an earlier checkpoint); returns how many.

        The file is rewritten to match, atomically (a temporary file, then a rename).
        """
        kept = [row for row in self._rows if row["step"] <= last_step]
        dropped = len(self._rows) - len(kept)
        if dropped:
            write_atomic(self.path, "".join(json.dumps(row) + "\n" for row in kept))
            logger.info("%s: dropped %d row(s) after step %d", self.path, dropped, last_step)
        self._rows = kept
        return dropped

    @property
    def df(self) -> pd.DataFrame:
        """One row per step with StepRow's columns first; absent values are NaN."""
        extra = [k for row in self._rows for k in row if k not in COLUMNS]  # rows of older versions, hand-made rows
        columns = list(COLUMNS) + list(dict.fromkeys(extra))
        df = pd.DataFrame(self._rows, columns=columns)
        for column in COLUMNS:
            if column not in TEXT_COLUMNS:  # None -> NaN, bools -> 0/1, so plots get floats
                df[column] = pd.to_numeric(df[column], errors="coerce").astype(float)
        df["step"] = df["step"].astype("int64")  # append() always sets it
        return df

    @property
    def rows(self) -> list[dict]:
        """The rows so far, oldest first (a new list; the rows themselves are not copied)."""
        return list(self._rows)

    @property
    def last(self) -> dict | None:
        """The most recent row, or None before the first step."""
        return dict(self._rows[-1]) if self._rows else None

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"History({str(self.run_dir)!r}, steps={len(self)})"

    @staticmethod
    def format_row(row: dict[str, Any]) -> str:
        """One progress line, e.g. `step 12 | reward 0.41 ± 0.10 | loss 0.012 | hit 0.86 | ...`.

        Fields that are absent or NaN are left out; failed rollouts appear only when non-zero.
        """
        parts = [f"step {row.get('step', '?')}"]
        reward, reward_std = row.get("reward_mean"), row.get("reward_std")
        if _present(reward):
            spread = f" ± {reward_std:.2f}" if _present(reward_std) else ""
            parts.append(f"reward {reward:.2f}{spread}")
        if _present(row.get("loss")):
            parts.append(f"loss {row['loss']:.3g}")
        if _present(row.get("hit_rate")):
            parts.append(f"hit {row['hit_rate']:.2f}" + reachable_text(
                row.get("hit_rate_reachable"), row.get("hit_rate_path"), row.get("hit_rate_shared")))
        for key in ("rollout_s", "release_s", "train_s", "resume_s", "reload_s"):
            if _present(row.get(key)):
                parts.append(f"{key[:-2]} {_format_seconds(row[key])}")
        if _present(row.get("failed_rollouts")) and row["failed_rollouts"] > 0:
            parts.append(f"failed {int(row['failed_rollouts'])}")
        if _present(row.get("zero_adv_groups")) and row["zero_adv_groups"] > 0:
            of = f"/{int(row['groups'])}" if _present(row.get("groups")) else ""
            parts.append(f"zero-adv {int(row['zero_adv_groups'])}{of}")
        if row.get("update_skipped"):
            parts.append("no update (no signal)")
        if _present(row.get("eval_reward")):
            parts.append(f"eval {row['eval_reward']:.2f}")
            if _present(row.get("eval_pass_at_k")):
                parts[-1] += f" pass {row['eval_pass_at_k']:.2f}"
        if _present(row.get("reward_errors")) and row["reward_errors"] > 0:
            parts.append(f"no reward {int(row['reward_errors'])}")
        return " | ".join(parts)


def _append_whole_line(path: Path, line: bytes) -> None:
    """Append `line` whole or not at all: unbuffered writes (a short write is continued), and on
    any failure (ENOSPC, an interrupt) the file is cut back to its size before, so a retry never
    leaves a torn line in the middle of the file."""
    with open(path, "ab", buffering=0) as f:
        size = f.seek(0, os.SEEK_END)
        try:
            written = 0
            while written < len(line):
                written += f.write(line[written:])
        except BaseException:
            try:
                os.ftruncate(f.fileno(), size)
            except OSError as e:  # the load drops a torn last line; say why it may find one
                logger.error("%s: could not cut a partly written row back (%s)", path, e)
            raise


def _read_rows(path: Path) -> list[dict]:
    """Parse a history file; drop (and trim from the file) a torn last line (a write cut short by
    a crash); a line that cannot be read before the last is refused, naming it."""
    data = path.read_bytes()
    rows: list[dict] = []
    good_bytes = 0
    for line in data.splitlines(keepends=True):
        try:
            rows.append(json.loads(line))
        except ValueError:  # JSONDecodeError, or a UTF-8 sequence cut in two
            if good_bytes + len(line) < len(data):
                raise ValueError(f"{path}: unreadable line {len(rows) + 1} in the middle of the "
                                 f"file: {line[:80]!r}. Only a last line can be torn by a crash: this one was "
                                 "changed or damaged. Fix or remove that line, then load again.") from None
            logger.warning("%s: dropping a truncated last line (%d bytes)", path, len(line))
            with open(path, "r+b") as f:
                f.truncate(good_bytes)
            break
        good_bytes += len(line)
    if rows and not data[:good_bytes].endswith(b"\n"):
        with open(path, "ab") as f:  # a complete last row without its newline
            f.write(b"\n")
    return rows


def _move_aside_if_present(path: Path) -> None:
    """Keep an earlier run's history instead of appending a new run to it."""
    if path.exists() and path.stat().st_size > 0:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = path.with_name(f"history.{stamp}.jsonl")
        n = 1
        while aside.exists():  # two runs started within one second
            aside, n = path.with_name(f"history.{stamp}-{n}.jsonl"), n + 1
        path.rename(aside)
        logger.warning("%s held an earlier run; moved it to %s (use History.load to resume)",
                       path, aside.name)


def _plain(value: Any) -> Any:
    """A JSON-safe scalar: numpy/torch scalars unwrapped, NaN and inf stored as null."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _present(value: Any) -> bool:
    return isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value))


def _format_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 1 else f"{seconds:.1f} s"




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
