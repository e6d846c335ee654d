"""`SGLangBackend`: ART's Backend protocol (openpipe-art 0.5.18, and 0.5.23's
`exact_adapter_lease`) over our server, trainer and loop.

For an ART user two lines change: `backend = SGLangBackend()` instead of `LocalBackend()`, and
the import. `await model.register(backend)` starts (or adopts) our SGLang server — the CPU engine
without a GPU — and the LoRA trainer for the `art.TrainableModel`: its `base_model` is the
model, its output dir (`<path>/<project>/models/<name>`) holds the run in `artsg_nb/`, so ART's
own history.jsonl and trajectory parquet files beside it stay ART's. Resuming: a run dir that
exists is resumed (its config must match: run_config.check_resumable), so
`range(await model.get_step(), N)` continues where it stopped.

Inference: `model.inference_base_url` is the server's OpenAI route (`<url>/v1`), and
`model.get_inference_name()` is `"<served model>:policy-step-N"`, the form in which SGLang's
OpenAI routes select an adapter (a bare name would fall back to the base model), always the
adapter published last. `model.openai_client()` also asks the server for its token ids on
every request with logprobs that is not streamed (the engine's `chat_token_ids`: SGLang's
`return_meta_info` and `return_prompt_token_ids`), so training never reconstructs them; a plain
`AsyncOpenAI(base_url=...)` works too (convert.py looks the tokens up; a byte-level token that
several ids decode to is resolved under the trainer's weights, or the trajectory is left out).

`await backend.train(model, groups, learning_rate=...)` converts the groups (convert.py), runs
one GRPO step through `GRPORun.train_on` — the update (grpo.py's loss, checked against TRL),
the adapter saved atomically, hot-reloaded, and checked to be the one served
(RunConfig.verify_adapter: at the first reload on a server, then every verify_every steps), one
history row — and returns a `LocalTrainResult(step, metrics, checkpoint_path)`.

Not supported (an error says so, nothing is silently ignored):
- ART's losses: `loss_fn="cispo"` (ART's default) and its knobs (advantage_balance,
  importance_sampling_level != "token", kimi_k2_tau, truncated_importance_sampling,
  kl_penalty_coef and its reference, precalculate_logprobs, ...); the loss is ours
  (GRPOConfig: DAPO-normalised PPO clip), `epsilon`/`epsilon_high` set its clip range,
  `scale_rewards`/`normalize_advantages` its reward scaling, `learning_rate` the AdamW rate.
  Leaving loss_fn out (or "ppo") is what you get.
- Trajectories without logprobs (`allow_training_without_logprobs`), replies with tool calls,
  `additional_histories`; `save_checkpoint=False` (every step's adapter is saved: it is what is
  served); SFT (`model.train_sft`), `adam_params`, `loss_fn_config`.
- Inference of older steps outside a lease: only the newest adapter is served
  (`get_inference_name(step)` for another step raises); `async with
  backend.exact_adapter_lease(model, step):` serves an older one (leases.py). Prompted
  `art.Model`s (nothing to train) are not registered.
- One run per model name; per-call overrides need a single-process trainer (trainer_ranks=1).
- `model.train(...)` is gone from ART 0.5.18; `backend.train` is the API.

One experiment of a sweep: `SGLangBackend(sweep=sweep)` with a started multi.Sweep registers each
model as an experiment of it (runs.py: SweepMember): the sweep's server and one copy of the base
model serve and train it beside the sweep's own experiments, its adapters served as
`<model name>-step-N`, its run in `<sweep run_dir>/<model name>`; `backend.close()` takes it out of
the sweep, which goes on. Its base_model must be the sweep's, its LoRA inside the sweep's (each
refused naming both); it starts at step 0 (a sweep does not resume).

What it does not do: roll out (the ART rollout function does, against our server), or keep a
loop of its own (session.GRPORun's is used; in a sweep, the experiment's).
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, AsyncIterator, Iterable

from .. import engines
from ..multi.runtime import Sweep
from ..rl.lora import checkpoint_steps, version_steps
from ..run.config import RunConfig
from .convert import to_groups
from .leases import AdapterLeases, pin, pinned_name, unpin
from .runs import ModelRun, OwnRun, SweepMember, logprob_resolver

log = logging.getLogger(__name__)

TESTED_ART_VERSIONS = ("0.5.18",)
"""openpipe-art versions this backend was tested with; another raises at register (see
ART_UNTESTED_ENV)."""
ART_UNTESTED_ENV = "ARTSG_ALLOW_UNTESTED_ART"
"""Set to 1 to register under an untested openpipe-art anyway (its private protocol may differ)."""
RUN_SUBDIR = "artsg_nb"
"""Our run directory inside the model's ART output dir."""

