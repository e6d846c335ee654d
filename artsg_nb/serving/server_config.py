"""What a server is before it runs: its configuration, command line and environment (pure).

What it does: `ServerConfig` (engine, model, LoRA pool, memory, API key, extra flags, ...; save
with `asdict`, vary with `dataclasses.replace`), and the pure functions server.py launches with:
`build_command` (the engine's flags from its EngineSpec, never the API key), `build_env` (the
server's whole environment: the kernel's cleaned, GPU plan, engine switches, the key), `with_env_args`
($ARTSG_SGLANG_ARGS / $ARTSG_VLLM_ARGS), `resolve_api_key` ("auto" → a fresh random key),
`config_hash` (what identifies a running server), and `check_model_path` (a local path that is
not a model directory is refused before anything is launched). Unit-tested without launching.

What it does not do: launch, watch or stop anything (server.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Mapping

from .. import engines
from ..engines.base import ADMIN_TIMEOUT_S
from .server_env import child_env, server_args

if TYPE_CHECKING:
    from .gpus import GpuPlan

log = logging.getLogger(__name__)

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Words in the log tail of a failed start → what to try. The first one means the port was taken.


class ServerError(RuntimeError):
    """Base class of the server lifecycle errors."""


class ModelPathError(ServerError):
    """model_path is a local path but not a model directory (checked before launch)."""


@dataclass
class ServerConfig:
    """How to launch one inference server. Save with `asdict`, vary with `dataclasses.replace`."""
    engine: Literal["sglang", "vllm", "cpu"]
    """"sglang" (production), "vllm" (the baseline) or "cpu" (python -m artsg_nb.cpu_engine)."""
    model_path: str
    """Base model directory or hub id; also the served model name the client sends."""
    run_dir: str | os.PathLike
    """The log (`<engine>.log`) and the pid record (`<engine>.server.json`) go here."""
    host: str = "127.0.0.1"
    """Interface to bind; keep 127.0.0.1 unless the server must be reachable from elsewhere."""
    port: int | None = None
    """TCP port; None picks a free one. A given port that is busy raises PortInUseError."""
    python: str | None = None
    """Interpreter of the server environment; None: found by server_env.find_server_env."""
    max_lora_rank: int = 16
    """Largest LoRA rank the server accepts (vLLM: one of 1, 8, 16, 32, 64, 128, 256, 320, 512)."""
    lora_target_modules: tuple[str, ...] = TARGET_MODULES
    """Modules adapters may target (SGLang and the CPU engine; vLLM takes all it supports)."""
    max_loras_per_batch: int = 4
    """Adapters in one batch (SGLang --max-loras-per-batch, vLLM --max-loras)."""
    mem_fraction: float | None = None
    """Share of the GPU's total memory for weights + KV cache (vLLM --gpu-memory-utilization; SGLang
    --mem-fraction-static, re-expressed at launch over the memory free then, because SGLang counts
    from that: EngineSpec.mem_fraction_of); None takes gpu_plan.server_mem_fraction, else the
    engine default."""
    gpu_plan: "GpuPlan | None" = None
    """A gpus.GpuPlan: gives the server its CUDA_VISIBLE_DEVICES. None inherits the kernel's."""
    api_key: str | None = "auto"
    """Bearer token the server requires, sent by the client. "auto": a random one per start;
    None: no authentication (a warning: any local user could drive the server, and SGLang's
    adapter-from-tensors route unpickles what it is sent). Passed by environment, never argv."""
    enable_memory_saver: bool = False
    """Let the client release/resume the server's GPU memory around training (one shared GPU):
    SGLang --enable-memory-saver (needs torch_memory_saver in its environment), vLLM
    --enable-sleep-mode, CPU engine --enable-memory-saver."""
    enable_weights_cpu_backup: bool = False
    """SGLang/CPU --enable-weights-cpu-backup: keep a host copy of the base weights, so that
    releasing "weights" does not lose them (vLLM's sleep always keeps one)."""
    schedule_policy: str | None = None
    """SGLang --schedule-policy (e.g. "lpm", "fcfs"); None: SGLang's default."""
    disable_radix_cache: bool = False
    """Turn prefix caching off (SGLang/CPU --disable-radix-cache, vLLM --no-enable-prefix-caching)."""
    prompt_warm_up: str = "auto"
    """How the client sends the n copies of a group's prompt where SGLang's native n > 1 is unsafe
    under an adapter (sglang#36894): "always" after a warm-up request that caches the prompt (every
    copy reads it from the cache: the hit rate shows it), "never" prefilled together (nothing to
    reuse: hit rate 0), "auto" after a warm-up only where the prefill it saves costs more than its
    round trip (engines.sglang.WARM_UP_FROM_FLOP: a 1.5B model's prompts of 50+ tokens, any 7B
    prompt; never for the tiny model or SmolLM2's short prompts). A client option: the server is
    the same either way."""
    extra_args: tuple[str, ...] = ()
    """Appended to the command line, e.g. ("--attention-backend", "triton") for the GPU bundle."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for the server process only."""
    startup_timeout_s: float | None = None
    """Seconds to wait for /health; None: 600 for sglang/vllm (first start compiles), 120 for cpu."""
    admin_timeout_s: float = ADMIN_TIMEOUT_S
    """Seconds an admin call (adapter load/unload, memory release/resume, flush) may take before its
    client raises AdminTimeoutError naming it (engines.base.ADMIN_TIMEOUT_S)."""
    _command_override: tuple[str, ...] | None = field(default=None, repr=False)
    """Tests only: the command to run instead, with {python}, {host}, {port} filled in."""

    def __post_init__(self):
        if self.engine not in engines.ENGINES:
            raise ValueError(f"engine={self.engine!r}; use one of {', '.join(engines.ENGINES)}")
        self._spec = engines.get(self.engine)  # looked up once, then carried (`spec`)
        self.model_path = os.fspath(self.model_path)
        self.lora_target_modules = tuple(self.lora_target_modules)
        self.extra_args = tuple(str(a) for a in self.extra_args)
        self.env = dict(self.env)
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} must be ≥ 1")
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise ValueError(f"mem_fraction={self.mem_fraction} must be in (0, 1)")
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"port={self.port} is not a TCP port")
        if self.api_key is None:
            log.warning("api_key=None: the %s server will answer any local user without a key "
                        "(on a shared machine they can load adapters, read prompts, or worse); "
                        "leave api_key='auto' unless something else guards the port", self.engine)
        elif not self.api_key.strip() or any(c.isspace() for c in self.api_key):
            raise ValueError("api_key must be 'auto', None, or a key without spaces")
        self.spec.validate(self)

    @property
    def spec(self) -> engines.EngineSpec:
        """The engine's launch, environment and metrics facts, looked up once when the config is
        made (engines.get) and carried from there: to the environment search, the command line,
        the client."""
        return self._spec

    @property
    def timeout_s(self) -> float:
        return self.startup_timeout_s if self.startup_timeout_s is not None else self.spec.startup_timeout_s

    def resolved_mem_fraction(self) -> float | None:
        """mem_fraction, else the GPU plan's; None for the CPU engine."""
        if "mem_fraction" in self.spec.ignored_options:  # the CPU engine
            return None
        if self.mem_fraction is not None:
            return self.mem_fraction
        return getattr(self.gpu_plan, "server_mem_fraction", None)


