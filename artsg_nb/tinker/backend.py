"""What the Tinker service calls on the runtime: the trainer's and the inference server's methods.

What it does: names, as two Protocols, exactly the methods `service.TinkerService` calls —
`Trainer` (multi.MultiTrainer: one LoRA adapter and optimizer per experiment on one copy of the
base model) and `Sampler` (an engines.EngineClient: generate, load/unload adapters, score) — and
the typed data handed to them: `LoraRequest` (what the client asked for at create_model; the
service turns it into a multi.LoraSpec within the trainer's) and multi.losses.Datum (one Tinker
`Datum` as token lists, what the trainer's token losses take).

What it does not do: train, sample or convert wire formats (wire.py); the Protocols are checked
by the tests' fakes and by the real MultiTrainer, not at run time.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..multi.losses import Datum
from ..multi.trainer import LoraSpec

LOSS_FUNCTIONS = ("cross_entropy", "importance_sampling")
"""Tinker loss functions this service trains with (their inputs: wire.LOSS_INPUTS). The others the
client can name (ppo, cispo, dro, gspo, stable_reinforce, custom) are refused with this list."""


ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


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

    def spec(self, runtime: LoraSpec) -> LoraSpec:
        """The adapter as the trainer takes it: this rank, the runtime's alpha, and the runtime's
        attention and/or MLP modules as asked."""
        wanted = ATTENTION_MODULES * self.train_attn + MLP_MODULES * self.train_mlp
        targets = tuple(m for m in runtime.target_modules if m in wanted)
        if not targets:
            raise ValueError(f"no LoRA target modules: train_attn={self.train_attn}, train_mlp={self.train_mlp} and "
                             f"the runtime adapts {list(runtime.target_modules)}")
        return LoraSpec(rank=self.rank, alpha=runtime.alpha, target_modules=targets)


class Trainer(Protocol):
    """multi.MultiTrainer, as far as the Tinker service uses it (methods run in a worker thread,
    one at a time)."""

    def add(self, name: str, lora: LoraSpec, learning_rate: float, seed: int) -> None:
        """A new experiment `name` with a fresh adapter `lora` and its own optimizer."""

    def remove(self, name: str) -> None:
        """Drop experiment `name`: its adapter and optimizer state."""

    lora: LoraSpec
    """The runtime's LoRA shape: an experiment's rank and target modules must fit within it."""

    def forward_backward(self, name: str, batch: list[Datum], loss_fn: str = "importance_sampling") -> dict:
        """Accumulate the gradient of `loss_fn` (a sum over tokens, as Tinker defines it) on `batch`;
        returns float metrics, "loss" among them, and "logprobs": per datum the logprobs of its
        targets under the adapter before the update (list of lists of floats)."""

    def optim_step(self, name: str, learning_rate: float | None = None, betas: tuple[float, float] | None = None,
                   eps: float | None = None, weight_decay: float | None = None) -> dict:
        """One AdamW step on the accumulated gradient (then zeroed); float metrics."""

    def score(self, name: str, token_ids: list[int]) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i = 1..len-1 under experiment `name`'s adapter."""

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
