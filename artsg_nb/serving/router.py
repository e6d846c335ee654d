"""Start and stop SGLang's router (sglang-router / sgl-model-gateway) in front of N engine servers.

What it does: `start_router(worker_urls, run_dir)` launches `python -m sglang_router.launch_router`
(the Rust router, pip package `sglang-router`, pinned in environment-train.yml) as a subprocess of
the kernel, in its own process group, bound to 127.0.0.1 on a free port, output to
`<run_dir>/router.log`, recorded on disk like a server (procs.ProcessRecord, engine "router") so
that `reap_orphans` stops it when its kernel dies. It waits until GET /readiness reports every
worker healthy, watching the process, and raises with the log tail when it does not. The
returned `Router` has `.url` (give it to `client.make_client("sglang", router.url, ...)`),
`.workers`, `.metrics_url` (the router's own Prometheus port), `.alive()`, `.log_tail()` and an
idempotent `.stop()` (SIGTERM the group, wait, SIGKILL); it is a context manager.

Facts about sglang-router 0.3.2 this module relies on (docs/scale-out.md says how each was found):
/health answers 200 as soon as the router listens, before any worker is registered, so
readiness is /readiness (`{"healthy_workers": n, "total_workers": n}`); POST /generate with
`input_ids`, `lora_path`, `n`, `return_logprob` is forwarded as is and the worker's meta_info
(cached_tokens) comes back intact; with `--api-key K` the router checks `Authorization: Bearer K`
on its own routes (not /health, /readiness) and forwards the header, so workers take the same key.

What it does not: start the engines (server.py), or reach the workers' control routes. The
router answers 404 to /load_lora_adapter, /unload_lora_adapter and /metrics on its main port, so
the toolkit loads every adapter version on each worker directly and scrapes each worker's
/metrics for the hit rate (per worker: the router keeps a group's samples on one worker).
"""
from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

from ..engines.spec import key_launcher
from ..files import log_tail
from . import managed, procs
from .managed import ManagedProcess

log = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
ENGINE_NAME = "router"  # the record's engine field: <run_dir>/router.server.json, router.log


class RouterError(RuntimeError):
    """The router exited during start-up, or did not see every worker healthy in time."""


DEFAULT_CACHE_THRESHOLD = 0.9
"""cache_aware's --cache-threshold. SGLang's 0.3 sends every GRPO prompt to one engine: prompts that
share the chat template match the first worker's tree above 0.3, and load balancing starts only
at 64 requests of imbalance (measured: a 2-engine CPU run, 16 samples a step, all on engine 0,
hit rate 0.77; at 0.9 both engines worked, hit rates 0.75 and 0.80). A group's later samples match
fully (1.0), so they still follow the first one."""


API_KEY_ENV = "ARTSG_ROUTER_API_KEY"
"""The router's key travels in its environment, never its argv (/proc/<pid>/cmdline is world-readable)."""
# sglang_router parses sys.argv in-process (the Rust router is an extension module, not a child
# process), so the key is appended to sys.argv inside the process, where no other user sees it.
LAUNCHER = key_launcher("sglang_router.launch_router", API_KEY_ENV)


