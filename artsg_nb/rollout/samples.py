"""What the model wrote: every trajectory of a step as one JSON line, and a DataFrame to read them.

What it does: `write_rollouts(run_dir, step, groups)` writes `<run_dir>/rollouts/step-N.jsonl`, one
line per trajectory (group seed and index, member index, the messages of every turn, the
completion text, reward, each reward function's part (`reward_parts`, dataset tasks), finish
reasons, prompt/completion token counts, error, adapter), written
to a temporary file and renamed, so a file is whole or absent. `read_samples(run_dir, step, k)`
reads one step's file back as a pandas DataFrame, `read_rollouts(run_dir)` every step's (the
charts' input); `samples_frame(groups)` is the same table built
from groups in memory (evaluation uses it); `samples_block(groups, k)` is k of them as a short
text block (RunConfig.print_samples). `constant_groups(groups)` counts groups whose valid
members all have one reward (zero advantage: no learning signal) and says whether the step has
nothing at all to learn from.

What it does not do: decide what is trained (run/step.py skips the update of a step without
signal; trainer.py and grpo.py compute the loss) or talk to a server.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Sequence

import pandas as pd

from ..files import write_atomic

log = logging.getLogger(__name__)

ROLLOUTS_DIR = "rollouts"
"""Folder of run_dir holding one `step-N.jsonl` per step."""
SAMPLE_COLUMNS = ("step", "group", "seed", "member", "prompt", "completion", "reward", "finish_reason",
                  "prompt_tokens", "completion_tokens", "turns", "truncated", "error", "adapter", "messages")
"""Columns of a samples DataFrame, in this order (`step` is absent for groups in memory)."""


def sample_records(groups: Sequence, step: int | None = None) -> list[dict]:
    """One JSON-able dict per trajectory of `groups` (rollout.TrajectoryGroup), in group order."""
    records = []
    for gi, group in enumerate(groups):
        for mi, t in enumerate(group.trajectories):
            replies = [m.get("content", "") for m in t.messages if m.get("role") == "assistant"]
            first_reply = next((i for i, m in enumerate(t.messages) if m.get("role") == "assistant"),
                               len(t.messages))
            prompt = t.messages[:first_reply]
            record = {"group": gi, "seed": group.seed, "member": mi,
                      "prompt": prompt[-1].get("content", "") if prompt else "",
                      "completion": "\n".join(replies),
                      "reward": t.reward if t.reward is None or math.isfinite(t.reward) else None,
                      "finish_reason": t.finish_reasons[-1] if t.finish_reasons else None,
                      "finish_reasons": list(t.finish_reasons),
                      "prompt_tokens": t.prompt_len, "completion_tokens": int(sum(t.completion_mask)),
                      "turns": t.turns, "truncated": bool(t.truncated), "error": t.error,
                      "adapter": t.adapter, "messages": list(t.messages)}
            parts = getattr(t, "reward_parts", None)
            if parts:  # a dataset task's reward functions, each on its own (sample_cards shows them)
                record["reward_parts"] = dict(parts)
            records.append(record if step is None else {"step": step, **record})
    return records


def samples_frame(records: list[dict]) -> pd.DataFrame:
    """`records` (sample_records) as a DataFrame, SAMPLE_COLUMNS first."""
    df = pd.DataFrame(records)
    first = [c for c in SAMPLE_COLUMNS if c in df.columns]
    return df[first + [c for c in df.columns if c not in first]]


def rollouts_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / ROLLOUTS_DIR / f"step-{step}.jsonl"


def write_rollouts(run_dir: str | Path, step: int, groups: Sequence) -> Path:
    """Write every trajectory of step `step` to `<run_dir>/rollouts/step-<step>.jsonl` (a redone
    step replaces its file)."""
    path = rollouts_path(run_dir, step)
    lines = "".join(json.dumps(record) + "\n" for record in sample_records(groups, step))
    write_atomic(path, lines)
    return path


def saved_steps(run_dir: str | Path) -> list[int]:
    """Steps that have a rollouts file, ascending."""
    folder = Path(run_dir) / ROLLOUTS_DIR
    return sorted(int(p.stem.split("-", 1)[1]) for p in folder.glob("step-*.jsonl")) if folder.exists() else []


def read_samples(run_dir: str | Path, step: int | None = None, k: int | None = None) -> pd.DataFrame:
    """The trajectories of `step` (None: the newest step with a file) as a DataFrame; `k` keeps
    the first k rows. Raises FileNotFoundError naming the steps there are."""
    steps = saved_steps(run_dir)
    if step is None:
        if not steps:
            raise FileNotFoundError(f"no rollouts saved under {Path(run_dir) / ROLLOUTS_DIR} yet; run a step first")
        step = steps[-1]
    path = rollouts_path(run_dir, step)
    if not path.exists():
        raise FileNotFoundError(f"no rollouts for step {step} ({path}); saved steps: {steps or 'none'}")
    df = samples_frame(read_jsonl(path))
    return df.head(k) if k is not None else df


def read_rollouts(run_dir: str | Path | None, steps: Sequence[int] | None = None) -> pd.DataFrame:
    """Every trajectory of every step's file (only `steps` when given) in one DataFrame, with
    SAMPLE_COLUMNS (empty, with those columns, when there are none or run_dir is None); reward
    and token counts numeric. What the charts read (plots.load_rollouts)."""
    saved = saved_steps(run_dir) if run_dir is not None else []
    wanted = saved if steps is None else [s for s in saved if s in {int(x) for x in steps}]
    records = [{"step": step, **r} for step in wanted for r in read_jsonl(rollouts_path(run_dir, step))]
    df = pd.DataFrame(records)
    df = df.reindex(columns=[*SAMPLE_COLUMNS, *(c for c in df.columns if c not in SAMPLE_COLUMNS)])
    for name in ("reward", "prompt_tokens", "completion_tokens"):
        df[name] = pd.to_numeric(df[name], errors="coerce")
    return df


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file; a line that does not parse (cut off by a crash) is skipped."""
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s line %d is not JSON (cut off?); skipped", path, number)
    return rows


