"""Value checks on a run's history: are the numbers a user sees right, not only present?

What it does: `check_rows(rows, ...)` takes history rows (dicts, as `history.jsonl` holds them)
and returns one `Check` per rule, each with the value it saw, its limit and whether it passed:

* hit rate: on every step after the first, the step's hit rate within HIT_TOLERANCE of what its
  submission path can reach (`hit_rate_reachable`), above it by at most the cross-group share the
  row states (`hit_rate_shared`); where the path gives only an upper bound (`hit_rate_path`
  "unordered" / "engine n": every request at once; "KV short": the step's sequences need more KV
  cache than the server holds, so prompts are evicted), at most that bound plus the same slack;
* IS ratio: the raw importance ratio's mean within IS_TOLERANCE of 1 on every synchronous step;
* probe MAD: every served-adapter probe under its tolerance (PROBE_TOLERANCE on a GPU);
* restarts: none;
* step time: no step after the first over STEP_SPREAD times the median;
* reward rising (`reward_rising=True`): the mean of the last three steps above the first by
  REWARD_GAIN;
* reloads (`log_text`, the server's log): one adapter load per reload plus the first, one unload
  per reload.

The GPU smoke (tools/gpu/defaults_smoke.py) fails a part whose checks fail, and records each.

What it does not do: run anything, or judge speed against a peer (bench/step.py compares).
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Sequence

HIT_TOLERANCE = 0.05
IS_TOLERANCE = 0.02
PROBE_TOLERANCE = 0.25
"""The served-adapter probe's tolerance on a GPU (run/session.py: bf16 server vs trainer)."""
STEP_SPREAD = 3.0
REWARD_GAIN = 0.1
UPPER_BOUND_PATHS = ("unordered", "engine n", "KV short")
"""Submission paths whose reachable hit rate is only an upper bound (metrics.ReachableHitRate)."""
STEP_PHASES = ("rollout_s", "release_s", "train_s", "resume_s", "reload_s")


@dataclass(frozen=True)
class Check:
    """One rule applied to a run's rows."""

    name: str
    passed: bool
    value: Any
    """What was seen (a number, or per-step numbers)."""
    limit: str
    """The rule, in words."""

    def as_dict(self) -> dict:
        return asdict(self)


def check_rows(rows: Sequence[dict], reward_rising: bool = False, log_text: str | None = None,
               probe_tolerance: float = PROBE_TOLERANCE) -> list[Check]:
    """Every rule that applies to `rows` (see the module docstring); none for an empty run."""
    rows = [r for r in rows if isinstance(r, dict)]
    if not rows:
        return [Check("steps", False, 0, "at least one step")]
    checks = [check_hit_rates(rows), check_is_ratio(rows), check_probe(rows, probe_tolerance),
              check_restarts(rows), check_step_times(rows)]
    if reward_rising:
        checks.append(check_reward_rising(rows))
    if log_text is not None:
        checks.append(check_reloads(rows, log_text))
    return [c for c in checks if c is not None]


def check_hit_rates(rows: Sequence[dict]) -> Check | None:
    """Each step after the first: hit rate in [reachable - tol, reachable + shared + tol]; the lower
    bound is dropped where the path gives only an upper bound."""
    seen, bad = [], []
    for row in rows[1:]:
        hit, reach = _number(row.get("hit_rate")), _number(row.get("hit_rate_reachable"))
        if hit is None or reach is None:
            continue
        shared = _number(row.get("hit_rate_shared")) or 0.0
        upper_only = any(p in str(row.get("hit_rate_path") or "") for p in UPPER_BOUND_PATHS)
        low = -math.inf if upper_only else reach - HIT_TOLERANCE
        high = reach + shared + HIT_TOLERANCE
        seen.append({"step": row.get("step"), "hit": round(hit, 4), "reachable": round(reach, 4),
                     "shared": round(shared, 4), "path": row.get("hit_rate_path")})
        if not low <= hit <= high:
            bad.append(row.get("step"))
    if not seen:
        return Check("hit_rate", False, "no step after the first has hit_rate and hit_rate_reachable",
                     "every step after the first measured against its path")
    return Check("hit_rate", not bad, {"steps": seen, "outside": bad},
                 f"within {HIT_TOLERANCE} of hit_rate_reachable (+ hit_rate_shared above; upper bound only "
                 f"for {', '.join(UPPER_BOUND_PATHS)})")


def check_is_ratio(rows: Sequence[dict]) -> Check | None:
    values = [(r.get("step"), v) for r in rows if (v := _number(r.get("is_raw_ratio_mean"))) is not None
              and not r.get("staleness")]  # a pipelined step samples one version back: not ~1 by design
    if not values:
        return None
    worst = max(values, key=lambda sv: abs(sv[1] - 1))
    return Check("is_ratio", abs(worst[1] - 1) <= IS_TOLERANCE, {"worst_step": worst[0], "worst": round(worst[1], 4)},
                 f"is_raw_ratio_mean within {IS_TOLERANCE} of 1 on every on-policy step")


def check_probe(rows: Sequence[dict], tolerance: float) -> Check | None:
    mads = [v for r in rows if (v := _number(r.get("probe_mad"))) is not None]
    if not mads:
        return None
    return Check("probe_mad", max(mads) < tolerance, {"max": round(max(mads), 4), "probes": len(mads)},
                 f"every probe_mad under {tolerance}")


def check_restarts(rows: Sequence[dict]) -> Check:
    most = max((_number(r.get("restarts")) or 0) for r in rows)
    return Check("restarts", most == 0, most, "0 server restarts")


def check_step_times(rows: Sequence[dict]) -> Check | None:
    times = [sum(_number(r.get(k)) or 0.0 for k in STEP_PHASES) for r in rows[1:]]
    if len(times) < 2:
        return None
    median = statistics.median(times)
    worst = max(times)
    return Check("step_time", worst <= STEP_SPREAD * median, {"median_s": round(median, 4), "max_s": round(worst, 4)},
                 f"no step after the first over {STEP_SPREAD:g} x the median")


def check_reward_rising(rows: Sequence[dict]) -> Check:
    rewards = [v for r in rows if (v := _number(r.get("reward_mean"))) is not None]
    if len(rewards) < 4:
        return Check("reward_rising", False, rewards, "at least 4 steps with a reward")
    gain = statistics.fmean(rewards[-3:]) - rewards[0]
    return Check("reward_rising", gain >= REWARD_GAIN, {"first": round(rewards[0], 3), "last3": round(gain + rewards[0], 3)},
                 f"mean of the last 3 steps' reward at least {REWARD_GAIN} above the first step's")


_LOAD = re.compile(r'POST /load_lora_adapter HTTP/[\d.]+" 200')
_UNLOAD = re.compile(r'POST /unload_lora_adapter HTTP/[\d.]+" 200')


def check_reloads(rows: Sequence[dict], log_text: str) -> Check:
    """Loads = reloads + 1 (policy-step-0), unloads = reloads: each reload loads one version and
    unloads the one before, and no step loads or unloads more."""
    reloads = sum(_number(r.get("reload_s")) is not None for r in rows)
    loads, unloads = len(_LOAD.findall(log_text)), len(_UNLOAD.findall(log_text))
    return Check("reloads", loads == reloads + 1 and unloads == reloads,
                 {"reloads": reloads, "loads": loads, "unloads": unloads},
                 "one adapter load and one unload per reload (plus the first load)")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) else float(value)