# LocalBackend.train's keyword arguments at their defaults (ART 0.5.18): passing one of them with
# its default value is harmless, any other value is a feature of ART's loss we do not have.
_ART_DEFAULTS = {
    "loss_fn_config": None, "adam_params": None, "kl_penalty_coef": 0.0, "kl_penalty_reference_step": None,
    "kl_ref_adapter_path": None, "advantage_balance": 0.0, "importance_sampling_level": "token",
    "max_negative_advantage_importance_sampling_weight": None, "mask_prob_ratio": False, "kimi_k2_tau": None,
    "precalculate_logprobs": False, "allow_training_without_logprobs": False, "plot_tensors": False,
    "truncated_importance_sampling": None, "scale_learning_rate_by_reward_std_dev": False,
    "num_trajectories_learning_rate_multiplier_power": 0.0, "save_checkpoint": True,
}
_NO_EFFECT = frozenset({"verbose", "logprob_calculation_chunk_size", "packed_sequence_length"})


class ArtVersionError(RuntimeError):
    """The installed openpipe-art is outside the versions SGLangBackend was tested with."""


def check_art_version() -> str:
    """The installed openpipe-art version; raises ArtVersionError outside TESTED_ART_VERSIONS."""
    try:
        installed = version("openpipe-art")
    except PackageNotFoundError as e:
        raise ArtVersionError("openpipe-art is not installed; pip install openpipe-art==0.5.18 (no extras: the "
                              "[backend] extra pins a torch of its own)") from e
    if installed not in TESTED_ART_VERSIONS and os.environ.get(ART_UNTESTED_ENV) != "1":
        raise ArtVersionError(
            f"openpipe-art {installed} is installed; SGLangBackend is tested with {', '.join(TESTED_ART_VERSIONS)} "
            f"(it implements ART's Backend protocol, which has private methods that change between releases). "
            f"Try: pip install openpipe-art=={TESTED_ART_VERSIONS[-1]}, or set {ART_UNTESTED_ENV}=1 to try anyway.")
    _undo_transformers_patch()
    return installed


def _undo_transformers_patch() -> None:
    """`import art` (0.5.18) replaces transformers' masking_utils._preprocess_mask_arguments with a
    wrapper written for transformers 5.2's signature (it adds 3-D position ids for Qwen2-VL); under
    our transformers every causal-LM forward in the kernel then fails with a TypeError. Put the
    original back when the signatures differ (we train text models only)."""
    import inspect

    from art.transformers import patches
    from transformers import masking_utils

    original = patches._preprocess_mask_arguments
    if (masking_utils._preprocess_mask_arguments is patches._patched_preprocess_mask_arguments
            and inspect.signature(original).parameters.keys()
            != inspect.signature(patches._patched_preprocess_mask_arguments).parameters.keys()):
        masking_utils._preprocess_mask_arguments = original
        log.info("undid openpipe-art's transformers masking patch (written for another transformers version)")


