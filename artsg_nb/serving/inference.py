"""The one interface a run holds its inference side by, and the one function that starts it.

What it does: `InferenceServer` declares what a run uses of a server: lifecycle (restart, stop,
kill), health (alive, stopped), a client, the log for error messages and, for a fleet of several
servers behind a router, dropping dead workers and per-worker figures (one `Server` has none: it
answers False and {}). `Server` and `Fleet` both satisfy it, so nothing above asks which it holds.
`start_inference(config, plan, run_dir)` starts one server, or N behind sglang-router when the GPU
plan has several.

What it does not do: launch processes itself (server.py, fleet.py) or speak HTTP (engines/).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from ..engines import InferenceClient
from .fleet import Fleet, fleet_configs
from .gpus import GpuPlan
from .server import ServerConfig, start_server


@runtime_checkable
class InferenceServer(Protocol):
    """A server, or a fleet of them behind a router, as a run sees it."""

    @property
    def config(self) -> ServerConfig: ...
    @property
    def url(self) -> str: ...
    @property
    def log_path(self) -> Path: ...
    @property
    def proc(self): ...

    def alive(self) -> bool: ...
    def stopped(self) -> bool: ...
    def kill(self) -> None: ...
    def restart(self) -> "InferenceServer": ...
    def stop(self, timeout_s: float = 10.0) -> None: ...
    def client(self) -> InferenceClient: ...
    def log_tail(self, n: int = 20) -> str: ...

    def drop_dead(self) -> bool:
        """Go on without the dead workers (True), or not (False: none dead, none would remain, or one server)."""

    def worker_stats(self) -> dict[str, list]:
        """Per-worker history columns of this step ({} for one server)."""


def start_inference(config: ServerConfig, plan: GpuPlan, run_dir: Path) -> InferenceServer:
    """One server, or `plan.num_servers` engines behind sglang-router looking like one server."""
    if plan.num_servers > 1:
        return Fleet(fleet_configs(config, plan), run_dir).start()
    return start_server(config)
