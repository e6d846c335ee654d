"""N engine servers behind sglang-router, looking to a run like one server.

What it does: `start_fleet(configs, run_dir)` starts one server per `ServerConfig` (each with its
own run_dir, GPUs and memory fraction) and, above one, `router.start_router` in front of them
(cache-aware: a group's samples follow its first one onto one worker's radix cache). A `Fleet`
has the handful of `server.Server` methods GRPORun uses (`alive`, `restart`, `client`, `stop`,
`log_tail`, `log_path`, `proc`, `config`), so the session holds it where it held the server:

  - `client()` is a `FleetClient`: generation and scoring go through the router; adapter loads
    and unloads, cache flushes, memory release/resume fan out to every worker and return only
    when all have answered, so a version is used only once every worker serves it (the router
    does not forward /load_lora_adapter); `metrics_text()` scrapes every worker and returns one
    text whose prompt/cached counters are the sums (monotonic across worker restarts), for the
    dashboard's cumulative hit rate;
  - `restart()` restarts only the dead workers (same port when free, else the router is
    restarted with the new URLs) and the router if it died; a worker that will not start again
    is dropped with a warning while one remains (`drop_dead()` drops without trying);
  - `worker_stats()`: per worker, the hit rate and prompt tokens between the last two scrapes
    (the session scrapes once a step, beside the reload, so a window is one step's rollouts
    plus the probe or an evaluation beside them): history columns
    `worker_hit_rates`, `worker_prompt_tokens`.

With one config no router is started and `client()` is that server's own client.

What it does not: start servers on other nodes (docs/scale-out.md says how to point a router at
them), balance by itself (the router does), or know about GRPO.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from .. import engines
from . import procs
from ..engines import AdapterExistsError, Generation, SamplingParams, UnknownAdapterError
from ..engines.base import FirstTokenHook
from ..engines.interface import InferenceClient
from .metrics import CacheCounters, cache_counters, hit_rate, progress_tokens
from .router import Router, start_router
from .server import Server, ServerConfig, ServerError, resolve_api_key

log = logging.getLogger(__name__)


@dataclass
class _Counters:
    """One worker's counters made monotonic across its restarts (a restart resets them to 0)."""
    offset: CacheCounters = CacheCounters(0.0, 0.0)
    last_raw: CacheCounters = CacheCounters(0.0, 0.0)
    history: list = field(default_factory=list)  # monotonic CacheCounters per scrape (the last two kept)

    def add(self, raw: CacheCounters) -> CacheCounters:
        if raw.prompt_tokens < self.last_raw.prompt_tokens:  # the worker restarted
            self.offset = _plus(self.offset, self.last_raw)
        self.last_raw = raw
        value = _plus(self.offset, raw)
        self.history = (self.history + [value])[-2:]
        return value


def _plus(a: CacheCounters, b: CacheCounters) -> CacheCounters:
    return CacheCounters(a.prompt_tokens + b.prompt_tokens, a.cached_tokens + b.cached_tokens)


