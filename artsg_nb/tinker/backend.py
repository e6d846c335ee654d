"""What the Tinker service calls on the runtime: the trainer's and the inference server's methods.

What it does: names, as two Protocols, exactly the methods `service.TinkerService` calls —
`Trainer` (multi.MultiTrainer: one LoRA adapter and optimizer per experiment on one copy of the
base model) and `Sampler` (an engines.EngineClient: generate, load/unload adapters, score) — and
the typed data handed to them: `LoraRequest` (what the client asked for at create_model) and
`TokenDatum` (one Tinker `Datum` as token lists, the shape the trainer's token-level losses take).

What it does not do: train, sample or convert wire formats (wire.py); the Protocols are checked
by the tests' fakes and by the real MultiTrainer, not at run time.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

LOSS_FUNCTIONS = ("cross_entropy", "importance_sampling")
"""Tinker loss functions this service trains with (their inputs: wire.LOSS_INPUTS). The others the
client can name (ppo, cispo, dro, gspo, stable_reinforce, custom) are refused with this list."""


@dataclass(frozen=True)
class LoraRequest:
    """A LoRA adapter as Tinker's create_model asks for one (types.LoraConfig)."""

    rank: int
    """LoRA rank; the runtime's adapters all have the rank it was started with (else refused)."""
    seed: int | None = None
    """Seed of the adapter's initialisation; None lets the service pick one (and report it)."""
    train_mlp: bool = True
    """Adapters on the MLP projections (gate/up/down)."""
    train_attn: bool = True
    """Adapters on the attention projections (q/k/v/o)."""
    train_unembed: bool = True
    """An adapter on the unembedding; the runtime's adapters have none (the flag is ignored)."""


@dataclass(frozen=True)
class TokenDatum:
    """One training example, as Tinker's `Datum` carries it: position i of `input_ids` predicts
    `target_ids[i]`; every list below has len(input_ids) entries."""

    input_ids: list[int]
    """The model input (prompt and completion, without the last token)."""
    target_ids: list[int]
    """The token each position predicts (the input shifted by one)."""
    weights: list[float]
    """Per-position weight of cross_entropy (0 on the prompt); 1.0 everywhere when not sent."""
    advantages: list[float] | None = None
    """importance_sampling: per-position advantage (0 on the prompt)."""
    sampling_logprobs: list[float] | None = None
    """importance_sampling: log q(target | input) under the sampler that produced the completion."""


class Trainer(Protocol):
    """multi.MultiTrainer, as far as the Tinker service uses it (methods run in a worker thread,
    one at a time)."""

    def add(self, name: str, lora: Any, learning_rate: float, seed: int) -> None:
        """A new experiment `name` with a fresh adapter `lora` and its own optimizer."""

    def remove(self, name: str) -> None:
        """Drop experiment `name`: its adapter and optimizer state."""

    def forward_backward(self, name: str, batch: list[TokenDatum], loss_fn: str = "importance_sampling",
                         **kwargs: Any) -> dict:
        """Accumulate the gradient of `loss_fn` (a sum over tokens, as Tinker defines it) on `batch`;
        returns float metrics, "loss" among them, and "logprobs": per datum the logprobs of its
        targets under the adapter before the update (list of lists of floats)."""

    def optim_step(self, name: str, learning_rate: float | None = None, betas: tuple[float, float] | None = None,
                   eps: float | None = None, weight_decay: float | None = None) -> dict:
        """One AdamW step on the accumulated gradient (then zeroed); float metrics."""

    def save_adapter(self, name: str, directory: str | Path) -> Path:
        """Write experiment `name`'s adapter as PEFT files (adapter_config.json +
        adapter_model.safetensors) into `directory`; the folder written."""


class Sampler(Protocol):
    """An engines.EngineClient, as far as the Tinker service uses it (async, in the server's loop)."""

    async def generate(self, input_ids: list[int], params: Any = None, adapter: str | None = None) -> list:
        """engines.Generation per sample of `params.n`."""

    async def load_adapter(self, name: str, path: str) -> float:
        """Load the PEFT adapter at `path` under `name`."""

    async def unload_adapter(self, name: str) -> None:
        """Unload adapter `name`."""

    async def score(self, input_ids: list[int], adapter: str | None = None, temperature: float = 1.0) -> list[float]:
        """log p(input_ids[i] | input_ids[:i]) for i = 1..len-1."""
