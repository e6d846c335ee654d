"""What one GRPO run is: `RunConfig`, and the config.json a run directory keeps of it.

What it does: the dataclass a notebook fills in (a docstring under each field; derive variants
with `dataclasses.replace`), its JSON record (`config_record`, written to `<run_dir>/config.json`
by every run, the API key left out) and the check that a resumed run computes what the original
would have (`check_resumable` names every field that changed).

What it does not do: run anything (session.py).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .grpo import GRPOConfig


@dataclass
class RunConfig:
    """Everything one GRPO run needs; derive variants with `dataclasses.replace`."""

    task: str = "addition"
    """Task name (`python -m artsg_nb.train --list-tasks`)."""
    engine: str = "auto"
    """"auto" (SGLang with a GPU, the CPU engine without), "sglang", "vllm" or "cpu"."""
    model_path: str | None = None
    """Base model directory; None builds the offline tiny model."""
    run_dir: str = "runs/quickstart"
    """Adapters, checkpoints, history and server logs go here."""
    group_size: int = 8
    """G: completions per prompt (the GRPO group)."""
    groups_per_step: int = 8
    """Prompts per step."""
    max_new_tokens: int | None = None
    """Per turn; None uses the task's own limit."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scores with the same one."""
    learning_rate: float = 3e-3
    """AdamW learning rate of the LoRA weights. The default suits the offline tiny model (both
    demo tasks climb from ~0.4-0.5 to ~0.85 in 10 steps of 8x8 on CPU); models of real size
    want ~1e-5 to 1e-4."""
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
    concurrency: int = 64
    """Requests in flight at once."""
    max_seq_tokens: int = 2048
    """Longest trajectory; longer ones are truncated and masked."""
    micro_batch_tokens: int = 8192
    """Trainer token budget per forward/backward."""
    seed: int = 0
    """Seeds prompts, sampling and LoRA initialisation."""
    max_restarts: int = 2
    """Server restarts allowed per run when it dies; 0 raises at once."""
    resume: bool = False
    """Continue from the newest complete checkpoint in run_dir."""
    verify_adapter: bool = True
    """After each reload, check the served adapter's logprobs against the trainer's."""
    release_memory: bool | str = False
    """Give the server's GPU memory back while the trainer runs, and take it again before the
    reload (client.release_memory; the server is started with the memory saver). True, False,
    or "auto": on when server and trainer share one GPU (colocated plan), off on CPU and on
    split GPUs. SGLang needs torch_memory_saver in its environment (sglang pins it). Costs
    release_s + resume_s per step; the prefix cache it flushes is per adapter anyway, so no hits
    are lost. Off by default: it buys nothing while the trainer fits beside the server; "auto" is
    the setting to try when the trainer runs short of memory on one GPU. Measured on one H200
    (GPU memory in use as training starts 72.8 → 8.2 GiB, step times with and without the
    saver): README "Results" and benchmarks/results/20261203-h200-gpu-tests.md."""
    release_tags: tuple[str, ...] = ("kv_cache", "cuda_graph")
    """What to release (client_memory.MEMORY_TAGS). With "weights" the server also keeps a host
    copy of the base weights (--enable-weights-cpu-backup); without one they would be lost."""
    server_args: tuple[str, ...] = ()
    """Extra command-line flags for the server; empty takes $ARTSG_SGLANG_ARGS / $ARTSG_VLLM_ARGS
    (e.g. the attention/sampling backends an offline GPU bundle needs)."""
    api_key: str | None = None
    """Sent to the server (SGLang --api-key) and by the client."""
    verbose: bool = True
    """Print one progress line per step."""


CONFIG_FILE = "config.json"
"""The run's RunConfig as JSON, in run_dir (the API key is never written)."""
_OPERATIONAL = frozenset({"resume", "verbose", "max_restarts", "verify_adapter", "concurrency", "api_key",
                          "server_args", "release_memory", "release_tags", "run_dir", "schedule"})
"""Fields that change how a run is operated, not what it computes: a resumed run may change them."""


def resolve_schedule(schedule: str, max_turns: int) -> str:
    """The submission schedule a run uses: "auto" is "n" (one n=G request per group: the shared
    prompt is prefilled once, no streaming, no leader/follower round trip; fastest on SGLang,
    vLLM and the CPU engine at the same hit rate, benchmarks/results/20261203-0525-*.csv) for
    single-turn tasks, "prefix" for multi-turn ones (later turns extend each episode's own
    history); any other value is used as given."""
    if schedule != "auto":
        return schedule
    return "n" if max_turns == 1 else "prefix"


class ConfigMismatchError(ValueError):
    """resume=True with a configuration that differs from the one the run was started with."""


def config_record(cfg: RunConfig) -> dict:
    """`cfg` as the JSON-able dict saved in run_dir/config.json (tuples as lists, no API key)."""
    record = json.loads(json.dumps(asdict(cfg), default=str))
    record.pop("api_key", None)
    return record


def check_resumable(saved: dict, cfg: RunConfig) -> None:
    """Raise ConfigMismatchError naming every field (other than operational ones) that differs."""
    now = config_record(cfg)
    changed = [f"{name}: {saved.get(name)!r} → {now.get(name)!r}" for name in sorted(set(saved) | set(now))
               if name not in _OPERATIONAL and saved.get(name) != now.get(name)]
    if changed:
        raise ConfigMismatchError(
            f"resume=True, but the configuration differs from the one this run was started with "
            f"({CONFIG_FILE} in {cfg.run_dir}): " + "; ".join(changed) + ". A resumed run must compute "
            "what the original would have. Try: resume with the saved values "
            "(RunConfig(**json.load(open(path)))), or start a new run in another run_dir.")
