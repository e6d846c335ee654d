"""The client interface a run holds: what the run, the rollouts and the watchdog call on a client.

What it does: `InferenceClient` declares, as a typing.Protocol, the members a run uses of its
client: sampling (generate, chat), scoring (the served-adapter check), adapter loads and unloads,
cache flushes, memory release/resume around training, health, metrics, server info, closing, and
the few attributes read (engine, base_url, served_model, in_flight). Each engine's client
(EngineClient's dialects) and serving.fleet.FleetClient (router + workers) implement every member
themselves (tests/test_fleet_unit.py holds both to this list), so nothing reaches a client's
members by forwarding.

What it does not: implement anything (engines/base.py and the dialects, serving/fleet.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .base import FirstTokenHook, Generation, SamplingParams


@runtime_checkable
class InferenceClient(Protocol):
    """A client of one server, or of a fleet behind a router, as a run uses it."""

    engine: str
    """The engine's name ("sglang", "vllm", "cpu"): which metrics names it exports."""
    base_url: str
    served_model: str
    in_flight: int
    """Generation requests sent and not yet answered (the health watchdog's sign of work)."""

    async def generate(self, input_ids: list[int], params: "SamplingParams | None" = None,
                       adapter: str | None = None, on_first_token: "FirstTokenHook | None" = None,
                       ) -> "list[Generation]": ...
    async def chat(self, messages: list[dict], params: "SamplingParams | None" = None,
                   adapter: str | None = None, logprobs: bool = True, **extra) -> dict: ...
    async def score(self, input_ids: list[int], adapter: str | None = None,
                    temperature: float = 1.0) -> list[float]: ...
    async def load_adapter(self, name: str, path: str) -> float: ...
    async def unload_adapter(self, name: str) -> None: ...
    async def list_adapters(self) -> dict[str, str]: ...
    async def flush_cache(self, timeout_s: float | None = None) -> None: ...
    async def check_memory_saver(self, tags: Iterable[str] = ...) -> None: ...
    async def release_memory(self, tags: Iterable[str] = ..., idle_timeout_s: float = 60.0) -> float: ...
    async def resume_memory(self) -> float: ...
    async def health(self, timeout_s: float = 30.0) -> bool: ...
    async def metrics_text(self) -> str: ...
    async def server_info(self) -> dict: ...
    async def aclose(self) -> None: ...


CLIENT_MEMBERS = ("engine", "base_url", "served_model", "in_flight", "generate", "chat", "score", "load_adapter",
                  "unload_adapter", "list_adapters", "flush_cache", "check_memory_saver", "release_memory",
                  "resume_memory", "health", "metrics_text", "server_info", "aclose")
"""InferenceClient's members by name, for the test that holds each client class to them."""
