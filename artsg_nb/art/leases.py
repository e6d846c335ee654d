"""Adapter leases: an older step's adapter served, under its own name, while a caller holds it.

ART's Backend protocol (openpipe-art 0.5.23: `exact_adapter_lease(model, step)`, an async context
manager) asks the backend to serve exactly the checkpoint of `step` for as long as the context is
held, and `model.get_inference_name()` inside it to name that checkpoint. Our run serves only its
newest adapter (rl.lora.AdapterPublisher unloads the one before at each reload), so a lease loads
the step's saved adapter folder again under a name of its own (`policy-step-N-lease`; in a sweep
`<experiment>-step-N-lease`), which no reload touches; the last release of a step unloads it. `pinned_name(model_name, step)` is what
`_model_inference_name` answers inside a lease: a context variable, so a lease held by one
rollout task does not change the name another task sees.

What it does not do: keep a lease across a server restart (the restarted server has lost the
adapter; requests under it then fail with the engine's unknown-adapter error), or lease a step
whose adapter folder is gone (model.delete_checkpoints keeps leased steps).
"""
from __future__ import annotations

import asyncio
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from ..rl.checkpoint import ADAPTER_FILE
from ..rl.lora import adapter_name, check_inside, version_steps

_PINNED: ContextVar[dict[str, tuple[int, str]]] = ContextVar("artsg_nb_art_pinned_adapters", default={})
"""model name → (step, inference name) of the leases the current context holds."""


def pinned_name(model_name: str, step: int | None) -> str | None:
    """The inference name a lease of this context pins for `model_name` (and `step`, when given)."""
    pinned = _PINNED.get().get(model_name)
    if pinned is None or (step is not None and step != pinned[0]):
        return None
    return pinned[1]


def pin(model_name: str, step: int, inference_name: str):
    """Pin `inference_name` for `model_name` in this context; returns the token `unpin` takes."""
    return _PINNED.set({**_PINNED.get(), model_name: (step, inference_name)})


def unpin(token) -> None:
    _PINNED.reset(token)


@dataclass
class AdapterLeases:
    """One run's leased steps: the adapter each loaded under, and how many holders it has."""

    run_dir: Path
    prefix: str = "policy"
    """The run's served adapters are `<prefix>-step-N` (an experiment's name in a sweep)."""
    holders: dict[int, int] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def name(self, step: int) -> str:
        return f"{self.prefix}-step-{step}-lease"

    @property
    def steps(self) -> set[int]:
        """Steps leased now (their adapter folders must stay)."""
        return set(self.holders)

    async def acquire(self, client, step: int) -> str:
        """The served name of `step`'s adapter, loaded on the first lease of it."""
        async with self._lock:
            if step not in self.holders:
                await client.load_adapter(self.name(step), str(self._folder(step).resolve()))
                self.holders[step] = 0
            self.holders[step] += 1
        return self.name(step)

    async def release(self, client, step: int) -> None:
        """Drop one holder of `step`; the last one unloads its adapter."""
        async with self._lock:
            self.holders[step] -= 1
            if self.holders[step] == 0:
                del self.holders[step]
                await client.unload_adapter(self.name(step))

    def _folder(self, step: int) -> Path:
        adapters = self.run_dir / "adapters"
        folder = adapters / adapter_name(step)
        check_inside(folder, self.run_dir)
        if not (folder / ADAPTER_FILE).exists():
            raise ValueError(f"step {step} has no saved adapter in {adapters} (steps on disk: "
                             f"{version_steps(adapters)}); model.delete_checkpoints() may have removed it")
        return folder
