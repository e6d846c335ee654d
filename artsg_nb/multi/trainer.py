"""One base model, many LoRA experiments: a PEFT adapter and an AdamW optimizer per experiment.

What it does: `MultiTrainer` loads the base model once (transformers + PEFT; Unsloth's
FastLanguageModel holds one adapter, so it is not used here) and gives each experiment
(`add(name, LoraSpec, learning_rate, seed)`) its own PEFT adapter (`add_adapter`, initialised from
the experiment's seed exactly as a lone `rl.trainer.Trainer` of that seed initialises its own) and
its own `rl.trainer.Trainer` on the shared model: its own optimizer, step counter, checkpoint
writer and adapter I/O. Every call selects the experiment's adapter first (`set_adapter`, which
also makes only that adapter's parameters require grad), under one lock, so calls from several
threads are time-shared and never mix adapters.

  train_step(name, groups)          one GRPO update: the Trainer's own train_step, so the result is
                                    what a lone Trainer of the same seed computes
  forward_backward(name, batch, loss_fn)  gradients accumulated on that adapter only: "grpo" (the
                                    Trainer's batch building and backward, grpo.policy_loss) or the
                                    token losses "importance_sampling" / "cross_entropy" on `Datum`s
                                    (losses.py, Tinker's definitions)
  optim_step(name, learning_rate, betas, eps, weight_decay)  clip, step that AdamW, zero its grads
  save_adapter / score / using(name)  the adapter as a PEFT folder, logprobs, the Trainer itself

The runtime's LoRA shape (`MultiTrainer(lora=...)`) is the server's: an experiment of a larger
rank, or targeting modules outside it, is refused naming both (`LoraMismatchError`).

What it does not do: talk to a server, save versions or write history (runtime.py), or define the
GRPO loss (rl/grpo.py, through rl/trainer.py).
"""
from __future__ import annotations

import contextlib
import logging
import re
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..rl.grpo import GRPOConfig
from ..rl.step_stats import batch_counts
from ..rl.trainer import LORA_TARGETS, Batch, Trainer, TrainerConfig, _load_model, _lora_config, _pick_device
from .losses import LOSS_FNS, Datum, token_loss_backward

log = logging.getLogger(__name__)

IDLE_ADAPTER = "default"
"""The adapter PEFT is loaded with: never trained (B = 0), active when no experiment is."""
PEFT_PREFIX = "exp_"
"""An experiment's PEFT adapter is `exp_<name>`: PEFT mistakes a name inside "lora_" ("a", "ra") for
part of its parameter prefix when loading."""
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class LoraMismatchError(ValueError):
    """An experiment's LoRA shape is not one the runtime (its server and trainer) was started for."""


@dataclass(frozen=True)
class LoraSpec:
    """The shape of a LoRA adapter."""

    rank: int = 16
    """r. The runtime's is the largest an experiment may have (SGLang --max-lora-rank)."""
    alpha: int = 32
    """alpha; the update is scaled by alpha / r."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """Modules that get adapters; the runtime's list bounds an experiment's (SGLang --lora-target-modules)."""

    def __post_init__(self):
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.rank < 1:
            raise ValueError(f"LoraSpec.rank={self.rank} must be >= 1")

    def check_fits(self, runtime: "LoraSpec", name: str) -> None:
        """Raise LoraMismatchError naming both shapes unless this adapter fits the runtime's."""
        extra = [m for m in self.target_modules if m not in runtime.target_modules]
        if self.rank > runtime.rank or extra:
            what = (f"rank {self.rank} > the runtime's {runtime.rank}" if self.rank > runtime.rank
                    else f"target modules {extra} outside the runtime's {list(runtime.target_modules)}")
            raise LoraMismatchError(
                f"experiment {name!r} asks for a LoRA of rank {self.rank} on {list(self.target_modules)}, but the "
                f"runtime was started with rank {runtime.rank} on {list(runtime.target_modules)} ({what}). Try: "
                f"rank <= {runtime.rank} and target modules among the runtime's, or start a runtime with "
                f"LoraSpec(rank={max(self.rank, runtime.rank)}, target_modules=...) covering both")


