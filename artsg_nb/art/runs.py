"""What SGLangBackend drives for one registered ART model: a run of its own, or one experiment of a sweep.

What it does: both classes answer the same few questions the backend asks (backend.py) — the
served adapter and its OpenAI name, the trainer's step, the server's client and key, the
tokenizer — and do its three actions: serve the starting adapter, train one step on converted
groups (with one call's learning rate and loss settings), and stop.

  OwnRun        `SGLangBackend()`: the model gets a GRPORun of its own (its own server and trainer),
                run dir `<ART output dir>/artsg_nb`, resumed when it exists; adapters `policy-step-N`.
  SweepMember   `SGLangBackend(sweep=sweep)`: the model is one experiment of a running multi.Sweep
                (Sweep.attach): the sweep's server and base model, its own LoRA and AdamW on the
                sweep's MultiTrainer, run dir `<sweep run_dir>/<model name>`, adapters
                `<model name>-step-N` (served beside the other experiments', batched with their
                rollouts). Its base model must be the sweep's; it starts at step 0 (a sweep does not
                resume).

`learning_rate` and `grpo` settings of one `train` call are put on the trainer for that update
and taken back after it (`overrides`).

What it does not do: convert ART's trajectories (convert.py) or speak ART's protocol (backend.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from abc import ABC, abstractmethod
from dataclasses import replace
from pathlib import Path
from typing import Callable, ContextManager

from ..models.pretrained import built_model_dir
from ..multi.runtime import Sweep
from ..run.config import CONFIG_FILE, RunConfig
from ..run.session import GRPORun
from .convert import AmbiguousTokens

log = logging.getLogger(__name__)


class ModelRun(ABC):
    """What SGLangBackend needs of the run behind one model (module docstring): what a GRPORun and
    a sweep's Experiment (`self.run`) answer alike is written here once, the rest by each kind."""

    run = None
    """The GRPORun or the sweep's Experiment (what backend.run(model) returns)."""
    run_dir: Path
    adapter_prefix: str
    """Served adapter names are `<adapter_prefix>-step-N`; a lease's `<adapter_prefix>-step-N-lease`."""

    @property
    def adapter(self) -> str | None:
        """The adapter served now."""
        return self.run.adapter

    @property
    def served_step(self) -> int:
        return self.run.publisher.current.step

    @property
    def client(self):
        """The server's client (a new one after a restart)."""
        return self.run.client

    @property
    @abstractmethod
    def step(self) -> int: ...

    @property
    @abstractmethod
    def api_key(self) -> str | None: ...

    @property
    @abstractmethod
    def tokenizer(self): ...

    @abstractmethod
    def using_trainer(self) -> ContextManager: ...

    @abstractmethod
    async def serve_initial(self) -> None: ...

    @abstractmethod
    async def train_on(self, groups, learning_rate: float | None, grpo: dict) -> dict: ...

    @abstractmethod
    def wait_for_checkpoint(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...


class OwnRun(ModelRun):
    """An ART model with a GRPORun of its own (module docstring)."""

    adapter_prefix = "policy"

    def __init__(self, run: GRPORun):
        self.run, self.run_dir = run, run.run_dir

    @classmethod
    async def start(cls, config: RunConfig, base_model: str, run_dir: Path) -> "OwnRun":
        """Start (or resume, when `run_dir` holds a run) the server and trainer, and serve the
        starting adapter (ART rolls out before its first train)."""
        cfg = replace(config, model_path=base_model, run_dir=str(run_dir), resume=(run_dir / CONFIG_FILE).exists())
        run = GRPORun(cfg)
        await asyncio.to_thread(run.start)
        own = cls(run)
        try:
            await own.serve_initial()
        except BaseException:
            run.stop()
            raise
        return own

    @property
    def step(self) -> int:
        return self.run.trainer.step

    @property
    def api_key(self) -> str | None:
        return getattr(self.run.server, "api_key", None)

    @property
    def tokenizer(self):
        return self.run.trainer.tokenizer

    def using_trainer(self) -> ContextManager:
        return contextlib.nullcontext(self.run.trainer)

    async def serve_initial(self) -> None:
        await self.run.serve_initial()

    async def train_on(self, groups, learning_rate: float | None, grpo: dict) -> dict:
        with overrides(self.run.trainer, learning_rate, grpo):
            return await self.run.train_on(groups)

    def wait_for_checkpoint(self) -> None:
        self.run.trainer.wait_for_checkpoint()

    async def close(self) -> None:
        self.run.stop()


class SweepMember(ModelRun):
    """An ART model as one experiment of a running sweep (module docstring)."""

    def __init__(self, sweep: Sweep, name: str):
        self.sweep, self.name = sweep, name
        self.run = sweep.experiments[name]
        """The sweep's Experiment (its history, run dir, served adapter; what backend.run(model) returns)."""
        self.run_dir = self.run.run_dir
        self.adapter_prefix = name

    @classmethod
    async def start(cls, sweep: Sweep, config: RunConfig, name: str, base_model: str) -> "SweepMember":
        """Attach the model to `sweep` as experiment `name` and serve its starting adapter. A base
        model other than the sweep's, or a LoRA the sweep was not started for, is refused naming both."""
        if sweep.multi is None:
            raise RuntimeError("SGLangBackend(sweep=...) needs a started sweep: sweep = Sweep(...).start() first")
        check_same_base(base_model, sweep.model_dir)
        sweep.attach(name, config)
        member = cls(sweep, name)
        try:
            await sweep.serve_initial(name)
        except BaseException:
            try:
                await sweep.remove(name)
            except Exception as e:  # noqa: BLE001 — the serve_initial error is the one to report
                log.error("could not take %s out of the sweep again (%s: %s)", name, type(e).__name__, e)
            raise
        return member

    @property
    def step(self) -> int:
        return self.run.step_count

    @property
    def api_key(self) -> str | None:
        return getattr(self.sweep.server, "api_key", None)

    @property
    def tokenizer(self):
        return self.sweep.multi.tokenizer

    def using_trainer(self) -> ContextManager:
        """This experiment's Trainer with its adapter active (the base model is shared: call it
        from a worker thread, it waits while another experiment's update runs)."""
        return self.sweep.multi.using(self.name)

    async def serve_initial(self) -> None:
        await self.sweep.serve_initial(self.name)

    async def train_on(self, groups, learning_rate: float | None, grpo: dict) -> dict:
        with overrides(self.sweep.multi.trainer_of(self.name), learning_rate, grpo):
            return await self.sweep.train_on(self.name, groups)

    def wait_for_checkpoint(self) -> None:
        self.sweep.multi.trainer_of(self.name).wait_for_checkpoint()

    async def close(self) -> None:
        """Leave the sweep (its adapters unloaded, its LoRA and optimizer dropped); the sweep and
        the run dir stay."""
        await self.sweep.remove(self.name)


class BaseModelMismatchError(ValueError):
    """An ART model whose base model is not the one the sweep serves."""


def check_same_base(base_model: str, sweep_model_dir: str) -> None:
    """BaseModelMismatchError naming both unless `base_model` is the sweep's base model."""
    mine = built_model_dir(base_model)
    if os.path.realpath(mine) != os.path.realpath(sweep_model_dir):
        raise BaseModelMismatchError(
            f"the ART model's base_model {base_model!r} ({mine}) is not the sweep's base model ({sweep_model_dir}): "
            "the experiments of a sweep share one copy of the base model. Try: art.TrainableModel(..., "
            f"base_model={sweep_model_dir!r}), or SGLangBackend() without sweep= for a run of its own")


@contextlib.contextmanager
def overrides(trainer, learning_rate: float | None, grpo: dict):
    """This call's learning rate and loss settings on the trainer; the run's come back after."""
    changes = {k: v for k, v in grpo.items() if getattr(trainer.cfg.grpo, k) != v}
    if learning_rate is None and not changes:
        yield
        return
    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is None:
        raise NotImplementedError("per-call learning_rate / loss settings need trainer_ranks=1; set them in RunConfig")
    old_lrs, old_grpo = [g["lr"] for g in optimizer.param_groups], trainer.cfg.grpo
    try:
        if learning_rate is not None:
            for g in optimizer.param_groups:
                g["lr"] = learning_rate
        trainer.cfg.grpo = replace(old_grpo, **changes)
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, old_lrs):
            g["lr"] = lr
        trainer.cfg.grpo = old_grpo