def with_env_args(cfg: ServerConfig) -> ServerConfig:
    """`cfg` with extra_args from $ARTSG_SGLANG_ARGS / $ARTSG_VLLM_ARGS when it has none (an
    offline GPU bundle's backends); the one place that decides, for GRPORun, bench and tools."""
    extra = server_args(cfg.spec, cfg.extra_args)
    return cfg if extra == cfg.extra_args else replace(cfg, extra_args=extra)


def resolve_api_key(cfg: ServerConfig) -> str | None:
    """The key a start uses: a fresh random one for "auto", else cfg.api_key."""
    return secrets.token_urlsafe(32) if cfg.api_key == "auto" else cfg.api_key


def build_command(cfg: ServerConfig, python: str | None = None, port: int | None = None) -> list[str]:
    """The server's command line (never the API key). `python`/`port` default to the config's."""
    python = python or cfg.python or (sys.executable if cfg.spec.python_var is None else "python")
    port = port or cfg.port
    if port is None:
        raise ValueError("build_command needs a port: set cfg.port or pass port=")
    if cfg._command_override:
        return [a.format(python=python, host=cfg.host, port=port) for a in cfg._command_override]
    run = ["-c", cfg.spec.launcher] if cfg.spec.launcher else ["-m", cfg.spec.entry]
    return [python, *run, *cfg.spec.launch_args(cfg, port), *cfg.extra_args]