class Fleet:
    """Servers (`.servers`) and, above one, the router (`.router`) in front of them."""

    def __init__(self, configs: Sequence[ServerConfig], run_dir: str | Path, policy: str = "cache_aware",
                 router_timeout_s: float = 60.0):
        if not configs:
            raise ValueError("a fleet needs at least one server config")
        self.servers = [Server(c) for c in configs]
        self.api_key: str | None = None
        """The key the router and every worker take (one "auto" key drawn per fleet, or the
        adopted workers' own after a kernel restart)."""
        self.run_dir = Path(run_dir)
        self.policy = policy
        self.router_timeout_s = router_timeout_s
        self.router: Router | None = None
        self.dropped: list[Server] = []
        self._counters = {id(s): _Counters() for s in self.servers}

    # ---- what GRPORun uses of a Server -------------------------------------------------------
    @property
    def config(self) -> ServerConfig:
        return self.servers[0].config

    @property
    def url(self) -> str:
        return self.router.url if self.router is not None else self.servers[0].url

    @property
    def proc(self):
        """The process of the first dead worker (else the router's, else worker 0's): for messages."""
        dead = self.dead()
        if dead:
            return dead[0].proc
        return self.router.proc if self.router is not None and not self.router.alive() else self.servers[0].proc

    @property
    def log_path(self) -> Path:
        dead = self.dead()
        if not dead and self.router is not None and not self.router.alive():
            return self.router.log_path
        return (dead or self.servers)[0].log_path

    def log_tail(self, n: int = 20) -> str:
        dead = self.dead()
        if not dead and self.router is not None and not self.router.alive():
            return self.router.log_tail(n)
        return (dead or self.servers)[0].log_tail(n)

    def alive(self) -> bool:
        """Every worker and the router running."""
        return not self.dead() and (self.router is None or self.router.alive())

    def dead(self) -> list[Server]:
        return [s for s in self.servers if not s.alive()]

    def stopped(self) -> bool:
        """A worker or the router stopped (SIGSTOP): the fleet answers no request through it."""
        return any(s.stopped() for s in self.servers) or (self.router is not None and self.router.stopped())

    def kill(self) -> None:
        """SIGKILL the stopped workers and the router if stopped (every worker and the router
        when none is, so a fleet that stopped answering is restarted); `restart` starts them again."""
        router_hung = self.router is not None and self.router.stopped()
        hung = [s for s in self.servers if s.stopped()] or ([] if router_hung else self.servers)
        for server in hung:
            server.kill()
        if self.router is not None and (router_hung or hung == self.servers):
            self.router.kill()

    def start(self) -> "Fleet":
        """Adopt the workers a dead kernel left running (after a kernel restart: no cold
        start), launch the others with the same key, then start a router in front of them.
        Workers on different GPUs start side by side; workers sharing a GPU one after another
        (gpu_lanes), so each measures the memory the ones before it took."""
        try:
            self._adopt_workers()
            procs.reap_orphans()  # the dead kernels' other servers and router, now that ours are owned
            lanes = gpu_lanes(self.servers)
            with ThreadPoolExecutor(len(lanes)) as pool:  # each waits for its /health: minutes on a GPU
                for future in [pool.submit(_start_in_turn, lane) for lane in lanes]:
                    future.result()
            self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self) -> "Fleet":
        """Restart the dead workers (a worker that fails to start is dropped while others remain)
        and the router when it died or a worker's URL changed."""
        urls = [s.url for s in self.servers]
        for s in self.dead():
            log.warning("worker %s is dead (%s); restarting it", s.url, s.log_path)
            try:
                s.restart()
            except ServerError as e:
                if len(self.servers) - len(self.dead()) < 1 or len(self.servers) == 1:
                    raise
                log.warning("worker %s did not restart (%s); dropping it", s.url, e)
                self._drop(s)
        if self.router is not None and (not self.router.alive() or [s.url for s in self.servers] != urls):
            self.router.stop(timeout_s=5)
            self._start_router()
        return self

    def drop_dead(self) -> bool:
        """Drop the dead workers (no restart), restarting the router over the rest; False when
        none would remain (or none is dead)."""
        dead = self.dead()
        if not dead or len(dead) == len(self.servers):
            return False
        for s in dead:
            log.warning("dropping dead worker %s; %d remain. Last lines of %s:\n%s", s.url,
                        len(self.servers) - 1, s.log_path, s.log_tail(10))
            self._drop(s)
        if self.router is not None:
            self.router.stop(timeout_s=5)
            self._start_router()
        return True

    def client(self) -> InferenceClient:
        """The run's client: the one server's, or a FleetClient (router + every worker)."""
        if self.router is None and len(self.servers) == 1 and not self.dropped:
            return self.servers[0].client()
        cfg = self.config
        front = engines.make_client(cfg.spec, self.url, cfg.model_path, api_key=self.api_key,
                                    admin_timeout_s=cfg.admin_timeout_s, prompt_warm_up=cfg.prompt_warm_up)
        workers = [s.client() for s in self.servers]
        front.info_source = workers[0]  # which engine serves the router's requests (sglang.lora_n_problem)
        return FleetClient(self, front, workers)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the router, then every worker (by process group). Safe to call again."""
        if self.router is not None:
            self.router.stop(timeout_s=timeout_s)
        for s in self.servers + self.dropped:
            s.stop(timeout_s=timeout_s)

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<Fleet {len(self.servers)} × {self.config.engine} behind {self.url} ({'up' if self.alive() else 'degraded'})>"

    # ---- per-worker figures ----------------------------------------------------------------
    def record(self, server: Server, raw: CacheCounters) -> CacheCounters:
        return self._counters[id(server)].add(raw)

    def worker_stats(self) -> dict[str, list]:
        """Per worker (in `servers` order): hit rate and prompt tokens between the last two scrapes."""
        rates, tokens = [], []
        for s in self.servers:
            h = self._counters[id(s)].history
            if len(h) < 2:
                rates.append(None)
                tokens.append(None)
                continue
            rates.append(hit_rate(h[0], h[1]))
            tokens.append(h[1].prompt_tokens - h[0].prompt_tokens)
        return {"worker_hit_rates": rates, "worker_prompt_tokens": tokens}

    # ---- internals ------------------------------------------------------------------------------
    def _adopt_workers(self) -> None:
        """One by one (adopting one would reap the others as orphans), the workers whose dead
        kernel's server is still up; they fix the fleet's key, which every launch then takes.
        An adopted worker holding another key than the first is stopped and launched again."""
        adopted = [s for s in self.servers if s.adopt(reap=False)]
        self.api_key = adopted[0].api_key if adopted else resolve_api_key(self.config)
        for s in adopted:
            if s.api_key != self.api_key:
                log.warning("worker %s holds another API key than the fleet's; starting it again", s.url)
                s.stop(timeout_s=5)
        for s in self.servers:
            s.launch_key = self.api_key
        if adopted:
            log.info("adopted %d of %d workers a dead kernel left running", len(adopted), len(self.servers))

    def _start_router(self) -> None:
        if len(self.servers) > 1 or self.dropped:
            self.router = start_router([s.url for s in self.servers], self.run_dir, self.policy,
                                       api_key=self.api_key, startup_timeout_s=self.router_timeout_s)

    def _drop(self, server: Server) -> None:
        server.stop(timeout_s=5)
        self.servers.remove(server)
        self.dropped.append(server)


class FleetClient:
    """The router's client for requests, every worker's for control routes and metrics: an
    engines.InferenceClient, each of its members written out here (none forwarded implicitly)."""

    def __init__(self, fleet: Fleet, front: engines.EngineClient, workers: list[engines.EngineClient]):
        self.fleet, self.front, self.workers = fleet, front, workers
        self.engine = front.engine

    # ---- requests: through the router ---------------------------------------------------------
    @property
    def base_url(self) -> str:
        return self.front.base_url

    @property
    def served_model(self) -> str:
        return self.front.served_model

    @property
    def in_flight(self) -> int:
        """Generation requests in flight through the router."""
        return self.front.in_flight

    async def generate(self, input_ids: list[int], params: SamplingParams | None = None, adapter: str | None = None,
                       on_first_token: FirstTokenHook | None = None) -> list[Generation]:
        return await self.front.generate(input_ids, params, adapter, on_first_token)

    async def chat(self, messages: list[dict], params: SamplingParams | None = None, adapter: str | None = None,
                   logprobs: bool = True, **extra) -> dict:
        return await self.front.chat(messages, params, adapter, logprobs, **extra)

    async def score(self, input_ids: list[int], adapter: str | None = None, temperature: float = 1.0) -> list[float]:
        return await self.front.score(input_ids, adapter, temperature)

    async def server_info(self) -> dict:
        """The router's answer (it names its workers: sglang.SGLangClient reads a routed server from it)."""
        return await self.front.server_info()

    async def native_n_problem(self) -> str | None:
        """Why native n > 1 under an adapter is unsafe on the workers (engines.sglang), or None."""
        return await self.front.native_n_problem()

    # ---- control routes and metrics: on every worker -------------------------------------------
    async def _all(self, fn):
        return await asyncio.gather(*[fn(c) for c in self.workers])

    async def load_adapter(self, name: str, path: str) -> float:
        """Load on every worker; returns when all serve it. A worker that kept the version
        (AdapterExistsError after a restart elsewhere) serves the same files: names are immutable."""
        async def load(client):
            try:
                return await client.load_adapter(name, path)
            except AdapterExistsError:
                return 0.0
        return max(await self._all(load))

    async def unload_adapter(self, name: str) -> None:
        """Unload on every worker; returns once each has answered. A worker that does not hold it
        (restarted, or its load failed) is no error unless none holds it (UnknownAdapterError)."""
        async def unload(client) -> bool:
            try:
                await client.unload_adapter(name)
            except UnknownAdapterError:
                return False
            return True
        if not any(await self._all(unload)):
            raise UnknownAdapterError(f"no worker holds adapter {name}")

    async def list_adapters(self) -> dict[str, str]:
        """The adapters every worker holds (the router's /v1/models is its own, not the workers')."""
        held = await self._all(lambda c: c.list_adapters())
        return {name: path for name, path in held[0].items() if all(name in h for h in held[1:])}

    async def flush_cache(self, timeout_s: float | None = None) -> None:
        await self._all(lambda c: c.flush_cache(timeout_s=timeout_s))

    async def release_memory(self, *args, **kwargs):
        return max(await self._all(lambda c: c.release_memory(*args, **kwargs)), default=None)

    async def resume_memory(self, *args, **kwargs):
        return max(await self._all(lambda c: c.resume_memory(*args, **kwargs)), default=None)

    async def check_memory_saver(self, *args, **kwargs):
        return (await self._all(lambda c: c.check_memory_saver(*args, **kwargs)))[0]

    async def health(self, timeout_s: float = 30.0) -> bool:
        """Every worker and the router (requests go through it) answer /health."""
        front, *workers = await asyncio.gather(self.front.health(timeout_s=timeout_s),
                                               *[c.health(timeout_s=timeout_s) for c in self.workers])
        return front and all(workers)

    async def metrics_text(self) -> str:
        """Every worker's counters (monotonic), summed into one /metrics text in the engine's
        own counter names; a worker that does not answer raises ServerUnavailableError."""
        spec = engines.get(self.engine)  # the metrics names of the engine the client speaks
        texts = await self._all(lambda c: c.metrics_text())
        total = CacheCounters(0.0, 0.0)
        for server, text in zip(self.fleet.servers, texts):
            total = _plus(total, self.fleet.record(server, cache_counters(text, self.engine)))
        out = (f"{spec.prompt_counters[0]} {total.prompt_tokens}\n"
               f"{spec.cached_counters[0]} {total.cached_tokens}\n")
        progress = [progress_tokens(text, self.engine) for text in texts]  # the watchdog's sign of work
        if spec.progress_counters and None not in progress:
            out += f"{spec.progress_counters[0]} {sum(progress)}\n"
        return out

    async def aclose(self) -> None:
        await self.front.aclose()
        await self._all(lambda c: c.aclose())

    async def wrap_transport(self, wrap) -> None:
        """EngineClient.wrap_transport on the router's client and every worker's (a measuring tool's seam)."""
        await self.front.wrap_transport(wrap)
        await self._all(lambda c: c.wrap_transport(wrap))

    async def __aenter__(self) -> "FleetClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def start_fleet(configs: Sequence[ServerConfig], run_dir: str | Path, policy: str = "cache_aware") -> Fleet:
    """Start every server of `configs` and, above one, a router in front of them."""
    return Fleet(configs, run_dir, policy).start()


