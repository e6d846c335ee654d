"""`TinkerService`: the Tinker API's operations on one local runtime (a trainer and an inference server).

What it does: keeps the client's sessions, its training models (one experiment of the trainer
each, named by model id), its checkpoints (`tinker://<model>/sampler_weights/<name>` and
`tinker://<model>/weights/<name>`, folders under `root`) and its sampling sessions, and runs the
operations the server's routes submit as futures:
- create_model: `trainer.add` with the client's LoRA rank and seed (inside the runtime's LoRA shape);
- forward_backward (and forward-only): `trainer.forward_backward` on multi.losses.Datums, the targets'
  logprobs and the loss back; optim_step: `trainer.optim_step` with the client's AdamParams;
- save_weights_for_sampler: `trainer.save_adapter`, then the inference server loads the adapter
  under its own name; save_weights (save_state): the adapter only (no optimizer state);
- sample: `sampler.generate` under the checkpoint's adapter (the base model for a base_model
  sampler), prompt logprobs through `sampler.score`.
Each model's operations run one after another in the order they arrive (the client sends them
in order), and trainer calls of all models one at a time in a worker thread; sampling runs
alongside. Each model keeps at most `keep_loaded` sampler adapters on the inference server (the
newest; an older one is loaded again when sampled), and unloads only its own.

What it does not do: HTTP, authentication or wire formats (server.py, wire.py); the loss math
(the trainer's); resume a model from saved state (load_weights is refused).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
import re
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..engines.base import SamplingParams
from .backend import LoraRequest, Sampler, Trainer
from .futures import Futures, RequestFailed
from .wire import (AdamParamsBody, CreateModel, CreateSamplingSession, FwdBwd, OptimStep, Sample, SaveWeights,
                   WireError, fwdbwd_output_proto, sample_response_proto, sampling_params, text_tokens)

log = logging.getLogger(__name__)

SCHEME = "tinker://"


@dataclass
class Checkpoint:
    model_id: str
    kind: str
    """"sampler_weights" or "weights"."""
    name: str
    path: Path
    adapter: str
    """The inference server's name for it (sampler weights)."""

    @property
    def tinker_path(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"


@dataclass
class Model:
    model_id: str
    session_id: str
    lora: LoraRequest
    seed: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by each training operation of this model: they run in arrival order (asyncio.Lock is FIFO)."""
    adapters: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while `loaded` changes (a load or unload on the inference server); sampling needs only this."""
    loaded: OrderedDict = field(default_factory=OrderedDict)
    """Adapter name → samples in flight under it, oldest load first."""


class TinkerService:
    """The state and operations behind the Tinker routes (see the module docstring)."""

    def __init__(self, trainer: Trainer, sampler: Sampler, base_model: str, root: str | Path, *,
                 aliases: tuple[str, ...] = (), keep_loaded: int = 2, timeout_s: float = 900.0):
        """`base_model`: the model path (also the tokenizer the client loads); `aliases`: other
        names a client may ask for it by (e.g. "HuggingFaceTB/SmolLM2-135M-Instruct").
        `keep_loaded`: sampler adapters per model kept on the inference server. `timeout_s`: each
        operation's deadline."""
        self.trainer, self.sampler, self.base_model = trainer, sampler, base_model
        self.names = {base_model, Path(base_model).name, *aliases}
        self.root = Path(root)
        self.keep_loaded = keep_loaded
        self.futures = Futures(timeout_s)
        self.sessions: dict[str, set[str]] = {}
        """Session id → its model ids."""
        self.last_seen: dict[str, float] = {}
        """Session id → time.monotonic() of its last request or heartbeat."""
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, str | None] = {}
        """Sampling session id → its checkpoint's tinker path (None: the base model)."""
        self.checkpoints: dict[str, Checkpoint] = {}
        self._ids = itertools.count(1)
        self._trainer_thread = ThreadPoolExecutor(1, thread_name_prefix="tinker-trainer")
        """Every trainer call runs on this one thread: one at a time, and torch's per-thread state
        (its intra-op pool) is set up once, not on each of asyncio's worker threads."""

    # ---- sessions and models --------------------------------------------------------------------
    def create_session(self) -> str:
        session_id = f"session-{uuid.uuid4().hex[:8]}"
        self.sessions[session_id] = set()
        self.last_seen[session_id] = time.monotonic()
        return session_id

    def check_session(self, session_id: str) -> None:
        """KeyError unless the session is live; a live one is marked as seen now (heartbeats call this)."""
        if session_id not in self.sessions:
            raise KeyError(f"session {session_id!r} is unknown to this server (it restarted, or the session finished "
                           "or went without heartbeats)")
        self.last_seen[session_id] = time.monotonic()

    async def finish_idle_sessions(self, idle_s: float) -> list[str]:
        """Finish the sessions not seen for `idle_s` (a client that died without closing: the client
        heartbeats every 10 s); their models leave the trainer. The sessions finished."""
        now = time.monotonic()
        idle = [s for s, seen in self.last_seen.items() if now - seen > idle_s]
        for session_id in idle:
            log.warning("tinker: session %s sent nothing for %.0f s; finishing it and removing its models %s",
                        session_id, now - self.last_seen[session_id], sorted(self.sessions.get(session_id, ())))
            await self.finish_session(session_id)
        return idle

    async def finish_session(self, session_id: str) -> None:
        """The client closed its ServiceClient: its models leave the trainer and the server."""
        self.last_seen.pop(session_id, None)
        for model_id in sorted(self.sessions.pop(session_id, set())):
            await self._remove_model(model_id)

    def create_model(self, body: CreateModel) -> str:
        """Submit a new experiment; the request id (its result: {"model_id"})."""
        self.check_session(body.session_id)
        self.check_base_model(body.base_model)
        if body.lora_config is None:
            raise WireError("only LoRA training is supported: pass rank= (create_lora_training_client)")
        if body.optimizer_config.type != "adamw":
            raise WireError(f"optimizer {body.optimizer_config.type!r} is not supported; supported: adamw")
        cfg = body.lora_config
        lora = LoraRequest(rank=cfg.rank, seed=cfg.seed, train_mlp=cfg.train_mlp, train_attn=cfg.train_attn,
                           train_unembed=cfg.train_unembed)
        model = Model(model_id=f"model-{uuid.uuid4().hex[:8]}", session_id=body.session_id, lora=lora,
                      seed=cfg.seed if cfg.seed is not None else random.randrange(2**31))
        self.models[model.model_id] = model
        self.sessions[body.session_id].add(model.model_id)

        async def run() -> dict:
            async with model.lock:
                try:
                    await self._on_trainer(self._add, model)
                except BaseException:  # never made: nothing to remove later
                    self.models.pop(model.model_id, None)
                    self.sessions.get(model.session_id, set()).discard(model.model_id)
                    raise
            log.info("tinker: created %s (rank %d, seed %d)", model.model_id, lora.rank, model.seed)
            return {"model_id": model.model_id, "type": "create_model"}

        return self.futures.submit(run, f"create_model {model.model_id}")

    def _add(self, model: Model) -> None:
        self.trainer.add(model.model_id, model.lora.spec(self.trainer.lora), 1e-4, model.seed)

    def check_base_model(self, name: str) -> None:
        if name not in self.names:
            raise WireError(f"base_model {name!r} is not served here; this runtime trains and samples "
                            f"{self.base_model!r} (also known as {sorted(self.names - {self.base_model})})")

    def model(self, model_id: str) -> Model:
        try:
            return self.models[model_id]
        except KeyError:
            raise KeyError(f"model {model_id!r} is unknown to this server (created elsewhere, or its session "
                           "finished)") from None

    def info(self, model_id: str) -> dict:
        """GetInfoResponse: the base model is also the tokenizer the client loads."""
        model = self.model(model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": model.lora.rank,
                "model_name": self.base_model,
                "model_data": {"model_name": self.base_model, "tokenizer_id": self.base_model}}

    # ---- training -------------------------------------------------------------------------------
    def forward_backward(self, req: FwdBwd) -> str:
        model = self.model(req.model_id)

        async def run() -> bytes:
            async with model.lock:
                if req.forward_only:
                    out = await self._on_trainer(self._forward, model.model_id, req)
                else:
                    out = await self._on_trainer(self.trainer.forward_backward, model.model_id, req.data, req.loss_fn)
            return _fwdbwd_result(out, req)

        what = f"{'forward' if req.forward_only else 'forward_backward'} of {model.model_id}"
        return self.futures.submit(run, what, dedupe=(model.model_id, req.seq_id) if req.seq_id else None)

    def _forward(self, name: str, req: FwdBwd) -> dict:
        """Forward only: the targets' logprobs (trainer.score of each datum's sequence)."""
        logprobs = []
        for i, d in enumerate(req.data):
            d.check("cross_entropy", i)
            logprobs.append(list(self.trainer.score(name, d.sequence())))
        loss = -sum(w * lp for d, lps in zip(req.data, logprobs) for w, lp in zip(d.weights, lps))
        return {"loss": loss, "logprobs": logprobs}

    def optim_step(self, body: OptimStep) -> str:
        model = self.model(body.model_id)
        if body.optimizer_params is not None or body.adam_params is None:
            raise WireError("only AdamParams are supported by optim_step (the model's optimizer is adamw)")
        adam: AdamParamsBody = body.adam_params
        if adam.grad_clip_norm:
            raise WireError(f"AdamParams.grad_clip_norm={adam.grad_clip_norm} is not supported; leave it at 0.0")

        async def run() -> dict:
            async with model.lock:
                out = await self._on_trainer(self.trainer.optim_step, model.model_id, learning_rate=adam.learning_rate,
                                             betas=(adam.beta1, adam.beta2), eps=adam.eps,
                                             weight_decay=adam.weight_decay)
            return {"metrics": _floats(out), "type": "optim_step"}

        dedupe = (model.model_id, body.seq_id) if body.seq_id else None
        return self.futures.submit(run, f"optim_step of {model.model_id}", dedupe=dedupe)

    async def _on_trainer(self, fn: Callable, *args, **kwargs):
        """`fn` on the trainer's thread, one call at a time (the experiments time-share it)."""
        def call():
            try:
                return fn(*args, **kwargs)
            except (ValueError, NotImplementedError) as e:  # the request asked for what cannot be done
                raise RequestFailed(f"{type(e).__name__}: {e}") from e
        return await asyncio.get_running_loop().run_in_executor(self._trainer_thread, call)

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_weights(self, body: SaveWeights, kind: str) -> str:
        """save_weights_for_sampler (kind "sampler_weights") or save_weights ("weights")."""
        model = self.model(body.model_id)
        name = body.path or f"ephemeral-{body.sampling_session_seq_id}-{body.seq_id}"
        if body.path is None and (kind == "weights" or body.sampling_session_seq_id is None):
            raise WireError("save_weights needs a path (the checkpoint's name)")
        key = f"{SCHEME}{model.model_id}/{kind}/{name}"
        if key in self.checkpoints:
            raise WireError(f"checkpoint {key} exists already; save under another name")
        ckpt = Checkpoint(model.model_id, kind, name, self.root / model.model_id / kind / name,
                          adapter=_adapter_name(model.model_id, name))

        async def run() -> dict:
            async with model.lock:
                await self._on_trainer(self.trainer.save_adapter, model.model_id, ckpt.path)
            self.checkpoints[key] = ckpt
            if kind == "weights":
                return {"path": key, "type": "save_weights"}
            async with model.adapters:
                await self._load(model, ckpt)
            result = {"path": key, "type": "save_weights_for_sampler"}
            if body.path is None:  # save_weights_and_get_sampling_client: a sampler comes with it
                result["sampling_session_id"] = self.create_sampler(model.session_id, model_path=key)
            return result

        dedupe = (model.model_id, body.seq_id) if body.seq_id else None
        return self.futures.submit(run, f"save {key}", dedupe=dedupe)

    async def _load(self, model: Model, ckpt: Checkpoint) -> None:
        """Load `ckpt` on the inference server, unloading this model's idle adapters beyond
        keep_loaded (the caller holds model.adapters)."""
        if ckpt.adapter in model.loaded:
            model.loaded.move_to_end(ckpt.adapter)
            return
        model.loaded[ckpt.adapter] = 0
        try:
            await self.sampler.load_adapter(ckpt.adapter, str(ckpt.path.resolve()))
        except BaseException:
            model.loaded.pop(ckpt.adapter, None)
            raise
        idle = [name for name, users in model.loaded.items() if users == 0 and name != ckpt.adapter]
        for name in idle[:max(0, len(model.loaded) - self.keep_loaded)]:
            del model.loaded[name]
            await self.sampler.unload_adapter(name)

    async def _remove_model(self, model_id: str) -> None:
        model = self.models.pop(model_id, None)
        if model is None:
            return
        async with model.lock, model.adapters:
            for name in list(model.loaded):
                try:
                    await self.sampler.unload_adapter(name)
                except Exception as e:  # the model goes anyway; the server may have lost it already
                    log.warning("tinker: unloading %s of %s: %s", name, model_id, e)
            model.loaded.clear()
            await self._on_trainer(self.trainer.remove, model_id)
        log.info("tinker: removed %s", model_id)

    # ---- sampling -------------------------------------------------------------------------------
    def create_sampler(self, session_id: str, model_path: str | None = None, base_model: str | None = None) -> str:
        if (model_path is None) == (base_model is None):
            raise WireError("a sampling client needs exactly one of model_path and base_model")
        if base_model is not None:
            self.check_base_model(base_model)
        else:
            self.checkpoint(model_path)
        sampler_id = f"sampler-{next(self._ids)}"
        self.samplers[sampler_id] = model_path
        return sampler_id

    def create_sampling_session(self, body: CreateSamplingSession) -> str:
        self.check_session(body.session_id)
        return self.create_sampler(body.session_id, body.model_path, body.base_model)

    def sampler_info(self, sampler_id: str) -> dict:
        if sampler_id not in self.samplers:
            raise KeyError(f"sampler {sampler_id!r} is unknown to this server")
        return {"sampler_id": sampler_id, "base_model": self.base_model, "model_path": self.samplers[sampler_id]}

    def checkpoint(self, tinker_path: str) -> Checkpoint:
        ckpt = self.checkpoints.get(tinker_path)
        if ckpt is None or ckpt.kind != "sampler_weights":
            known = sorted(k for k, c in self.checkpoints.items() if c.kind == "sampler_weights")[-5:]
            raise WireError(f"model_path {tinker_path!r} is not a sampler checkpoint of this server (save one with "
                            f"save_weights_for_sampler); newest known: {known}")
        return ckpt

    def sample(self, body: Sample) -> tuple[str, list[str]]:
        """Submit a sample request; (request id, one sequence id per sample)."""
        if body.sampling_session_id is not None:
            if body.sampling_session_id not in self.samplers:
                raise KeyError(f"sampling session {body.sampling_session_id!r} is unknown to this server")
            path = self.samplers[body.sampling_session_id]
        elif body.model_path is not None:
            path = body.model_path
        else:
            self.check_base_model(body.base_model or "")
            path = None
        ckpt = self.checkpoint(path) if path is not None else None
        params, tokens = sampling_params(body), text_tokens(body.prompt.chunks, "prompt")
        run_id = next(self._ids)

        async def run() -> bytes:
            return await self._sample(ckpt, tokens, params, bool(body.prompt_logprobs))

        request_id = self.futures.submit(run, f"sample from {path or self.base_model}")
        return request_id, [f"seq-{run_id}-{j}" for j in range(body.num_samples)]

    async def _sample(self, ckpt: Checkpoint | None, tokens: list[int], params: SamplingParams,
                      prompt_logprobs: bool) -> bytes:
        model = self.models.get(ckpt.model_id) if ckpt else None
        if ckpt is not None and model is None:
            raise RequestFailed(f"{ckpt.tinker_path}: its training model is gone (its session finished)")
        if model is not None:
            async with model.adapters:  # loaded again if it was unloaded
                await self._load(model, ckpt)
                model.loaded[ckpt.adapter] += 1
        adapter = ckpt.adapter if ckpt else None
        try:
            gens = await self.sampler.generate(tokens, params, adapter=adapter)
            scored = [None, *await self.sampler.score(tokens, adapter=adapter)] if prompt_logprobs else None
        finally:
            if model is not None and ckpt.adapter in model.loaded:
                model.loaded[ckpt.adapter] -= 1
        seqs = [("length" if g.finish_reason == "length" else "stop", g.output_ids, g.logprobs) for g in gens]
        if any(g.finish_reason == "abort" for g in gens):
            raise RequestFailed("the inference server aborted the request (see its log)")
        return sample_response_proto(seqs, scored)


def _fwdbwd_result(out: dict, req: FwdBwd) -> bytes:
    logprobs = out.get("logprobs")
    per_datum = {"logprobs": logprobs} if logprobs is not None else {}
    metrics = {"loss:sum": float(out.get("loss", 0.0))}
    metrics.update({f"{k.replace(':', '_')}:mean": v for k, v in _floats(out).items() if k != "loss"})
    return fwdbwd_output_proto(per_datum, len(req.data), metrics)


def _floats(out: dict) -> dict[str, float]:
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _adapter_name(model_id: str, name: str) -> str:
    return "tinker-" + re.sub(r"[^A-Za-z0-9_-]", "_", f"{model_id}-{name}")