SAMPLE_LINE_CHARS = 160
"""A printed sample's completion is cut to this many characters (the file keeps it whole)."""


def samples_block(groups: Sequence, k: int, step: int | None = None) -> str:
    """k of the step's completions as a short text block (RunConfig.print_samples): the first
    member of each of the first k groups (then second members, ...), one line each with reward,
    reward parts and finish reason, the completion on one line, cut to SAMPLE_LINE_CHARS."""
    records = sample_records(groups)
    by_member = sorted(records, key=lambda r: (r["member"], r["group"]))[:max(k, 0)]
    head = f"  samples of step {step}:" if step is not None else "  samples:"
    return "\n".join([head, *(_sample_line(r) for r in by_member)])


def _sample_line(record: dict) -> str:
    reward = record["reward"]
    said = "none" if reward is None else f"{reward:.2f}"
    parts = record.get("reward_parts") or {}
    if parts:
        said += " (" + ", ".join(f"{n} {'none' if v is None else f'{v:.2f}'}" for n, v in parts.items()) + ")"
    text = " ".join(str(record["completion"]).split())
    text = text if len(text) <= SAMPLE_LINE_CHARS else text[:SAMPLE_LINE_CHARS - 1] + "…"
    where = f"g{record['group']}.{record['member']}"
    error = f" | error {record['error']}" if record.get("error") else ""
    return f"  {where} reward {said} | {record['finish_reason']}{error} | {text!r}"


def constant_groups(groups: Sequence) -> tuple[int, bool]:
    """(groups whose valid members share one reward, whether the step has no signal at all).

    No signal: at least one valid trajectory, and every group is constant (one reward, or fewer
    than two valid members). A step where every rollout failed is not "no signal": the trainer
    raises for it, so the failure is seen."""
    constant, any_valid = 0, False
    for group in groups:
        rewards = {t.reward for t in group.trajectories if t.valid}
        any_valid = any_valid or bool(rewards)
        constant += len(rewards) <= 1
    return constant, any_valid and constant == len(groups)
