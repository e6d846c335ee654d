"""What one GRPO run is: `RunConfig`, and the config.json a run directory keeps of it.

What it does: the dataclass a notebook fills in (a docstring under each field; derive variants
with `dataclasses.replace`), its JSON record (`config_record`, written to `<run_dir>/config.json`
by every run, the API key left out) and the check that a resumed run computes what the original
would have (`check_resumable` names every field that changed).

What it does not do: run anything (session.py), or hold the checks a config passes when built
(config_checks.py: names, types, ranges, settings that cannot work together).
"""
from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

from ..engines import memory_tags
from ..engines.base import ADMIN_TIMEOUT_S
from ..models.tiny import is_tiny_build
from ..rl.grpo import GRPOConfig
from ..serving.gpus import GpuInfo, list_gpus
from ..serving.memory_estimate import ColocatedFit, ModelMemory, colocated_fit
from ..tasks.registry import NOT_IMPORTABLE, Task, UnknownTaskError, get_task, task_spec
from .config_checks import ConfigError, check_config  # noqa: F401  (ConfigError: public here too)

TINY_MODEL_LEARNING_RATE = 3e-3
"""learning_rate=None on the offline tiny model (both demo tasks climb from ~0.4-0.5 to ~0.85 in
10 steps of 8x8 on CPU)."""
REAL_MODEL_LEARNING_RATE = 2e-4
"""learning_rate=None on any other model: a LoRA rate for models of real size (~1e-5 to 1e-4 is
the usual full-finetuning range; LoRA takes larger steps)."""


def learning_rate(rate: float | None, model_dir) -> float:
    """`rate` (RunConfig.learning_rate), or when None the default for the model at model_dir: the
    tiny model's (a directory the tiny-model build made) or a real one's."""
    if rate is not None:
        return rate
    return TINY_MODEL_LEARNING_RATE if is_tiny_build(model_dir) else REAL_MODEL_LEARNING_RATE


