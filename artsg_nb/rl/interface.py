"""The trainer interface a run holds: what the run, the adapter versions and the ART backend call.

What it does: `RunTrainer` declares, as a typing.Protocol, the members a run uses of its trainer:
the update (`train_step`), the step counter, scoring the served-adapter check's probe, saving the
adapter and the checkpoint (and waiting for one being written), loading a checkpoint (resume,
rollback), releasing cached GPU memory, closing, and what it reads (cfg, tokenizer, device, model,
checkpoints, warm_up_s). `trainer.Trainer` (one process) and `distributed.RankedTrainer` (K ranks,
this process rank 0) implement every member themselves (tests/test_distributed.py holds both to
this list), so nothing reaches a trainer's members by forwarding.

What it does not: implement anything (trainer.py, distributed.py), or name a trainer's inner
parts (make_batch, backward, optimizer_step): a run never calls them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable


@runtime_checkable
class RunTrainer(Protocol):
    """A trainer of one process, or of several ranks, as a run uses it."""

    step: int
    """Updates made so far (restored by load_checkpoint)."""
    cfg: Any
    """Its trainer.TrainerConfig."""
    tokenizer: Any
    device: Any
    model: Any
    checkpoints: Any
    """Its checkpoint.CheckpointWriter (the checkpoint written in the background)."""
    warm_up_s: float | None
    """Seconds its warm-up took when it was built (None: none ran)."""

    def train_step(self, groups) -> dict: ...
    def score_tokens(self, token_ids: list[int]) -> list[float]: ...
    def save_adapter(self, path: str | Path) -> None: ...
    def save_checkpoint(self, path: str | Path, wait: bool = True,
                        before: Callable[[], None] | None = None) -> None: ...
    def wait_for_checkpoint(self) -> None: ...
    def load_checkpoint(self, path: str | Path) -> None: ...
    def release_cached_memory(self) -> None: ...
    def close(self) -> None: ...


TRAINER_MEMBERS = ("step", "cfg", "tokenizer", "device", "model", "checkpoints", "warm_up_s", "train_step",
                   "score_tokens", "save_adapter", "save_checkpoint", "wait_for_checkpoint", "load_checkpoint",
                   "release_cached_memory", "close")
"""RunTrainer's members by name, for the test that holds each trainer class to them."""