def gpu_lanes(servers: Sequence[Server]) -> list[list[Server]]:
    """Workers grouped by the GPUs they run on: one lane per GPU group (started in turn), lanes side
    by side. A server measures free GPU memory when it starts (SGLang 0.5.14 sizes its KV cache
    from it), so two starting together on one GPU each count the other's memory as free, and the
    second fails or takes the first's (H200 at 7de1b1f: the colocated fleet test). A plan's server
    groups are the same GPUs or disjoint ones, never partly shared. Workers without GPUs (the CPU
    engine) get a lane each; GPU workers without a plan inherit the kernel's GPUs and share one."""
    lanes: dict[frozenset[int] | int, list[Server]] = {}
    for i, server in enumerate(servers):
        mine = _gpus_of(server.config)
        lanes.setdefault(mine or i, []).append(server)  # no GPUs: a lane of its own
    return list(lanes.values())


KERNEL_GPUS = -1
"""gpu_lanes' name for the GPUs a server without a plan inherits from the kernel."""


def _gpus_of(config: ServerConfig) -> frozenset[int]:
    if config.gpu_plan is not None:
        return frozenset(config.gpu_plan.server_gpus)
    return frozenset() if config.engine == "cpu" else frozenset({KERNEL_GPUS})


def _start_in_turn(lane: Sequence[Server]) -> None:
    for server in lane:
        server.start(reap=False)


def fleet_configs(base: ServerConfig, plan) -> list[ServerConfig]:
    """One config per server of a gpus.GpuPlan: `base` with its own run_dir (`servers/<i>` under
    base's: logs and pid records are per run_dir and engine), its GPUs and memory fraction, and
    the tensor-parallel flag when the plan gives a server several GPUs. Their `api_key` stays as
    given ("auto" too, so a kernel restart finds the same configs and adopts the workers): the
    Fleet draws one key and every worker takes it, since the router forwards the client's key to
    whichever worker it picks."""
    configs = []
    for i in range(plan.num_servers):
        extra, tp_flag = base.extra_args, base.spec.tp_flag
        if plan.server_tp > 1 and tp_flag:
            extra = (*extra, tp_flag, str(plan.server_tp))
        configs.append(replace(base, run_dir=str(Path(base.run_dir) / "servers" / str(i)),
                               gpu_plan=plan.for_server(i), extra_args=extra))
    return configs