def ignored_options(cfg: ServerConfig) -> list[str]:
    """Options the engine has no flag for (logged, not fatal: they only tune performance)."""
    return [name for name in cfg.spec.ignored_options if getattr(cfg, name)]


def build_env(cfg: ServerConfig, extra_env: Mapping[str, str] | None = None,
              api_key: str | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server process's whole environment, built here only: `base` (the kernel's os.environ)
    cleaned for the engine's interpreter (`child_env`), then the GPU plan, the engine's switches,
    the server environment's `extra_env` and `cfg.env`, later ones winning; `api_key` (resolved:
    not "auto") in the engine's key variable, and without one no key variable at all (a key left
    in the kernel's environment would lock this run out of its own server)."""
    env = {"PYTHONUNBUFFERED": "1"}  # the log tail shows the latest lines, not a stale buffer
    if cfg.gpu_plan is not None:
        env.update(cfg.gpu_plan.server_env())
    env.update(cfg.spec.server_env)
    env.update(extra_env or {})
    env.update(cfg.env)
    env = child_env(cfg.spec, env, os.environ if base is None else base)
    if cfg.spec.api_key_env:
        env.pop(cfg.spec.api_key_env, None)
        if api_key:
            env[cfg.spec.api_key_env] = api_key
    return env


CLIENT_OPTIONS = ("startup_timeout_s", "admin_timeout_s", "prompt_warm_up")
"""ServerConfig fields that only the kernel side reads: a live server started with other values
serves a config that differs only in these (start_server hands it back with the new values)."""


def config_hash(cfg: ServerConfig) -> str:
    """Hash of what shapes the running server (not the start-up timeout, not GPU memory readings,
    not the client's options)."""
    d = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in CLIENT_OPTIONS + ("gpu_plan",)}
    d["run_dir"] = str(Path(cfg.run_dir).resolve())
    plan = cfg.gpu_plan
    d["gpu_plan"] = None if plan is None else [plan.server_env(), getattr(plan, "server_mem_fraction", None)]
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def server_url(host: str, port: int | None) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


# What every engine reads from a model directory (save_pretrained writes all three).
_MODEL_FILES = {"config.json": ("config.json",),
                "weights (*.safetensors)": ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf"),
                "tokenizer (tokenizer.json or tokenizer_config.json)": ("tokenizer.json", "tokenizer_config.json",
                                                                        "tokenizer.model", "vocab.json")}


def check_model_path(model_path: str) -> None:
    """Refuse, before anything is launched, a local model_path that is not a model directory (an
    engine would fail only after loading for a minute). Hub ids ("org/name") are the engine's
    business."""
    path = Path(model_path).expanduser()
    what = ("A model directory holds config.json, the weights (*.safetensors) and the tokenizer "
            "files (tokenizer.json / tokenizer_config.json), as save_pretrained writes them")
    looks_local = path.is_absolute() or model_path.startswith((".", "~")) or model_path.count("/") > 1
    if not path.exists():
        if looks_local:
            raise ModelPathError(f"model_path {model_path} does not exist. {what}; a hub id such as "
                                 "Qwen/Qwen2.5-0.5B-Instruct is downloaded by the engine instead.")
        return
    if not path.is_dir():
        raise ModelPathError(f"model_path {model_path} is a file, not a model directory. {what}.")
    missing = [name for name, patterns in _MODEL_FILES.items()
               if not any(next(path.glob(p), None) for p in patterns)]
    if missing:
        raise ModelPathError(f"model_path {model_path} is not a model directory: it has no "
                             f"{', no '.join(missing)}. {what}. Try: point model_path at the directory "
                             "you saved the model to (artsg_nb.default_model_dir() builds a tiny one).")