def build_router_command(worker_urls: Sequence[str], port: int, metrics_port: int, policy: str = "cache_aware",
                         python: str | None = None, host: str = "127.0.0.1", extra_args: Sequence[str] = (),
                         cache_threshold: float = DEFAULT_CACHE_THRESHOLD) -> list[str]:
    """The router's command line, without its API key (pure: unit-testable without launching)."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}; use one of {', '.join(POLICIES)}")
    if not worker_urls:
        raise ValueError("the router needs at least one worker URL")
    cmd = [python or sys.executable, "-c", LAUNCHER, "--host", host, "--port", str(port),
           "--worker-urls", *worker_urls, "--policy", policy, "--cache-threshold", f"{cache_threshold:g}",
           # its Prometheus port defaults to 0.0.0.0:29000: one per user and machine at most
           "--prometheus-host", host, "--prometheus-port", str(metrics_port),
           # SIGTERM waits this long for in-flight requests (default 180 s, longer than stop's wait)
           "--shutdown-grace-period-secs", "5", "--log-level", "info"]
    return cmd + [str(a) for a in extra_args]


@dataclass(eq=False)  # identity, so that a set can hold it
class Router(ManagedProcess):
    """One router process in front of `workers`. Use `start_router` to get a started one. Its
    lifecycle (spawn, record, live set, ready-wait, log tail, stop) is managed.ManagedProcess's."""
    workers: list[str]
    run_dir: Path
    policy: str = "cache_aware"
    api_key: str | None = None
    host: str = "127.0.0.1"
    startup_timeout_s: float = 60.0
    extra_args: tuple[str, ...] = ()
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD
    port: int | None = None
    metrics_port: int | None = None
    proc: object = field(default=None, repr=False)
    record: procs.ProcessRecord | None = field(default=None, repr=False)
    _log_offset: int = field(default=0, repr=False)
    _seen: object = field(default=None, repr=False)  # the last /readiness answer (for the error)

    @property
    def label(self) -> str:
        return ENGINE_NAME

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """The router's own Prometheus metrics (smg_*: requests, worker selection), not the engines'."""
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path:
        return Path(self.run_dir).resolve() / f"{ENGINE_NAME}.log"

    def start(self) -> "Router":
        """Launch and wait until every worker is healthy behind it; returns self."""
        if self.alive():
            return self
        self.stop(timeout_s=5)
        procs.reap_orphans()
        self.port = procs.pick_free_port(self.host)
        self.metrics_port = procs.pick_free_port(self.host)
        cmd = build_router_command(self.workers, self.port, self.metrics_port, self.policy,
                                   host=self.host, extra_args=self.extra_args, cache_threshold=self.cache_threshold)
        env = {**os.environ, **({API_KEY_ENV: self.api_key} if self.api_key else {})}
        self._spawn(cmd, env, port=self.port, host=self.host, engine=ENGINE_NAME,
                    shown=["<launcher>" if a == LAUNCHER else a for a in cmd])  # no key: never adopted
        try:
            self._seen = None
            self._poll_ready(self.startup_timeout_s)
        except BaseException:
            self.stop(timeout_s=5)
            raise
        return self

    def log_tail(self, n: int = 20) -> str:
        """The last `n` lines this start wrote to the log."""
        # our own readiness polls would fill the tail: keep what the router did
        tail = log_tail(self.log_path, n, since=self._log_offset, keep=lambda ln: "uri=/readiness" not in ln)
        return _ANSI.sub("", tail)  # the router colours its log even into a file

    def _ready(self, http) -> bool:
        """GET /readiness reports every worker healthy."""
        try:
            resp = http.get(f"{self.url}/readiness")
        except httpx.HTTPError:
            return False  # not listening yet
        is_json = resp.headers.get("content-type", "").startswith("application/json")
        self._seen = resp.json() if is_json else resp.text
        return resp.status_code == 200 and _healthy(self._seen) >= len(self.workers)

    def _exit_error(self, code: int, elapsed_s: float) -> RouterError:
        return RouterError(f"the router exited with code {code} {elapsed_s:.1f} s into "
                           f"start-up on {self.url}. Try: run the command by hand (first line of "
                           f"the log). Last 20 lines of {self.log_path}:\n{self.log_tail(20)}")

    def _not_ready_error(self, timeout_s: float) -> RouterError:
        return RouterError(
            f"the router on {self.url} did not see all {len(self.workers)} workers healthy after "
            f"{timeout_s:.0f} s (last /readiness: {self._seen}). Try: check each worker "
            f"answers GET /health ({', '.join(self.workers)}), and that api_key matches theirs. "
            f"Last 20 lines of {self.log_path}:\n{self.log_tail(20)}")


def _healthy(readiness) -> int:
    return int(readiness.get("healthy_workers", 0)) if isinstance(readiness, dict) else 0


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def start_router(worker_urls: Sequence[str], run_dir: str | os.PathLike, policy: str = "cache_aware",
                 api_key: str | None = None, startup_timeout_s: float = 60.0,
                 extra_args: Sequence[str] = (), cache_threshold: float = DEFAULT_CACHE_THRESHOLD) -> Router:
    """Start a router in front of `worker_urls` (running engine servers, e.g. `[s.url for s in servers]`)
    and wait until it sees them all healthy. `api_key`: the workers' key; clients send it to the
    router, which checks it and forwards it. `cache_threshold`: see DEFAULT_CACHE_THRESHOLD.
    `extra_args` go to launch_router as they are, e.g. ("--balance-abs-threshold", "16")."""
    router = Router(workers=[u.rstrip("/") for u in worker_urls], run_dir=Path(run_dir), policy=policy,
                    api_key=api_key, startup_timeout_s=startup_timeout_s, extra_args=tuple(extra_args),
                    cache_threshold=cache_threshold)
    return router.start()


def stop_all() -> None:
    """Stop every router this process started."""
    managed.stop_all(Router)