def logprob_resolver(model_run: ModelRun) -> Callable:
    """convert.Resolver: of the tokens a logprob entry's string could be, the one whose logprob
    under the trainer (its weights are the served adapter's) is the server's. Unique within the
    served-adapter check's tolerance, or an error."""
    import torch

    @torch.no_grad()
    def resolve(prefix: list, candidates: list, logprob: float, where: str) -> int:
        with model_run.using_trainer() as trainer:
            tol = 0.02 if trainer.device.type == "cpu" else 0.25
            trainer.model.eval()
            logits = trainer.model(input_ids=torch.tensor([prefix], device=trainer.device)).logits[0, -1]
            lps = torch.log_softmax(logits.float() / trainer.cfg.grpo.temperature, -1)[candidates]
            temperature = trainer.cfg.grpo.temperature
        close = [c for c, lp in zip(candidates, lps.tolist()) if abs(lp - logprob) < tol]
        if len(close) != 1:
            raise AmbiguousTokens(
                f"{where}: the server sent no token ids and {len(candidates)} tokens decode to this token's string; "
                f"{len(close)} of them have its logprob {logprob:.4f} under the trainer (was the rollout sampled at "
                f"another temperature than {temperature}?). Use model.openai_client(), which asks the "
                "server for its token ids (SGLang: extra_body={'return_meta_info': True, 'return_prompt_token_ids': "
                "True}, not with stream=True).")
        return close[0]

    return resolve