class SGLangBackend:
    """ART's Backend over artsg_nb: `await model.register(backend)`, then `await backend.train(...)`."""

    def __init__(self, *, path: str = ".art", config: RunConfig | None = None, sweep: Sweep | None = None):
        """`path`: ART's base path (LocalBackend's `path`). `config`: the run's settings (engine,
        LoRA rank, learning rate, GRPO loss, server args, ...); its model_path, run_dir and resume
        are set from the model at register. `sweep`: a started multi.Sweep whose server and base
        model each registered model joins as one experiment (module docstring); its server
        settings are the sweep's, `config` gives the model's LoRA, learning rate, seed and loss."""
        self._path = path
        self.config = config or RunConfig()
        self.sweep = sweep
        self._runs: dict[str, ModelRun] = {}
        self._leases: dict[str, AdapterLeases] = {}

    # ---- registration and inference ---------------------------------------------------------
    async def register(self, model) -> None:
        """Start (or adopt) the server and trainer of a TrainableModel; a second call is a no-op."""
        check_art_version()
        if not getattr(model, "trainable", False):
            raise TypeError(f"SGLangBackend trains art.TrainableModel; {type(model).__name__} {model.name!r} has "
                            "nothing to train (a prompted model needs no backend: give it inference_base_url)")
        model.base_path = self._path
        if model.name in self._runs:
            return
        if self.sweep is not None:
            run = await SweepMember.start(self.sweep, self.config, model.name, model.base_model)
        else:
            run = await OwnRun.start(self.config, model.base_model, Path(model._get_output_dir()) / RUN_SUBDIR)
        self._runs[model.name] = run
        self._leases[model.name] = AdapterLeases(run.run_dir, run.adapter_prefix)
        log.info("registered %s: run %s, serving %s", model.name, run.run_dir, run.adapter)

    async def _prepare_backend_for_training(self, model, config=None) -> tuple[str, str]:
        """(base_url, api_key) of the server's OpenAI routes; TrainableModel.register sets them."""
        if config:
            raise NotImplementedError("SGLangBackend takes server settings from RunConfig (server_args, api_key), "
                                      "not from register(_openai_client_config=...)")
        run = self._run(model)
        base_url, api_key = f"{run.client.base_url}/v1", run.api_key or "none"
        _install_openai_client(model, base_url, api_key, engines.get(run.client.engine).chat_token_ids)
        return base_url, api_key

    def _model_inference_name(self, model, step: int | None = None) -> str:
        """"<served>:<adapter>": the OpenAI model name that selects the newest adapter."""
        run = self._runs.get(model.name)
        if run is None:  # not registered (yet): ART's own fallback
            return model.name if step is None else f"{model.name}@{step}"
        leased = pinned_name(model.name, step)
        if leased is not None:
            return leased
        if step is not None and step != run.step:
            raise ValueError(f"SGLangBackend serves only the newest adapter ({run.adapter}, step {run.step}); "
                             f"step {step} is not loaded: hold `async with backend.exact_adapter_lease(model, "
                             f"{step}):` to serve it. Its files are in {run.run_dir / 'adapters'}.")
        return f"{run.client.served_model}:{run.adapter}"

    @asynccontextmanager
    async def exact_adapter_lease(self, model, step: int) -> AsyncIterator[None]:
        """Serve exactly step `step`'s adapter while the context is held (ART 0.5.23's Backend
        protocol): it is loaded again under `policy-step-N-lease` (leases.py), so training on and
        reloading newer steps meanwhile never unloads it, and `model.get_inference_name()` (with
        no step, or this one) names it inside the context. ValueError for a step without a
        saved adapter."""
        run, leases = self._run(model), self._leases[model.name]
        if not 0 <= step <= run.step:
            raise ValueError(f"step {step} of {model.name!r} does not exist (its steps: 0..{run.step})")
        client = run.client
        name = await leases.acquire(client, step)
        token = pin(model.name, step, f"{client.served_model}:{name}")
        try:
            yield
        finally:
            unpin(token)
            await leases.release(client, step)

    def adapter_lease(self, model, step: int):
        """ART's pipeline trainer holds this around a step's rollouts while later steps train: the
        same as exact_adapter_lease (our reloads unload the adapter before, so only a copy of
        its own keeps it served)."""
        return self.exact_adapter_lease(model, step)

    def run(self, model):
        """The run behind a registered model: its GRPORun (history, plots, samples, dashboard), or
        in a sweep its multi.Experiment (history, run dir, served adapter; sweep.table() and
        sweep.plot() show it beside the others)."""
        return self._run(model).run

    def _run(self, model) -> ModelRun:
        try:
            return self._runs[model.name]
        except KeyError:
            raise RuntimeError(f"model {model.name!r} is not registered: await model.register(backend) first") from None

    # ---- training ---------------------------------------------------------------------------
    async def train(self, model, trajectory_groups: Iterable, *, learning_rate: float | None = None,
                    loss_fn: str | None = None, epsilon: float | None = None, epsilon_high: float | None = None,
                    scale_rewards: bool = True, normalize_advantages: bool = True, **kwargs: Any):
        """One GRPO step on ART trajectory groups; returns art.LocalTrainResult(step, metrics,
        checkpoint_path). `learning_rate` None keeps the run's (RunConfig.learning_rate); ART's
        other arguments are refused unless at their defaults (module docstring)."""
        from art.types import LocalTrainResult

        _refuse_unsupported(loss_fn, kwargs)
        run = self._run(model)
        # on the event loop, as the rollouts that share the tokenizer are; a token without ids runs
        # the trainer's model (in a sweep that waits for another experiment's update: a rare path)
        groups = to_groups(list(trajectory_groups), run.tokenizer, run.adapter, logprob_resolver(run))
        grpo = {"scale_rewards": "group" if scale_rewards and normalize_advantages else "none"}
        if epsilon is not None:
            grpo.update(epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high)
        elif epsilon_high is not None:
            grpo["epsilon_high"] = epsilon_high
        row = await run.train_on(groups, learning_rate, grpo)
        metrics = {k: float(v) for k, v in row.items()
                   if k not in ("step", "time") and isinstance(v, (int, float)) and math.isfinite(v)}
        path = run.run_dir / "adapters" / f"policy-step-{row['step']}"
        return LocalTrainResult(step=row["step"], metrics=metrics, checkpoint_path=str(path) if path.exists() else None)

    async def _get_step(self, model) -> int:
        return self._run(model).step

    async def _delete_checkpoint_files(self, model, steps_to_keep: list[int]) -> None:
        """Delete adapter versions outside `steps_to_keep` (model.delete_checkpoints: latest and
        best); the served one, the trainer's newest, the newest complete checkpoint (what a
        resume restores) and leased ones are kept whatever the list says."""
        run = self._run(model)
        adapters = run.run_dir / "adapters"
        await asyncio.to_thread(run.wait_for_checkpoint)  # the newest checkpoint on disk (or failed) before any goes
        keep = set(steps_to_keep) | {run.step, run.served_step, *checkpoint_steps(adapters)[-1:],
                                     *self._leases[model.name].steps}
        for step in version_steps(adapters):
            if step not in keep:
                shutil.rmtree(adapters / f"policy-step-{step}", ignore_errors=True)

    def _train_sft(self, model, trajectories, config, dev_config, verbose: bool = False):
        raise NotImplementedError("SGLangBackend does not do SFT (model.train_sft); it trains with GRPO only")

    async def close(self) -> None:
        """Stop every registered model's server and trainer, or take it out of the sweep (adapters
        and history stay on disk)."""
        runs, self._runs, self._leases = list(self._runs.values()), {}, {}
        errors = []
        for run in runs:  # each one, whatever the one before raised
            try:
                await run.close()
            except Exception as e:  # noqa: BLE001 — raised after the others are closed
                errors.append(e)
        if errors:
            raise errors[0]

    async def __aenter__(self) -> "SGLangBackend":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _refuse_unsupported(loss_fn: str | None, kwargs: dict) -> None:
    if loss_fn not in (None, "ppo"):
        raise NotImplementedError(f"loss_fn={loss_fn!r}: SGLangBackend's loss is artsg_nb's GRPO (a PPO clip, "
                                  "grpo.GRPOConfig); leave loss_fn out or pass 'ppo'")
    unknown = sorted(k for k in kwargs if k not in _ART_DEFAULTS and k not in _NO_EFFECT)
    if unknown:
        raise TypeError(f"SGLangBackend.train() got unexpected keyword arguments {unknown}")
    changed = sorted(k for k, v in kwargs.items() if k in _ART_DEFAULTS and v != _ART_DEFAULTS[k])
    if changed:
        raise NotImplementedError(
            f"SGLangBackend.train does not support {', '.join(f'{k}={kwargs[k]!r}' for k in changed)} (ART's own "
            "loss options). Supported: learning_rate, epsilon, epsilon_high, scale_rewards / normalize_advantages; "
            "everything else is set once in RunConfig.grpo (grpo.GRPOConfig).")


