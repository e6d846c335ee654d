"""The CPU engine's state: the Engine (model runner, scheduler, adapter registry, memory release).

What it does: boots the model and the scheduler thread in the background (then prints SGLang's
"The server is fired up and ready to roll!"), keeps the registry of loaded adapters (name →
load id, the radix-cache namespace), loads and unloads adapters, flushes the cache, releases and
resumes memory (the state and SGLang's facts are in memory.py), and bridges asyncio handlers to
the scheduler thread (`events`, `run`). EngineArgs is the resolved command line.

What it deliberately does not do: HTTP (routes.py receives an Engine and maps routes onto it;
this module never imports routes), argument parsing (__main__.py), or any model, KV or batching
work (the scheduler thread owns those).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

import torch

from .memory import NOT_IDLE, MemoryOccupation, OccupationError
from .metrics import EngineMetrics
from .model import ALL_TARGET_MODULES, AdapterError, ModelRunner, check_adapter_dir
from .protocol import BadRequest
from .request import Request
from .sampling import RequestSampling
from .scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

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
    faults: tuple[str, ...] = ()
    """Opt-in faults that reproduce a real engine's failures, for the fault tests (FAULTS)."""
    fault_marker: str | None = None
    """With a fault: a file it writes when it fires, and does not fire again while the file exists
    (so a restarted server comes back healthy, as after a transient wedge). None: every time."""
    ignored: dict = field(default_factory=dict)
    """SGLang flags accepted for compatibility that mean nothing on CPU."""


FAULTS = {
    "lora-n-counter": "SGLang <= 0.5.14's LoRA reference miscount (sglang#36894): each prompt sent with n > 1 "
                      "under an adapter releases one reference it never took, and unloading that adapter "
                      "then waits for a count of exactly zero forever, while /health answers",
    "stuck-unload": "/unload_lora_adapter never answers, while /health answers",
}
"""The faults `--fault` can switch on, and what each reproduces."""


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
        self.lora_refs: dict[str, int] = {}  # load id → references net of releases (fault lora-n-counter)

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
        self.runner.check_adapter_shapes(adapter.path)
        self.scheduler.call(lambda: self.runner.load_adapter(adapter.path, adapter.adapter_id)).result()
        self.adapters[adapter.name] = adapter
        self.metrics.set_lora_slots(len(self.adapters), self.args.max_loras_per_batch)

    def _warmup(self) -> None:
        done = threading.Event()
        req = Request(input_ids=[self.runner.tokenizer.eos_token_id or 0],
                      params=RequestSampling(max_new_tokens=1, temperature=0.0),
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
            await asyncio.to_thread(self.runner.check_adapter_shapes, path)
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
            log.info("Start unload Lora adapter. Lora name=%s", name)  # SGLang's line
            if name in self.adapters:
                await self._maybe_wedge_unload(self.adapters[name])
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

    async def _maybe_wedge_unload(self, adapter: Adapter) -> None:
        """The faults that make an unload hang (FAULTS): wait forever, holding the control lock as
        SGLang holds its LoRA update lock, so later loads and unloads queue behind it."""
        miscounted = "lora-n-counter" in self.args.faults and self.lora_refs.get(adapter.adapter_id, 0) != 0
        if (miscounted or "stuck-unload" in self.args.faults) and self._fire_fault():
            log.warning("fault: unload of %s hangs (references %d)", adapter.name,
                        self.lora_refs.get(adapter.adapter_id, 0))
            await asyncio.Event().wait()

    def _fire_fault(self) -> bool:
        """True if a fault may fire now; with fault_marker, once (the marker records it)."""
        marker = self.args.fault_marker
        if marker is None:
            return True
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return False
        return True

    def count_lora_references(self, reqs: list[Request]) -> None:
        """Fault lora-n-counter: what SGLang's tokenizer manager does to an adapter's reference count
        for these requests — one reference taken and released per sample, plus one release without a
        take per prompt sent with n > 1 (its prefill warm-up)."""
        if "lora-n-counter" not in self.args.faults:
            return
        for req in reqs:
            if req.adapter_id is not None and req.params.n > 1 and req.sample_index == 0:
                self.lora_refs[req.adapter_id] = self.lora_refs.get(req.adapter_id, 0) - 1

    async def flush_cache(self) -> bool:
        return await asyncio.wrap_future(self.scheduler.call(self.scheduler.flush_cache))

    # ---- memory (SGLang's /release_memory_occupation and /resume_memory_occupation) -------
    async def release_memory(self, tags: list[str]) -> None:
        """Mark `tags` released and, for kv_cache, empty the radix cache; only when idle."""
        scheduler, state = self.scheduler, self.memory

        def on_scheduler() -> None:  # runs on the scheduler thread, between rounds
            if scheduler.busy():
                raise OccupationError(NOT_IDLE)
            if "kv_cache" in tags:
                scheduler.flush_cache()
            state.released.update(tags)

        await asyncio.wrap_future(scheduler.call(on_scheduler))

    async def resume_memory(self, tags: list[str]) -> None:
        """Mark `tags` resumed; all of them must be released (SGLang: a KeyError that ends the server)."""
        missing = [t for t in tags if t not in self.memory.released]
        if missing:
            raise OccupationError(f"KeyError: {missing[0]!r}: resume_memory_occupation of a tag that is not "
                                  f"released (released: {sorted(self.memory.released)})")
        self.memory.released.difference_update(tags)

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
        self.count_lora_references(reqs)
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
        info = {k: v for k, v in asdict(self.args).items() if k not in ("ignored", "lora_paths", "faults")}
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
            "faults": list(self.args.faults),
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
