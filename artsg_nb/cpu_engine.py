"""The CPU engine: a real inference server that speaks the subset of SGLang's HTTP API artsg_nb uses.

    python -m artsg_nb.cpu_engine --model-path DIR --host 127.0.0.1 --port 30000 \\
        [--max-lora-rank 16] [--lora-target-modules all|q_proj ...] [--max-loras-per-batch 8] \\
        [--lora-paths name=path ...] [--cache-budget-tokens 65536] [--disable-radix-cache] \\
        [--enable-cache-report] [--enable-memory-saver [--enable-weights-cpu-backup]] \\
        [--api-key KEY] [--random-seed S] [--log-level info]

What it does: serves a transformers causal LM (float32, CPU) with PEFT LoRA adapters loaded and
unloaded by name at runtime, behind SGLang's routes, JSON shapes, status codes and metric names
(/health, /generate, /v1/chat/completions, /load_lora_adapter, /unload_lora_adapter,
/flush_cache, /release_memory_occupation, /resume_memory_occupation, /metrics, /model_info,
/server_info, /v1/models), so the toolkit runs one code path
on a laptop or in CI and on a GPU box. Prefixes are reused through a token-level radix cache of
real KV tensors, namespaced per adapter load id exactly as SGLang keys its cache: reuse within a
policy version, never across versions. It prints SGLang's "The server is fired up and ready to
roll!" once the model is loaded and a warmup generation has run.

Design (the modules): `cpu_engine_routes` (FastAPI handlers) → `cpu_engine_protocol` (JSON ↔
requests) → `cpu_engine_scheduler` (one thread that owns the model: FCFS queue, continuous
batching of running requests, adapters mixed per batch, one prefill at a time with radix reuse)
→ `cpu_engine_batch` (the left-padded running batch) → `cpu_engine_model` (transformers + PEFT
forward) and `radix_cache`. `cpu_engine_sampling` holds the sampling_params contract and the
sampler; `cpu_engine_metrics` the Prometheus registry; `cpu_engine_memory` the memory
release/resume routes.

What it deliberately does not do: CUDA, tensor/pipeline parallelism, quantisation, paged
attention, chunked prefill, speculative decoding, grammars and penalties, chat streaming,
/v1/completions, weight updates of the base model, and SGLang's silent reload of an adapter
name that was unloaded (a request naming it gets 400, like a name never loaded).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

import torch

from artsg_nb.cpu_engine_memory import MemoryOccupation
from artsg_nb.cpu_engine_metrics import EngineMetrics
from artsg_nb.cpu_engine_model import ALL_TARGET_MODULES, AdapterError, ModelRunner, check_adapter_dir
from artsg_nb.cpu_engine_protocol import BadRequest
from artsg_nb.cpu_engine_sampling import SamplingParams
from artsg_nb.cpu_engine_scheduler import Request, Scheduler, SchedulerConfig

log = logging.getLogger("artsg_nb.cpu_engine")

VERSION = "artsg-cpu-0.1.0"
READY_LINE = "The server is fired up and ready to roll!"
LORA_ID_NAMESPACE = uuid.UUID("5b1d4c0e-8a7f-4c55-9d8e-3f1a2b6c7d90")  # uuid5 ids of --lora-paths


@dataclass
class EngineArgs:
    """Resolved command line (SGLang's flag names where SGLang has the flag)."""

    model_path: str
    """Directory of a transformers causal LM and its tokenizer."""
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    """Name in /v1/models and chat responses; defaults to model_path, as on SGLang."""
    max_lora_rank: int = 16
    """Adapters of a larger rank are refused with 400."""
    lora_target_modules: tuple[str, ...] = ALL_TARGET_MODULES
    """Modules adapters may target ("all" = the seven Qwen2/Llama projections)."""
    max_loras_per_batch: int = 8
    """Distinct adapters (base included) decoded together."""
    lora_paths: tuple[str, ...] = ()
    """Adapters loaded at boot, as name=path (or a bare path, named by itself)."""
    cache_budget_tokens: int = 65536
    """Tokens of KV the radix cache may hold."""
    disable_radix_cache: bool = False
    enable_cache_report: bool = False
    """Fill usage.prompt_tokens_details.cached_tokens in chat responses (SGLang's flag)."""
    enable_memory_saver: bool = False
    """Generation is refused while memory is released (SGLang cannot serve then); without the
    flag a release only flushes the radix cache, as on SGLang."""
    enable_weights_cpu_backup: bool = False
    """Reported by /server_info (the weights never leave RAM here)."""
    api_key: str | None = None
    """When set, every route but /health needs `Authorization: Bearer <key>`."""
    random_seed: int | None = None
    log_level: str = "info"
    max_running_requests: int = 64
    max_prefill_tokens: int = 16384
    num_threads: int | None = None
    """torch intra-op threads; default: one less than the CPUs this process may use (max 8)."""
    skip_server_warmup: bool = False
    ignored: dict = field(default_factory=dict)
    """SGLang flags accepted for compatibility that mean nothing on CPU."""


def parse_args(argv: list[str] | None = None) -> EngineArgs:
    p = argparse.ArgumentParser(prog="python -m artsg_nb.cpu_engine", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--lora-target-modules", nargs="*", default=["all"])
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--lora-paths", nargs="*", default=[])
    p.add_argument("--cache-budget-tokens", type=int, default=65536)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--enable-cache-report", action="store_true")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-weights-cpu-backup", action="store_true")
    p.add_argument("--api-key")
    p.add_argument("--random-seed", type=int)
    p.add_argument("--log-level", default="info")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--num-threads", type=int)
    p.add_argument("--skip-server-warmup", action="store_true")
    # SGLang flags that are meaningless here; accepted so a shared launcher can pass them.
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--mem-fraction-static", type=float)
    a = p.parse_args(argv)
    targets = tuple(a.lora_target_modules or ["all"])
    targets = ALL_TARGET_MODULES if "all" in targets else targets
    unknown = sorted(set(targets) - set(ALL_TARGET_MODULES))
    if unknown:
        p.error(f"--lora-target-modules {unknown} not supported; choose from {list(ALL_TARGET_MODULES)} or all")
    return EngineArgs(
        model_path=a.model_path, host=a.host, port=a.port, served_model_name=a.served_model_name,
        max_lora_rank=a.max_lora_rank, lora_target_modules=targets, max_loras_per_batch=a.max_loras_per_batch,
        lora_paths=tuple(a.lora_paths), cache_budget_tokens=a.cache_budget_tokens,
        disable_radix_cache=a.disable_radix_cache, enable_cache_report=a.enable_cache_report,
        enable_memory_saver=a.enable_memory_saver, enable_weights_cpu_backup=a.enable_weights_cpu_backup,
        api_key=a.api_key, random_seed=a.random_seed, log_level=a.log_level,
        max_running_requests=a.max_running_requests, max_prefill_tokens=a.max_prefill_tokens,
        num_threads=a.num_threads, skip_server_warmup=a.skip_server_warmup,
        ignored={k: v for k, v in (("enable_lora", a.enable_lora), ("enable_metrics", a.enable_metrics),
                                   ("mem_fraction_static", a.mem_fraction_static)) if v})


@dataclass(frozen=True)
class Adapter:
    """A loaded adapter: its name, directory and load id (the radix-cache namespace)."""

    name: str
    path: str
    adapter_id: str
    pinned: bool = False


class Engine:
    """The server's state: model runner, scheduler, adapter registry; bridges asyncio ↔ scheduler."""

    def __init__(self, args: EngineArgs):
        self.args = args
        self.served_model_name = args.served_model_name or args.model_path
        self.metrics = EngineMetrics(self.served_model_name)
        self.runner: ModelRunner | None = None
        self.scheduler: Scheduler | None = None
        self.adapters: dict[str, Adapter] = {}
        self.boot_adapters: list[Adapter] = []
        self.ready = False
        self.boot_error: str | None = None
        self.started_ts = time.time()
        self.memory = MemoryOccupation(args.enable_memory_saver)
        self._control = asyncio.Lock()  # one load/unload at a time

    # ---- boot ----------------------------------------------------------------------------
    def boot(self) -> None:
        """Load the model, start the scheduler, load --lora-paths, warm up (a background thread)."""
        try:
            torch.set_num_threads(self.args.num_threads or default_num_threads())
            self.runner = ModelRunner(self.args.model_path)
            self.scheduler = Scheduler(self.runner, SchedulerConfig(
                max_running_requests=self.args.max_running_requests,
                max_prefill_tokens=self.args.max_prefill_tokens,
                max_loras_per_batch=self.args.max_loras_per_batch,
                cache_budget_tokens=self.args.cache_budget_tokens,
                disable_radix_cache=self.args.disable_radix_cache,
                random_seed=self.args.random_seed), self.metrics)
            self.scheduler.start()
            for spec in self.args.lora_paths:
                name, _, path = spec.partition("=") if "=" in spec else (spec, "", spec)
                adapter_id = uuid.uuid5(LORA_ID_NAMESPACE, f"{name}={path}").hex
                self._load_blocking(Adapter(name=name, path=path, adapter_id=adapter_id))
                self.boot_adapters.append(self.adapters[name])
            if not self.args.skip_server_warmup:
                self._warmup()
            self.ready = True
            print(READY_LINE, flush=True)
        except Exception as e:
            self.boot_error = f"{type(e).__name__}: {e}"
            log.exception("CPU engine failed to start")
            os._exit(1)  # a server that cannot serve must not linger; the launcher reads the log

    def _load_blocking(self, adapter: Adapter) -> None:
        check_adapter_dir(adapter.path, self.args.max_lora_rank, self.args.lora_target_modules)
        self.scheduler.call(lambda: self.runner.load_adapter(adapter.path, adapter.adapter_id)).result()
        self.adapters[adapter.name] = adapter
        self.metrics.set_lora_slots(len(self.adapters), self.args.max_loras_per_batch)

    def _warmup(self) -> None:
        done = threading.Event()
        req = Request(input_ids=[self.runner.tokenizer.eos_token_id or 0],
                      params=SamplingParams(max_new_tokens=1, temperature=0.0),
                      on_event=lambda r, finished: finished and done.set())
        self.scheduler.submit([req])
        if not done.wait(timeout=600) or req.error:
            raise RuntimeError(f"warmup generation failed: {req.error or 'timed out'}")

    def healthy(self) -> bool:
        return self.ready and self.scheduler is not None and self.scheduler.alive()

    # ---- adapters ------------------------------------------------------------------------
    def resolve_adapter(self, name: str | None) -> str | None:
        """Adapter name → load id (None = base model); BadRequest for a name not loaded."""
        if name is None:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise BadRequest(f"Got LoRA adapter that has never been loaded: {name}\n"
                             f"All loaded adapters: {list(self.adapters)}")
        return adapter.adapter_id

    def loaded_adapters(self) -> dict[str, str]:
        return {a.name: a.path for a in self.adapters.values()}

    async def load_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Load `path` as `name` under a fresh uuid4 load id; AdapterError if refused."""
        async with self._control:
            if name in self.adapters:
                raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
            adapter = Adapter(name=name, path=path, adapter_id=uuid.uuid4().hex, pinned=pinned)
            await asyncio.to_thread(check_adapter_dir, path, self.args.max_lora_rank, self.args.lora_target_modules)
            future = self.scheduler.call(lambda: self.runner.load_adapter(path, adapter.adapter_id))
            try:
                await asyncio.wrap_future(future)
            except Exception as e:
                raise AdapterError(f"Failed to load LoRA adapter {name} from {path}: {e}") from e
            self.adapters[name] = adapter
            self.metrics.set_lora_slots(len(self.adapters), self.args.max_loras_per_batch)

    async def unload_adapter(self, name: str) -> None:
        """Forget `name` at once; free it once no queued or running request uses it."""
        async with self._control:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}")
            self.metrics.set_lora_slots(len(self.adapters), self.args.max_loras_per_batch)
            scheduler = self.scheduler

            def free() -> None:
                self.runner.delete_adapter(adapter.adapter_id)
                if scheduler.cache is not None:
                    scheduler.cache.drop_namespace(adapter.adapter_id)

            idle = lambda: not scheduler.uses_adapter(adapter.adapter_id)  # noqa: E731
            await asyncio.wrap_future(scheduler.call(free, ready=idle))

    async def flush_cache(self) -> bool:
        return await asyncio.wrap_future(self.scheduler.call(self.scheduler.flush_cache))

    # ---- running requests ----------------------------------------------------------------
    async def events(self, reqs: list[Request]):
        """Submit `reqs`; yield (request, n_output_tokens, finished) as the scheduler reports.

        Requests must have been resolved and built without an `await` since resolve_adapter,
        so an unload issued meanwhile waits for them. Closing the generator early (client gone)
        aborts whatever is still running.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_event(req: Request, finished: bool) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (req, len(req.output_ids), finished))
            except RuntimeError:  # the event loop is gone: nobody is listening
                req.aborted = True

        for req in reqs:
            req.on_event = on_event
        self.scheduler.submit(reqs)
        remaining = len(reqs)
        try:
            while remaining:
                req, n, finished = await queue.get()
                remaining -= finished
                yield req, n, finished
        finally:
            for req in reqs:
                if req.finished_ts is None:
                    req.aborted = True

    async def run(self, reqs: list[Request]) -> list[Request]:
        """Submit `reqs` and wait until all have finished."""
        async for _ in self.events(reqs):
            pass
        return reqs

    def server_info(self) -> dict:
        info = {k: v for k, v in asdict(self.args).items() if k not in ("ignored", "lora_paths")}
        scheduler = self.scheduler
        info.update({
            "api_key": None if self.args.api_key is None else "<redacted>",
            "tokenizer_path": self.args.model_path,
            "served_model_name": self.served_model_name,
            "context_length": self.runner.context_len if self.runner else None,
            "lora_target_modules": list(self.args.lora_target_modules),
            "lora_paths": [{"lora_id": a.adapter_id, "lora_name": a.name, "lora_path": a.path, "pinned": a.pinned}
                           for a in self.boot_adapters],
            "enable_lora": True,
            "enable_metrics": True,
            "device": "cpu",
            "weight_version": "default",
            "version": VERSION,
            "startup_time": self.started_ts,
            "internal_states": [{
                "num_running_reqs": len(scheduler.batch.reqs) if scheduler else 0,
                "num_waiting_reqs": len(scheduler.waiting) if scheduler else 0,
                "radix_cache_tokens": scheduler.cache.total_tokens if scheduler and scheduler.cache else 0,
                "loaded_adapters": self.loaded_adapters(),
            }],
        })
        return info


def default_num_threads() -> int:
    """Leave one CPU to the HTTP loop and the client: on a busy 2-core box, two spinning
    OpenMP threads made a forward pass ~10x slower than one."""
    return max(1, min(len(os.sched_getaffinity(0)) - 1, 8))


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from artsg_nb.cpu_engine_routes import create_app

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stdout,
                        format="[%(asctime)s] %(name)s %(levelname)s: %(message)s")
    if args.ignored:
        log.info("ignoring GPU-only flags on the CPU engine: %s", args.ignored)
    engine = Engine(args)
    app = create_app(engine)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=args.log_level.lower() == "debug")
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