def _install_openai_client(model, base_url: str, api_key: str, token_ids_body: dict) -> None:
    """model.openai_client() as ART builds it, its chat requests asking for the server's token ids
    (`token_ids_body`, the engine's chat_token_ids) so they come back with the logprobs
    (convert.py prefers them)."""
    try:
        from art.model import _OpenAIClientProxy
    except ImportError:  # ART's private helper moved: model.openai_client() works, without the ids
        return
    import httpx
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    raw = AsyncOpenAI(base_url=base_url, api_key=api_key,
                      http_client=DefaultAsyncHttpxClient(timeout=httpx.Timeout(timeout=1200, connect=5.0)))
    proxy = _OpenAIClientProxy(_AskingForTokenIds(raw, token_ids_body), model._record_openai_completion_costs,
                               model._default_chat_completion_extra_body())
    object.__setattr__(model, "_openai_client", proxy)


class _AskingForTokenIds:
    """An AsyncOpenAI client whose chat completions with logprobs, not streamed, carry `body` in
    their extra_body (SGLang refuses its token-id fields on a streamed request; without logprobs
    nothing is trained on). Everything else is the client's own."""

    def __init__(self, client, body: dict):
        self._client, self._body = client, dict(body)
        self.chat = _Delegate(client.chat, completions=_CompletionsAskingForTokenIds(client.chat.completions, self._body))

    def with_options(self, *args, **kwargs) -> "_AskingForTokenIds":
        return _AskingForTokenIds(self._client.with_options(*args, **kwargs), self._body)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


class _Delegate:
    """`target` with some attributes replaced."""

    def __init__(self, target, **replaced):
        self._target = target
        self.__dict__.update(replaced)

    def __getattr__(self, name: str):
        return getattr(self._target, name)


class _CompletionsAskingForTokenIds(_Delegate):
    def __init__(self, completions, body: dict):
        super().__init__(completions)
        self._body = body

    async def create(self, *args, **kwargs):
        if kwargs.get("logprobs") and not kwargs.get("stream"):
            kwargs["extra_body"] = {**self._body, **(kwargs.get("extra_body") or {})}
        return await self._target.create(*args, **kwargs)