@dataclass
class RunConfig:
    """Everything one GRPO run needs; derive variants with `dataclasses.replace`."""

    task: str | Task = "addition"
    """A registered task name (`python -m artsg_nb.train --list-tasks`), a `Task` object (e.g.
    `Task.from_dataset(...)`), or "package.module:ATTR" naming a Task in an importable module."""
    engine: str = "auto"
    """"auto" (SGLang with a GPU, the CPU engine without), "sglang", "vllm" or "cpu"."""
    model_path: str | None = None
    """Base model: a directory, a hub id (e.g. "Qwen/Qwen2.5-0.5B-Instruct", fetched by the engine
    and transformers where a hub is reachable), or a model artsg_nb builds offline
    ("smollm2-135m-instruct", `python -m artsg_nb.models --list`); None builds the offline tiny
    model. Exports name this (a built model by its hub id) as their base."""
    run_dir: str = "runs/quickstart"
    """Adapters, checkpoints, history and server logs go here."""
    group_size: int = 8
    """G: completions per prompt (the GRPO group); at least 1, and 1 is warned about (no
    other completion to compare with: every advantage is 0)."""
    groups_per_step: int = 8
    """Prompts per step."""
    max_new_tokens: int | None = None
    """Per turn; None uses the task's own limit (0 is refused: it read as "the task's limit")."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scores with the same one."""
    learning_rate: float | None = None
    """AdamW learning rate of the LoRA weights. None follows the model: 3e-3
    (TINY_MODEL_LEARNING_RATE) for the offline tiny model (model_path None, or a directory the
    tiny-model build made), 2e-4 (REAL_MODEL_LEARNING_RATE) for any other model_path."""
    lora_rank: int = 16
    """LoRA rank (the server is started with --max-lora-rank equal to it)."""
    lora_alpha: int = 32
    """LoRA alpha."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """Loss variant, clipping, KL and IS correction."""
    schedule: str = "auto"
    """Rollout submission (see rollout.py): "auto" (`resolve_schedule`: "n" for single-turn tasks,
    "prefix" for multi-turn), "prefix" (group leader first), "naive", "n", ... Every schedule
    draws the same samples (rollout.py, "Seeds"), so it may change on resume."""
    prompt_warm_up: str = "auto"
    """Whether each group's prompt is cached by a warm-up request before its G copies are sampled
    (SGLang under an adapter; ServerConfig.prompt_warm_up): "auto" where it pays for itself, "always"
    (the hit rate shows every copy reading the prompt from the cache), "never"."""
    concurrency: int = 64
    """Requests in flight at once."""
    max_seq_tokens: int = 2048
    """Longest trajectory; longer ones are truncated and masked."""
    micro_batch_tokens: int | None = None
    """Trainer token budget per forward/backward; None: sized from the free GPU memory at each
    update (TrainerConfig.micro_batch_tokens), 8192 on a CPU."""
    seed: int = 0
    """Seeds prompts, sampling and LoRA initialisation."""
    max_restarts: int = 2
    """Server restarts allowed per run when it dies; 0 raises at once."""
    hang_timeout_s: float = 60.0
    """A server that answers neither /health nor anything else for this long during a step (hung,
    SIGSTOPped, deadlocked) is killed and restarted like one that died, and the step's server work
    redone; 0 turns the watchdog off (then only the 600 s per-request timeout is left)."""
    admin_timeout_s: float = ADMIN_TIMEOUT_S
    """Seconds an admin call may take — adapter load/unload, memory release/resume, cache flush,
    server info, metrics; each takes well under a second on a healthy server: past it the call fails
    naming the operation, and the server is restarted and the step redone like after a crash
    (SGLang 0.5.14's stuck unload, sglang#36894). 0: no own limit (the 600 s request timeout)."""
    reward_timeout_s: float = 120.0
    """Seconds one call of the task's own code may take — `env.reset`, `env.step`, a reward
    function of a dataset task, `Task.group_reward`: past it the episode (or the group's reward)
    fails naming the function, and the step goes on without it (a step where every episode failed
    stops, naming the cause). Synchronous functions run in a worker thread so that a hung one can
    be left behind; 0 waits for ever. Operational: may change on resume."""
    resume: bool = False
    """Continue from the newest complete checkpoint in run_dir."""
    verify_adapter: bool = True
    """After a reload, check the served adapter's logprobs against the trainer's (one scoring
    request to the server and one forward pass of the trainer on a probe trajectory); a mismatch
    stops the step with AdapterMismatchError. When: see verify_every."""
    verify_every: int = 10
    """Check the served adapter (verify_adapter) at the first reload on each server (after start,
    adoption and every restart: where a wrong or stale adapter would come from) and then every
    `verify_every` steps; 1: after every reload. The check is a round trip plus a trainer forward
    on the critical path of every step it runs in (12 % of a CPU-engine step of the tiny model,
    tools/gpu/step_profile.py); a row without it has probe_mad None."""
    release_memory: bool | str = "if_needed"
    """Give the server's GPU memory back while the trainer runs, and take it again before the
    reload (client.release_memory; the server is started with the memory saver). True, False,
    "auto" (on when server and trainer share one GPU: colocated plan; off on CPU and on split GPUs),
    or "if_needed" (the default): on where they share one GPU and the model would not fit it twice
    beside a KV cache and the trainer's activations (serving.memory_estimate, from the model
    directory's config.json), off otherwise; where releasing the KV cache and CUDA graphs is not
    enough it adds "weights" to release_tags (a 14B in bf16 on an 80 GB GPU; a warning says so).
    A model that does not fit even so stops the run before the server starts, with the memory it
    needs and what to change.
    SGLang needs torch_memory_saver in its environment (sglang pins it). Costs release_s + resume_s
    per step; the prefix cache it flushes is per adapter anyway, so no hits are lost; it buys
    nothing while the trainer fits beside the server. Measured on one H200 (GPU memory in use as
    training starts 72.8 → 8.2 GiB, step times with and without the saver): benchmarks/results/HISTORY.md and
    benchmarks/results/20261203-h200-gpu-tests.md."""
    release_tags: tuple[str, ...] = ("kv_cache", "cuda_graph")
    """What to release (engines.MEMORY_TAGS). With "weights" the server also keeps a host
    copy of the base weights (--enable-weights-cpu-backup); without one they would be lost."""
    server_args: tuple[str, ...] = ()
    """Extra command-line flags for the server; empty takes $ARTSG_SGLANG_ARGS / $ARTSG_VLLM_ARGS
    (e.g. the attention/sampling backends an offline GPU bundle needs). CLI: one quoted string,
    --server-args "--attention-backend triton"."""
    api_key: str | None = "auto"
    """The server's API key (server.ServerConfig.api_key): "auto" a random one per start, None
    none (warned: any local user could drive the server)."""
    num_servers: int = 1
    """Inference servers. Above 1 they run behind sglang-router (fleet.py): a group's samples
    stay on one server's prefix cache, every adapter version is loaded on all of them before it
    is used, a dead one is restarted (or dropped once max_restarts is spent). CPU: N CPU engines;
    one GPU: N servers share it (memory fraction 0.70 / N each); several GPUs: one GPU each
    (gpus.plan_gpus). History gains worker_hit_rates and worker_prompt_tokens."""
    trainer_ranks: int = 1
    """Trainer processes (torch.distributed data parallel, distributed.RankedTrainer): the
    kernel is rank 0 and starts the others; each computes its share of the batch and the LoRA
    gradients are summed, so the update is the one-process one. GPUs: one each, split plan
    only; CPU: processes with gloo. Logs in run_dir/trainer-rank<r>.log."""
    verbose: bool = True
    """Print one progress line per step."""
    print_samples: int = 0
    """With verbose: after each step's line, print this many of its completions (one per group,
    shortened to a line each, with reward, reward parts and finish reason; 0: none). Every
    completion is saved whole in run_dir/rollouts (run.show_samples(k) shows them)."""
    eval_every: int = 0
    """Evaluate the served adapter after every Nth step (0: never) on held-out prompts
    (evaluate.py); the step's history row gets eval_reward and eval_pass_at_k. Eval never trains."""
    eval_n: int = 16
    """Prompts per evaluation (greedy, one answer each)."""
    keep_adapters: int = 0
    """Keep only the newest K adapter versions on disk (0: keep all), plus every `keep_every`-th,
    the served one and the newest resumable checkpoint (retention.py)."""
    keep_every: int = 0
    """With keep_adapters: also keep every Mth step's version (0: none extra)."""
    pipeline: bool = False
    """Overlap rollouts with training, one step off-policy (pipeline.py): step n+1's rollouts are
    sampled on the server, under the newest published adapter, while the trainer updates on step
    n's; the adapter is reloaded once both are done. Each step from the second trains on rollouts
    one adapter version old (history column `staleness`), corrected by importance sampling against
    the server's logprobs: grpo.is_mode None becomes "token_truncate" (TRL's truncated IS, capped
    at grpo.is_clip_max). Same prompts and seeds as a synchronous run. Gains up to
    min(rollout_s, train_s) per step where server and trainer do not share the compute (a GPU
    each; little on a few CPU cores). Not with release_memory. The first step of a run, or of a
    resumed one, rolls out synchronously."""
    report_to: tuple[str, ...] = ()
    """Trackers that get every history row: "wandb", "trackio", "tensorboard", "mlflow"
    (trackers.py; each is optional and imported only when named here)."""

    def __post_init__(self) -> None:
        check_config(self)  # names, types, ranges, eval_every's split: before any server starts
        if isinstance(self.verify_every, bool) or not isinstance(self.verify_every, int) or self.verify_every < 1:
            raise ValueError(f"verify_every={self.verify_every!r}: use a whole number of steps >= 1 (1: check the "
                             "served adapter after every reload). To turn the check off, use verify_adapter=False.")


CONFIG_FILE = "config.json"
"""The run's RunConfig as JSON, in run_dir (the API key is never written)."""
_OPERATIONAL = frozenset({"resume", "verbose", "print_samples", "trainer_ranks", "max_restarts", "hang_timeout_s", "admin_timeout_s",
                          "reward_timeout_s", "verify_adapter", "verify_every", "concurrency",
                          "api_key", "server_args", "release_memory", "release_tags", "run_dir", "schedule", "prompt_warm_up",
                          "eval_every", "eval_n", "keep_adapters", "keep_every", "report_to",
                          "micro_batch_tokens"})
"""Fields that change how a run is operated, not what it computes: a resumed run may change them
(micro_batch_tokens: the update is the same in any micro-batches, and since it may be None, sized
at every update from free memory, runs saved with 8192 resume under the new default)."""


def resolve_schedule(schedule: str, max_turns: int) -> str:
    """The submission schedule a run uses: "auto" is "n" (one n=G request per group: the shared
    prompt is prefilled once, no streaming, no leader/follower round trip; fastest on SGLang,
    vLLM and the CPU engine at the same hit rate, benchmarks/results/20261203-0525-*.csv; on
    SGLang under an adapter sent as a warm-up plus one balanced batch, sglang#36894) for
    single-turn tasks, "prefix" for multi-turn ones (later turns extend each episode's own
    history); any other value is used as given."""
    if schedule != "auto":
        return schedule
    return "n" if max_turns == 1 else "prefix"


class ConfigMismatchError(ValueError):
    """resume=True with a configuration that differs from the one the run was started with."""


def config_record(cfg: RunConfig) -> dict:
    """`cfg` as the JSON-able dict saved in run_dir/config.json (tuples as lists, no API key).

    `task` is recorded as a spec another process can load (`tasks.resolve_task`): the string as
    given, or for a Task object "module:ATTR" when an importable module holds it, or its registered
    name when it is one of this package's (`tasks.task_spec`). A Task object defined in a notebook or
    `__main__`, registered there or not, is not importable: the record
    keeps its name and adds `"task_note": "not importable"`, so the run says which task it was
    but cannot be started again from config.json alone."""
    spec, note = task_spec(cfg.task)
    record = json.loads(json.dumps(asdict(replace(cfg, task=spec)), default=str))
    if note == NOT_IMPORTABLE:
        record["task_note"] = NOT_IMPORTABLE
    record.pop("api_key", None)
    return record


def check_resumable(saved: dict, cfg: RunConfig) -> None:
    """Raise ConfigMismatchError naming every field (other than operational ones) that differs."""
    now = config_record(cfg)
    changed = [f"{name}: {saved.get(name)!r} → {now.get(name)!r}" for name in sorted(_compared(saved, now))
               if saved.get(name) != now.get(name)]
    if changed:
        raise ConfigMismatchError(
            f"resume=True, but the configuration differs from the one this run was started with "
            f"({CONFIG_FILE} in {cfg.run_dir}): " + "; ".join(changed) + ". A resumed run must compute "
            "what the original would have. Try: resume with the saved values "
            "(RunConfig(**json.load(open(path)))), or start a new run in another run_dir.")


def _compared(saved: dict, now: dict) -> set[str]:
    """The fields check_resumable compares: all but the operational ones. `task_note` too, but
    for a record from before the note existed (it has none) of a task no package task is named
    like, resumed with a task that is not importable: that run's task was one defined outside the
    package, so only the note is new. A package task's name without a note stays ambiguous (the
    built-in, or a notebook's task of that name) and is refused."""
    names = (set(saved) | set(now)) - _OPERATIONAL
    if ("task_note" not in saved and now.get("task_note") == NOT_IMPORTABLE
            and not _is_package_task(str(saved.get("task")))):
        names.discard("task_note")
    return names


def _is_package_task(name: str) -> bool:
    """Whether `name` is one of this package's tasks (task_spec records it by name alone)."""
    try:
        return task_spec(get_task(name)) == (name, None)
    except UnknownTaskError:
        return False


@dataclass(frozen=True)
class Release:
    """resolve_release's answer: whether the server's memory is released around each update, and what."""

    on: bool
    tags: tuple[str, ...]
    """engines.MEMORY_TAGS released: cfg.release_tags, with "weights" added where the default
    (release_memory="if_needed") finds the model fits the shared GPU only so."""
    why: str = ""
    """The memory estimate, where it decided (ColocatedFit.describe)."""


def resolve_release(cfg: RunConfig, mode: str, gpus: Sequence[GpuInfo] | None = None,
                    model_dir: str | None = None) -> Release:
    """cfg.release_memory → Release ("auto": on only when server and trainer share one GPU;
    "if_needed": when they share one and the model does not fit it without, releasing the server's
    weights too where the KV cache and CUDA graphs are not enough). On a shared GPU a model that
    does not fit as configured raises ModelTooLargeError here, before anything starts. `gpus`
    default to list_gpus(), `model_dir` to cfg.model_path where that is a directory (a name still
    to be built or a hub id is not estimated)."""
    memory_tags(cfg.release_tags)  # a typo fails before anything is launched
    if cfg.release_memory not in (True, False, "auto", "if_needed"):
        raise ValueError(f"release_memory={cfg.release_memory!r}; use True, False or 'auto' "
                         "(or 'if_needed', the default: only where the model would not fit without)")
    fit = _colocated_fit(cfg, gpus, model_dir) if mode == "colocated" else None
    if cfg.release_memory == "auto":
        release = mode == "colocated"
    elif cfg.release_memory == "if_needed":
        release = fit is not None and not fit.fits(False)
    else:
        release = cfg.release_memory
    tags = tuple(cfg.release_tags)
    if (cfg.release_memory == "if_needed" and release and "weights" not in tags
            and not fit.fits(True) and fit.fits(True, True)):
        tags = (*tags, "weights")
    weights = "weights" in tags
    if fit is not None and not fit.fits(release, weights):
        raise fit.error(release, weights, str(cfg.model_path))
    if release and cfg.pipeline:
        why = " (the model does not fit the shared GPU without it)" if cfg.release_memory == "if_needed" else ""
        raise ValueError(f"pipeline=True with release_memory={cfg.release_memory!r}{why} (resolved on: {mode} plan): "
                         "the server cannot give its GPU memory back while it samples the next step's rollouts during "
                         "the update. Use one of them: release_memory=False to pipeline, or pipeline=False to release.")
    return Release(bool(release), tags, fit.describe() if fit is not None else "")


def _colocated_fit(cfg: RunConfig, gpus: Sequence[GpuInfo] | None, model_dir: str | None) -> ColocatedFit | None:
    """The memory estimate of cfg's model on the one shared GPU; None where it cannot be made (no
    GPU read, no model directory, several servers sharing the GPU)."""
    path = model_dir or (cfg.model_path if cfg.model_path and Path(cfg.model_path).is_dir() else None)
    gpus = list_gpus() if gpus is None and path else gpus
    model = ModelMemory.from_dir(path, cfg.lora_rank) if path else None
    if model is None or not gpus or cfg.num_servers > 1:
        return None
    return colocated_fit(model, gpus[0], micro_batch_tokens=cfg.micro_batch_tokens)


def glue_flag_values(argv: Sequence[str], names: Sequence[str]) -> list[str]:
    """`--name VALUE` → `--name=VALUE` for the flags in `names` whose value is itself server flags
    ("--attention-backend triton"): the CLI parser would take such a VALUE for an option."""
    out, it = [], iter(argv)
    for arg in it:
        if arg in names:
            value = next(it, None)
            out.append(arg if value is None else f"{arg}={value}")
        else:
            out.append(arg)
    return out


def split_flags(values: Sequence[str]) -> tuple[str, ...]:
    """Server flags given as quoted strings ("--attention-backend triton") as argv items, split
    as a shell would."""
    return tuple(part for value in values for part in shlex.split(value))
