"""What each phase of a step hands the next: typed results instead of tuples.

What it does: names the values that flow through one step (run/step.py), top to bottom:
`Rollouts` (the step's groups and their timing) → `Rewards` (whether any group has a signal) →
`Update` (the trainer's metrics, its seconds,
the memory released around it, the version a pipelined update saved) → `Published` (the version
the step ends with, the save + reload seconds, the served-adapter probe). `Saved` is a version
written to disk and the seconds that took (its load too once staged).

What it does not do: compute anything (the phases do) or decide the history row (row.StepRow).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..rl.lora import AdapterVersion


@dataclass
class Rollouts:
    """A step's trajectory groups, from the server (or given to `train_on`)."""

    step: int
    groups: list
    hit_rate: float | None
    """Cached / prompt tokens the server reported with the step's answers; None when not rolled out here."""
    rollout_s: float | None
    """Seconds of the rollouts (redone ones included), None when not rolled out here."""


@dataclass
class Rewards:
    """The rewards phase's finding: whether any group carries a signal."""

    zero_adv_groups: int
    """Groups whose rewards are all equal (every advantage 0)."""
    signal: bool
    """False when every group is such a group: no gradient, the update is skipped."""


@dataclass
class Saved:
    """An adapter version written to disk (and maybe loaded into the server, not served yet)."""

    version: AdapterVersion
    seconds: float
    """The save's seconds, and the load's once staged (AdapterVersions.stage)."""


@dataclass
class Update:
    """The update phase's result: the trainer's step, or a skipped one (no signal)."""

    metrics: dict
    """trainer.train_step's metrics, or {zero_adv_groups, update_skipped} for a skipped update."""
    train_s: float | None
    release_s: float | None = None
    """Seconds to give the server's GPU memory back before the update (None: not released)."""
    resume_s: float | None = None
    saved: Saved | None = None
    """The new version, when saved with the update (pipelined, or a skipped update's checkpoint)."""

    @property
    def skipped(self) -> bool:
        return bool(self.metrics.get("update_skipped"))


@dataclass
class Published:
    """The version phase's result: the version the step trained, and what making it cost."""

    version: AdapterVersion
    reload_s: float | None
    """Save + load seconds wherever they ran; None for a skipped update (nothing to reload)."""
    probe: dict = field(default_factory=dict)
    """The served-adapter check (probe_mad, probe_moved), {} when not due."""
    waited_s: float = 0.0
    """The part of reload_s the step waited for after its update (pipeline's reload_wait_s)."""
