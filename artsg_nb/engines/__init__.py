"""Every difference between the inference engines, one module per engine.

What it does: `get(name)` returns an engine's `EngineSpec` — its client class (the HTTP
dialect), how its server is launched, where its Python environment is found, which Prometheus
counters hold its prefix-cache hit rate; `make_client` builds the client for a running server.
The engines: "sglang" (production, sglang.py), "vllm" (the baseline, vllm.py) and "cpu" (the CPU
engine, cpu.py, which speaks SGLang's API). Engine-neutral parts — `EngineClient`,
`SamplingParams`, `Generation`, the errors, the HTTP/SSE transport — are in base.py and errors.py;
`InferenceClient` (interface.py) declares what a run calls on a client, a fleet's included.

What it does not do: start processes (server.py), find environments (server_env.py) or compute
hit rates (metrics.py); those read the specs.
"""
from __future__ import annotations

from . import cpu, sglang, vllm
from .base import (DEFAULT_TAGS, MEMORY_TAGS, EngineClient, Generation, SamplingParams, memory_tags,
                   run_sync)
from .errors import (AdapterExistsError, AdapterRankError, EngineError, MemorySaverError, ServerUnavailableError,
                     UnknownAdapterError)
from .interface import InferenceClient
from .sglang import SGLangClient
from .spec import EngineSpec
from .vllm import VLLMClient

_SPECS = {spec.name: spec for spec in (sglang.SPEC, vllm.SPEC, cpu.SPEC)}
ENGINES = tuple(_SPECS)
"""Engine names: "sglang", "vllm", "cpu"."""

__all__ = ["ENGINES", "get", "make_client", "EngineSpec", "EngineClient", "InferenceClient", "SGLangClient", "VLLMClient",
           "SamplingParams", "Generation", "run_sync", "MEMORY_TAGS", "DEFAULT_TAGS", "memory_tags",
           "EngineError", "AdapterExistsError", "AdapterRankError", "UnknownAdapterError",
           "ServerUnavailableError", "MemorySaverError"]


def get(name: str) -> EngineSpec:
    """The spec of engine `name`; ValueError names the known ones."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}: expected one of {', '.join(map(repr, ENGINES))}") from None


def make_client(engine: str | EngineSpec, base_url: str, served_model: str, api_key: str | None = None,
                timeout_s: float = 600.0, prompt_warm_up: str = "auto", **kwargs) -> EngineClient:
    """The client for a running `engine` server (its spec, or its name) at `base_url` serving
    `served_model`; `prompt_warm_up` ("auto", "always", "never"): see ServerConfig.prompt_warm_up."""
    if prompt_warm_up not in PROMPT_WARM_UPS:
        raise ValueError(f"prompt_warm_up={prompt_warm_up!r}: expected one of {', '.join(PROMPT_WARM_UPS)}")
    spec = get(engine) if isinstance(engine, str) else engine
    client = spec.client_class(base_url, served_model, api_key=api_key, timeout_s=timeout_s, **kwargs)
    client.engine = spec.name  # the CPU engine speaks SGLang's dialect under its own name
    client.lora_n_problem = spec.lora_n_problem
    client.warm_up_from_flop = spec.warm_up_from_flop
    client.native_n = spec.native_n
    client.prompt_warm_up = prompt_warm_up
    return client


PROMPT_WARM_UPS = ("auto", "always", "never")
"""Values of ServerConfig.prompt_warm_up / RunConfig.prompt_warm_up."""
