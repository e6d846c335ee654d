"""Which adapter versions a run keeps on disk, so a long run does not fill it.

What it does: `prune_adapters(adapters_dir, keep_last, keep_every, protect)` deletes
`policy-step-N` folders except the newest `keep_last`, every step divisible by `keep_every`, and
the steps in `protect` (the session passes the served version and this step's), and the newest
complete checkpoint, which is what resume restores (versions.AdapterVersions.begin). `keep_last=0` keeps
everything (the default: nothing is ever deleted unless asked).

What it does not do: decide what is served or resumed (versions.py), or delete anything that is
not a `policy-step-N` folder (temporary folders of a save in progress are left to lora.py).
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Iterable

from ..rl.lora import checkpoint_steps, version_steps

log = logging.getLogger(__name__)


def steps_to_delete(steps: Iterable[int], keep_last: int, keep_every: int, protect: Iterable[int]) -> list[int]:
    """The steps `prune_adapters` would delete (pure; see the module docstring)."""
    steps = sorted(steps)
    if keep_last <= 0:
        return []
    keep = set(steps[-keep_last:]) | set(protect)
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def prune_adapters(adapters_dir: str | Path, keep_last: int, keep_every: int, protect: Iterable[int]) -> list[int]:
    """Delete the versions outside the retention policy; returns the deleted steps. The newest
    complete checkpoint is kept too: while the newest version's checkpoint is still being written
    in the background (rl/checkpoint.py), it is what a resume restores."""
    if keep_last <= 0:
        return []
    newest_complete = checkpoint_steps(adapters_dir)[-1:]
    doomed = steps_to_delete(version_steps(adapters_dir), keep_last, keep_every, [*protect, *newest_complete])
    for step in doomed:
        shutil.rmtree(Path(adapters_dir) / f"policy-step-{step}", ignore_errors=True)
    if doomed:
        log.info("pruned adapter versions %s from %s", doomed, adapters_dir)
    return doomed