class MultiTrainer:
    """One base model with one LoRA adapter + AdamW per experiment (module docstring)."""

    def __init__(self, model_path: str, lora: LoraSpec = LoraSpec(), device: str = "auto",
                 grpo: GRPOConfig | None = None, micro_batch_tokens: int | None = None,
                 max_grad_norm: float = 1.0, fused_logprobs: bool = True):
        self.lora = lora
        """The runtime's LoRA shape: an experiment's rank and targets must fit it."""
        self.base_cfg = TrainerConfig(model_path=str(model_path), lora_rank=lora.rank, lora_alpha=lora.alpha,
                                      target_modules=lora.target_modules, device=device, use_unsloth=False,
                                      warm_up=False, micro_batch_tokens=micro_batch_tokens,
                                      max_grad_norm=max_grad_norm, fused_logprobs=fused_logprobs,
                                      grpo=grpo or GRPOConfig())
        """What every experiment's TrainerConfig starts from (its rank, alpha, lr and seed replaced)."""
        self.device = _pick_device(device)
        self._loaded = _load_model(self.base_cfg, self.device)  # (PEFT model, tokenizer, backend), adapter "default"
        self.model, self.tokenizer = self._loaded[0], self._loaded[1]
        self._trainers: dict[str, Trainer] = {}
        self._lock = threading.RLock()  # one experiment on the model at a time
        log.info("multi-trainer on %s: %s, runtime LoRA rank %d on %s", self.device, model_path, lora.rank,
                 list(lora.target_modules))

    # ---- experiments ---------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """The experiments, in the order they were added."""
        return list(self._trainers)

    def add(self, name: str, lora: LoraSpec, learning_rate: float, seed: int,
            grpo: GRPOConfig | None = None) -> None:
        """A new experiment: its adapter initialised from `seed` (as a lone Trainer of that seed
        initialises its own) and its AdamW at `learning_rate`; `grpo` defaults to the runtime's."""
        if not NAME_PATTERN.match(name) or name == IDLE_ADAPTER:
            raise ValueError(f"experiment name {name!r}: use letters, digits, '-' and '_' (at most 64, not "
                             f"{IDLE_ADAPTER!r}); it prefixes the served adapter names (<name>-step-N)")
        if name in self._trainers:
            raise ValueError(f"experiment {name!r} exists already; remove({name!r}) first or pick another name")
        lora.check_fits(self.lora, name)
        cfg = replace(self.base_cfg, lora_rank=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                      learning_rate=learning_rate, seed=seed, grpo=grpo or self.base_cfg.grpo)
        with self._lock:
            torch.manual_seed(seed)  # the draw a lone Trainer makes for lora_A right after its seed
            self.model.add_adapter(peft_name(name), _lora_config(cfg))
            self.model.set_adapter(peft_name(name))
            try:
                self._trainers[name] = Trainer(cfg, loaded=self._loaded, adapter_name=peft_name(name))
            except BaseException:
                self._delete_adapter(name)
                raise

    def remove(self, name: str) -> None:
        """Drop an experiment: its adapter, optimizer and trainer (a checkpoint being written lands first)."""
        with self._lock:
            trainer = self._get(name)
            trainer.close()
            del self._trainers[name]
            self._delete_adapter(name)

    def _delete_adapter(self, name: str) -> None:
        self.model.set_adapter(IDLE_ADAPTER)
        self.model.delete_adapter(peft_name(name))
        self.model.set_adapter(IDLE_ADAPTER)

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[Trainer]:
        """The experiment's Trainer with its adapter active, under the lock (for what this class
        does not wrap: save_checkpoint, load_checkpoint, step, cfg)."""
        with self._lock:
            trainer = self._get(name)
            if self.model.active_adapter != trainer.adapter_name:
                self.model.set_adapter(trainer.adapter_name)  # also: only this adapter's parameters require grad
            yield trainer

    def trainer_of(self, name: str) -> Trainer:
        """The experiment's Trainer for its settings and bookkeeping (optimizer learning rate, cfg,
        step, the checkpoint being written), without the lock: never to run the model (using())."""
        return self._get(name)

    def _get(self, name: str) -> Trainer:
        try:
            return self._trainers[name]
        except KeyError:
            raise KeyError(f"no experiment {name!r} on this trainer (it has {self.names}); add() it first") from None

    # ---- training ------------------------------------------------------------------------------
    def train_step(self, name: str, groups) -> dict:
        """One GRPO update of experiment `name` on rollout groups: rl.trainer.Trainer.train_step."""
        with self.using(name) as trainer:
            return trainer.train_step(groups)

    def forward_backward(self, name: str, batch, loss_fn: str = "grpo") -> dict:
        """Gradients of `loss_fn` accumulated on experiment `name`'s adapter only (optim_step applies
        them). "grpo": `batch` is rollout groups (or an rl.trainer.Batch), the loss grpo.policy_loss
        as in train_step; "importance_sampling" / "cross_entropy": `batch` is a list of Datum
        (losses.py). Returns the loss, and for the token losses each datum's target logprobs."""
        if loss_fn not in LOSS_FNS:
            raise ValueError(f"loss_fn={loss_fn!r}; use one of {', '.join(LOSS_FNS)}")
        with self.using(name) as trainer:
            try:
                if loss_fn == "grpo":
                    b = batch if isinstance(batch, Batch) else trainer.make_batch(batch)
                    stats = trainer.backward(b, budget=trainer.micro_batch_tokens())
                    return {**stats.result(), **batch_counts(b)}
                return token_loss_backward(trainer, _datums(batch), loss_fn, trainer.micro_batch_tokens())
            except BaseException:
                trainer.optimizer.zero_grad(set_to_none=True)  # half a backward is no gradient to step on
                raise

    def optim_step(self, name: str, learning_rate: float | None = None, betas: tuple[float, float] | None = None,
                   eps: float | None = None, weight_decay: float | None = None) -> dict:
        """Clip experiment `name`'s accumulated gradients, step its AdamW (with the given settings,
        kept for later steps), zero them. Returns the gradient norm, the step count and the lr."""
        with self.using(name) as trainer:
            for group in trainer.optimizer.param_groups:
                for key, value in (("lr", learning_rate), ("betas", betas), ("eps", eps),
                                   ("weight_decay", weight_decay)):
                    if value is not None:
                        group[key] = tuple(value) if key == "betas" else float(value)
            grad_norm = trainer.optimizer_step()
            return {"grad_norm": grad_norm, "step": trainer.step,
                    "learning_rate": trainer.optimizer.param_groups[0]["lr"]}

    # ---- adapters and scoring ------------------------------------------------------------------
    def save_adapter(self, name: str, directory: str | Path) -> Path:
        """Experiment `name`'s adapter as a PEFT folder (adapter_config.json + safetensors) at `directory`."""
        with self.using(name) as trainer:
            trainer.save_adapter(directory)
        return Path(directory)

    def score(self, name: str, token_ids: Sequence[int]) -> list[float]:
        """Logprobs of token_ids[1:] under experiment `name`'s adapter, at its GRPO temperature."""
        with self.using(name) as trainer:
            return trainer.score_tokens(list(token_ids))

    def learning_rate_of(self, name: str) -> float:
        """Experiment `name`'s AdamW learning rate now."""
        return self._get(name).optimizer.param_groups[0]["lr"]

    def step_of(self, name: str) -> int:
        """Optimizer steps experiment `name` has taken."""
        return self._get(name).step

    def close(self) -> None:
        """Wait for every experiment's checkpoint still being written."""
        for trainer in list(self._trainers.values()):
            trainer.close()


def peft_name(name: str) -> str:
    """The PEFT adapter of experiment `name` (PEFT_PREFIX)."""
    return PEFT_PREFIX + name


def _datums(batch) -> list[Datum]:
    data = list(batch)
    bad = [type(d).__name__ for d in data if not isinstance(d, Datum)]
    if bad or not data:
        raise TypeError(f"a token loss takes a non-empty list of multi.Datum, got {bad or 'none'}")
    return data
