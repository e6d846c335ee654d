"""SGLang: its HTTP dialect, how it is launched, where its environment and metrics are.

What it does: `SGLangClient` speaks SGLang's native API — POST /generate with `input_ids`, the
adapter selected by name in `lora_path` (its OpenAI routes take `model: "<served>:<adapter>"`;
the bare adapter name silently serves the base model), temperature-scaled logprobs aligned with
`output_ids`, `meta_info.cached_tokens`, LoRA load/unload with a `success` flag in a 200 body —
and SPEC says how `python -m sglang.launch_server` is started (`--enable-lora`, metrics and cache
report on), which variables find its environment, and which counters give its hit rate. The CPU
engine copies this API, so its client (cpu.py) is this one.

Memory release around training: `release_memory(tags)` / `resume_memory()` POST
/release_memory_occupation and /resume_memory_occupation with `{"tags": [...]}`; both answer 200
with a `null` body. What they guard against, read in SGLang 0.5.14's source (paths under
`sglang/srt/`):

* Without `--enable-memory-saver` both routes still answer 200 and free nothing: a no-op saver
  is swapped in (`utils/torch_memory_saver_adapter.py:19-29, 87-108`). So the client reads the
  server's flags from /server_info first and raises `MemorySaverError` rather than pretend.
  With the flag but no `torch_memory_saver` package the server does not start at all (`:20-26`).
* The server must be idle. The scheduler *asserts* it
  (`managers/scheduler_components/weight_updater.py:180-183`), and a failed assert ends the
  scheduler and with it the server (`managers/scheduler.py:4229-4232`), not a 400. Release
  therefore first waits for idle through `/flush_cache?timeout=`, which refuses with a 400.
* Releasing "kv_cache" flushes the radix cache (`weight_updater.py:193-209`). That costs no
  hits here: the cache is keyed by adapter load and every step serves a new adapter.
* "weights" without `--enable-weights-cpu-backup` throws the base weights away: only the
  module buffers are stashed (`weight_updater.py:211-217, 311-323`) and resume maps fresh,
  uninitialised memory (RL frameworks push new weights after it; LoRA training does not). The
  LoRA buffers live outside the weights region (`model_executor/model_runner.py:1415-1429`
  loads the model inside it, `:777-779` builds the LoRA manager after), so adapters survive a
  weights release that has the backup. The default tags leave the weights alone.
* Resuming a tag that is not released is a KeyError in the scheduler (`weight_updater.py:231-232`),
  which again ends the server; so `resume_memory()` sends exactly the tags this client released.
* Nothing stops generation while memory is released: a request would run on unmapped memory.
  Generate nothing, and do not probe /health (it generates one token), until resume.

What it does not do: anything engine-neutral (base.py), or start the process (server.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterable

from .base import (DEFAULT_TAGS, EngineClient, Generation, SamplingParams, chat_payload, memory_tags,
                   normalise_finish_reason, saver_problem)
from .batching import GenerateBatcher, batch_payload
from .errors import AdapterExistsError, EngineError, MemorySaverError
from .spec import EngineSpec, RawDialect, key_launcher

log = logging.getLogger(__name__)


LORA_N_ISSUE = "sgl-project/sglang#36894"
LORA_N_FIXED_IN: str | None = "0.5.22"
"""The first SGLang release whose n > 1 requests balance their LoRA references: read in the
0.5.22 wheel's `tokenizer_manager.py`, where the prefill-only warm-up of `_handle_batch_request`
borrows the samples' references ("only samples release them") and `_release_lora_once` releases
each request's at most once; 0.5.21's warm-up still releases a reference it never took. From
this release on native n is used under an adapter (one request per group, the warm-up inside the
server); before it, the balanced submission below."""


def lora_n_problem(info: dict) -> str | None:
    """Why native n > 1 under a LoRA adapter is unsafe on the SGLang that sent `info`, or None.

    Read in 0.5.14's `tokenizer_manager._handle_batch_request`: for n > 1 a prefill-only warm-up
    copy of each prompt is sent and released on finish, but never acquired; the adapter's usage
    counter ends below zero and `/unload_lora_adapter` waits for exactly zero forever, while
    /health keeps answering. An unknown version counts as affected."""
    version = str(info.get("version") or "of unknown version")
    if LORA_N_FIXED_IN is not None and _version_tuple(version) >= _version_tuple(LORA_N_FIXED_IN):
        return None
    return (f"SGLang {version} miscounts a LoRA adapter's references for requests with n > 1, after which "
            f"unloading that adapter never returns ({LORA_N_ISSUE})")


def native_n_submission(native_n: str | None, index: int) -> str | None:
    """Generation.submission of sample `index` of a native n > 1 request on an engine whose
    EngineSpec.native_n is `native_n`: "warm-up" (SGLang's tokenizer manager sends a prefill-only
    copy of the prompt and awaits it before the samples: read in 0.5.14 and 0.5.22,
    `_handle_batch_request`), "in order" (the CPU engine prefills the samples one after another),
    None: not known."""
    if native_n == "warm-up":
        return "warm-up first"
    if native_n == "in order":
        return "after first copy" if index else "first copy"
    return None


WARM_UP_FROM_FLOP = 1e12
"""SGLang's EngineSpec.warm_up_from_flop. Measured on an H100 (SmolLM2-135M, 16 prompts of 38
tokens x 8 copies, 2026-12-06, benchmarks/results/20261206-h100-batch-shapes-smollm2-2c9ada6.json):
one warm-up batch then one sample batch 0.161 s, one batch of the copies 0.118 s; the warm-up's round trip, shared by a step's 16 groups,
costs ~2.7 ms a group, about what 1e12 FLOPs of prefill take at 40 % of the card's bf16 peak. So
SmolLM2 skips it below ~530-token prompts (8 copies), a 1.5B model below ~50, an 8B model never."""


def weight_bytes(model: str) -> int | None:
    """Bytes of the `*.safetensors` weights in the local model folder `model`; None when `model`
    is not a local folder with safetensors (a hub id, another format) or is quantized (its
    config.json has a `quantization_config`: fewer bytes than FLOPs, which would skip warm-ups
    that pay)."""
    folder = Path(model)
    files = list(folder.glob("*.safetensors")) if folder.is_dir() else []
    config = folder / "config.json"
    if config.is_file() and "quantization_config" in json.loads(config.read_text()):
        return None
    return sum(f.stat().st_size for f in files) or None


def _version_tuple(version: str) -> tuple[int, ...]:
    """The release numbers of `version`: each part's leading digits, up to the first part with
    anything after them ("0.5.2rc2" → (0, 5, 2), never (0, 5, 22): a pre-release of 0.5.2 is
    not the fixed 0.5.22)."""
    parts = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() < len(part):
            break
    return tuple(parts)


_UNKNOWN = object()


class SGLangClient(EngineClient):
    """SGLang's native API (/generate with input_ids), and the CPU engine's, which copies it.

    n > 1 under an adapter, on a server with the reference-counting bug (`lora_n_problem`), goes
    out as SGLang itself would send it — a prefill-only warm-up that caches the prompt, then the n
    samples together — but as requests whose references balance: the warm-up is a plain n = 1
    request, and the n samples are n copies of the prompt (n = 1 each, sample j seeded seed + j as
    native n does). Same samples, same prefix hits. Where the copies' prefill is cheaper than the
    warm-up's round trip (a small model, a short prompt: `warm_up_pays`), the warm-up is left out:
    the same samples, and the copies' prompts computed, not reused.

    The warm-ups and samples of the n > 1 requests made in one event-loop tick go as one batch
    request each (batching.py): a step's groups send one warm-up batch, then one batch of every
    sample. Behind sglang-router (which takes no per-sample list) every request goes alone."""

    engine = "sglang"
    lora_n_problem = staticmethod(lora_n_problem)
    """Set from the engine's spec by engines.make_client."""
    _n_problem: object = _UNKNOWN
    _n_lock: asyncio.Lock | None = None
    _routed = False
    info_source: "SGLangClient | None" = None
    """The client whose /server_info describes the engine behind this URL (a router in front of
    workers: its own /server_info names no engine version); None: this one."""
    route_hints = {
        "/metrics": "Start SGLang with --enable-metrics.",
        "/load_lora_adapter": "This SGLang has no runtime LoRA loading: use SGLang >= 0.4.10.",
        "/release_memory_occupation": "This server cannot release memory: use SGLang 0.5.x, or run without it.",
    }

    async def native_n_problem(self) -> str | None:
        """Why this server must not get native n > 1 under an adapter (None: it may); asked once,
        also when a rollout's first requests all ask at the same moment."""
        if self._n_problem is _UNKNOWN:
            self._n_lock = self._n_lock or asyncio.Lock()
            async with self._n_lock:
                if self._n_problem is _UNKNOWN:
                    self._n_problem = await self._ask_n_problem()
        return self._n_problem

    async def _ask_n_problem(self) -> str | None:
        try:
            info = await (self.info_source or self).server_info()
        except EngineError as e:  # unknown version: affected, as lora_n_problem assumes
            log.debug("%s /server_info failed (%s): assuming the n > 1 LoRA bug", self.engine, e)
            info = {}
        # A router's own /server_info counts workers and names no engine version (unknown: affected).
        self._routed = self.info_source is not None or "workers_count" in info
        problem = self.lora_n_problem(info)
        if problem:
            log.info("%s: %s; n > 1 under an adapter is sent as a warm-up plus %s", self.engine, problem,
                     "n single requests (a router)" if self._routed else "one batch of n samples")
        return problem

    async def _generate(self, input_ids, params, adapter) -> list[Generation]:
        if params.n > 1 and adapter is not None and await self.native_n_problem():
            return await self._generate_balanced(input_ids, params, adapter)
        body = await self._post_generate(self._generate_payload(input_ids, params, adapter))
        # One prompt with n > 1 comes back as a list of n objects, n == 1 as one object.
        gens = [self._parse_sample(obj) for obj in (body if isinstance(body, list) else [body])]
        if params.n > 1:
            for index, gen in enumerate(gens):
                gen.submission = native_n_submission(self.native_n, index)
        return gens

    async def _generate_balanced(self, input_ids, params, adapter) -> list[Generation]:
        """n samples as a warm-up (n = 1, no new tokens; only where it pays: `warm_up_pays`) then n
        single samples (see the class), which the batcher sends together with the other groups' of
        this tick. Each sample's `submission` says which of the two it was."""
        warm = self.warm_up_pays(len(input_ids), params.n)
        if warm:
            warm_up = self._generate_payload(input_ids, replace(params, n=1, max_new_tokens=0, seed=None), adapter)
            await self._post_one({**warm_up, "return_logprob": False})
        seeds = [None if params.seed is None else params.seed + j for j in range(params.n)]
        singles = [self._generate_payload(input_ids, replace(params, n=1, seed=seed), adapter) for seed in seeds]
        batcher = self._batcher_here()
        if batcher is not None:
            bodies = await asyncio.gather(*(batcher.submit(p) for p in singles))
        elif self._routed:  # sglang-router 0.3 takes no per-sample sampling_params list
            bodies = await asyncio.gather(*(self._post_generate(p) for p in singles))
        else:  # batch_requests off: this group's samples still go as one request
            bodies = await self._post_generate(batch_payload(singles))
        gens = [self._parse_sample(obj) for obj in bodies]
        for gen in gens:
            gen.submission = "warm-up first" if warm else "prefilled together"
        return gens

    warm_up_from_flop = 0.0
    """Set from the engine's spec (EngineSpec.warm_up_from_flop) by engines.make_client."""
    native_n: str | None = None
    """How the engine runs a native n > 1 request (EngineSpec.native_n, set by engines.make_client)."""
    prompt_warm_up = "auto"
    """When the n copies of a prompt go after a warm-up that caches it (ServerConfig.prompt_warm_up):
    "auto" (`warm_up_pays`), "always" or "never"."""
    _weight_bytes: object = _UNKNOWN

    def warm_up_pays(self, prompt_tokens: int, n: int) -> bool:
        """Whether n copies of a `prompt_tokens` prompt go after a warm-up that caches it: always
        or never when `prompt_warm_up` says so; on "auto" when the prefill they would redo reaches
        `warm_up_from_flop`, or the model's size is unknown. A bf16 weight is 2 bytes and 2 FLOPs
        per token, so the weights' bytes count the FLOPs per prompt token (fp32 weights count
        double: more warm-ups, never fewer)."""
        if self.prompt_warm_up != "auto":
            return self.prompt_warm_up == "always"
        if not self.warm_up_from_flop:
            return True
        if self._weight_bytes is _UNKNOWN:
            self._weight_bytes = weight_bytes(self.served_model)
        return self._weight_bytes is None or self._weight_bytes * prompt_tokens * (n - 1) >= self.warm_up_from_flop

    # ---- /generate, batched across the requests of one event-loop tick (engines/batching.py) ----
    batch_requests = True
    """Send the warm-ups and samples of the n > 1 requests made in one event-loop tick (a step's
    groups) as one batch request each (not behind sglang-router, which takes no per-prompt lists).
    A plain n = 1 request goes alone: an episode's next turn must not wait for other episodes'
    longer replies in a shared batch."""
    _batcher: GenerateBatcher | None = None

    def _batcher_here(self) -> GenerateBatcher | None:
        """This event loop's batcher; None when requests go one by one."""
        if not self.batch_requests or self._routed or self.info_source is not None:
            return None
        if self._batcher is None or self._batcher.loop is not asyncio.get_running_loop():
            self._batcher = GenerateBatcher(self._post_generate)
        return self._batcher

    async def _post_one(self, payload: dict) -> dict:
        """One single-prompt /generate payload's answer, through the batcher when there is one."""
        batcher = self._batcher_here()
        return await (batcher.submit(payload) if batcher is not None else self._post_generate(payload))

    async def _post_generate(self, payload: dict):
        op = "use" if payload.get("lora_path") else "other"
        return (await self._request("POST", "/generate", op, json=payload)).json()

    async def _generate_streamed(self, input_ids, params, adapter, signal) -> list[Generation]:
        if params.n > 1 and adapter is not None and await self.native_n_problem():
            raise EngineError(f"{self.engine}: a streamed request with n={params.n} under adapter {adapter} is not "
                              f"sent: {self._n_problem}. Stream n = 1 requests (schedule 'prefix'), or do not stream.")
        payload = {**self._generate_payload(input_ids, params, adapter), "stream": True}
        samples: dict[int, dict] = {}
        async for chunk in self._sse("/generate", payload, "use" if adapter else "other"):
            index = chunk.get("index", 0)
            samples[index] = merge_stream_chunk(samples.get(index), chunk)
            if chunk.get("output_ids"):
                await signal.fire()
        return [self._parse_sample(samples[i]) for i in sorted(samples)]

    def _generate_payload(self, input_ids: list[int], params: SamplingParams, adapter: str | None) -> dict:
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                    "top_p": params.top_p, "ignore_eos": params.ignore_eos, "n": params.n}
        sampling.update(params.optional_fields(seed_key="sampling_seed"))  # only what is set
        payload = {"input_ids": list(input_ids), "sampling_params": sampling, "return_logprob": True}
        if adapter is not None:
            payload["lora_path"] = adapter  # the adapter's *name*, despite the field's name
        return payload

    def _parse_sample(self, obj: dict) -> Generation:
        meta = obj["meta_info"]
        ids = list(obj["output_ids"])
        triples = meta.get("output_token_logprobs") or []  # [[logprob, token_id, text|None], ...]
        if [t[1] for t in triples] != ids:
            raise EngineError(
                f"{self.engine} returned {len(ids)} output_ids but logprobs for {len(triples)} tokens, "
                f"or for other ids (first ids {ids[:5]} vs {[t[1] for t in triples[:5]]}); the logprobs "
                "cannot be aligned with the tokens. Is the server an SGLang-compatible engine?", body=obj)
        finish = normalise_finish_reason(meta.get("finish_reason"))
        if finish == "abort":
            log.warning("%s aborted a request: %s", self.engine, meta.get("finish_reason"))
        return Generation(output_ids=ids, logprobs=[float(t[0]) for t in triples],
                          prompt_tokens=int(meta.get("prompt_tokens", 0)),
                          cached_tokens=int(meta.get("cached_tokens") or 0),
                          finish_reason=finish, text=obj.get("text") or "", e2e_s=0.0)

    async def chat(self, messages: list[dict], params: SamplingParams | None = None,
                   adapter: str | None = None, logprobs: bool = True, **extra) -> dict:
        if (params and params.n > 1) and adapter and await self.native_n_problem():
            raise EngineError(f"{self.engine}: a chat request with n={params.n} under adapter {adapter} is not sent: "
                              f"{self._n_problem}. Send {params.n} requests with n=1 instead.")
        # "<served>:<adapter>" selects the adapter; the bare adapter name would serve the base model.
        model = f"{self.served_model}:{adapter}" if adapter else self.served_model
        payload = chat_payload(model, messages, params or SamplingParams(), logprobs, extra)
        return (await self._request("POST", "/v1/chat/completions", "use" if adapter else "other",
                                    json=payload)).json()

    async def load_adapter(self, name: str, path: str) -> float:
        t0 = time.perf_counter()
        try:
            await self._lora_call("/load_lora_adapter", {"lora_name": name, "lora_path": path}, "load")
        except AdapterExistsError as e:
            # Sent twice (the connection dropped under the first, which the server did serve):
            # the adapter is loaded once, from this path, as asked.
            if not (e.retried and (await self.list_adapters()).get(name) == path):
                raise
            log.info("%s: %s was loaded by the first of two sends", self.engine, name)
        return time.perf_counter() - t0

    async def unload_adapter(self, name: str) -> None:
        """Unload `name` (the server first waits for in-flight requests that use it)."""
        await self._lora_call("/unload_lora_adapter", {"lora_name": name}, "unload")

    async def _lora_call(self, path: str, payload: dict, op: str) -> dict:
        resp = await self._admin("POST", path, f"{op} adapter {payload['lora_name']}", op, json=payload)
        body = resp.json()
        if not body.get("success", False):  # a 200 carrying success: false is a failure too
            err = self._error("POST", path, 200, body, op)
            err.retried = resp.retried
            raise err
        return body

    async def flush_cache(self, timeout_s: float | None = None) -> None:
        """Empty the prefix cache. The server refuses (400) while requests run; with `timeout_s`
        SGLang >= 0.5.23 waits up to that long for idle."""
        params = {"timeout": timeout_s} if timeout_s else None
        limit_s = self.admin_timeout_s + (timeout_s or 0)  # the server may wait timeout_s for idle first
        await self._admin("POST", "/flush_cache", "flush the prefix cache", params=params, timeout_s=limit_s)

    async def server_info(self) -> dict:
        """The resolved server arguments (GET /server_info, else the older /get_server_info)."""
        try:
            return (await self._admin("GET", "/server_info", "report its configuration")).json()
        except EngineError as e:
            if e.status != 404:
                raise
        return (await self._admin("GET", "/get_server_info", "report its configuration")).json()

    async def score(self, input_ids: list[int], adapter: str | None = None,
                    temperature: float = 1.0) -> list[float]:
        payload = self._generate_payload(input_ids, SamplingParams(max_new_tokens=1, temperature=temperature),
                                         adapter)
        payload["logprob_start_len"] = 0
        body = (await self._request("POST", "/generate", "use" if adapter else "other", json=payload)).json()
        triples = body["meta_info"]["input_token_logprobs"]  # first entry is [None, ids[0], ...]
        if [t[1] for t in triples] != list(input_ids):
            raise EngineError(f"{self.engine} scored other tokens than the {len(input_ids)} sent", body=body)
        return [float(t[0]) for t in triples[1:]]

    # ---- memory release around training (see the module docstring) ---------------------------
    released_tags: tuple[str, ...] = ()
    """What this client released and has not resumed yet."""
    _saver_flags: dict | None = None

    async def check_memory_saver(self, tags: Iterable[str] = DEFAULT_TAGS) -> None:
        """Raise MemorySaverError unless the server can release `tags` (its flags are read once)."""
        tags = memory_tags(tags)
        if self._saver_flags is None:
            info = await self.server_info()
            self._saver_flags = {k: bool(info.get(k)) for k in ("enable_memory_saver", "enable_weights_cpu_backup")}
        problem = saver_problem(self._saver_flags, tags, self.engine)
        if problem:
            raise MemorySaverError(problem, body=self._saver_flags)

    async def release_memory(self, tags: Iterable[str] = DEFAULT_TAGS, idle_timeout_s: float = 60.0) -> float:
        """Release `tags` of the server's GPU memory once it is idle; seconds taken (idle wait included).

        Raises MemorySaverError when the server cannot (see `check_memory_saver`), EngineError when
        it is not idle within `idle_timeout_s` or this client already released (resume first).
        """
        tags = memory_tags(tags)
        if self.released_tags:
            raise EngineError(f"{self.engine}: memory {list(self.released_tags)} is already released; "
                              "call resume_memory() first")
        await self.check_memory_saver(tags)
        t0 = time.perf_counter()
        try:
            await self.flush_cache(timeout_s=idle_timeout_s)  # waits for idle, or refuses with 400
        except EngineError as e:
            if e.status is None or e.status >= 500:
                raise
            raise EngineError(f"{self.engine} did not become idle within {idle_timeout_s:g} s, so its memory was "
                              "not released (SGLang asserts idle; its scheduler would exit). Let every "
                              f"request finish first, or pass a larger idle_timeout_s. ({e})", e.status, e.body) from e
        await self._admin("POST", "/release_memory_occupation", f"release memory {list(tags)}", json={"tags": list(tags)})
        self.released_tags = tags
        log.debug("%s released %s in %.3f s", self.engine, tags, time.perf_counter() - t0)
        return time.perf_counter() - t0

    async def resume_memory(self) -> float:
        """Take back what `release_memory` gave; seconds taken. Nothing released: returns 0.0."""
        if not self.released_tags:
            return 0.0
        t0 = time.perf_counter()
        await self._admin("POST", "/resume_memory_occupation", f"resume memory {list(self.released_tags)}",
                          json={"tags": list(self.released_tags)})
        self.released_tags = ()
        return time.perf_counter() - t0


def merge_stream_chunk(prev: dict | None, chunk: dict) -> dict:
    """Fold one streamed SGLang /generate chunk into the sample so far.

    SGLang streams cumulative chunks by default and deltas with --incremental-streaming-output.
    `meta_info.completion_tokens` counts all tokens so far in both modes, so a chunk carrying
    that many ids is cumulative (it replaces), and a shorter one is a delta (it appends).
    """
    meta = chunk.get("meta_info") or {}
    ids = chunk.get("output_ids") or []
    if prev is None or len(ids) == meta.get("completion_tokens", len(ids)):
        return chunk
    prev_meta = prev.get("meta_info") or {}
    lps = (prev_meta.get("output_token_logprobs") or []) + (meta.get("output_token_logprobs") or [])
    return {**chunk, "output_ids": prev["output_ids"] + ids,
            "text": (prev.get("text") or "") + (chunk.get("text") or ""),
            "meta_info": {**meta, "output_token_logprobs": lps}}


def launch_args(cfg, port: int) -> list[str]:
    """The flags for a server.ServerConfig `cfg` listening on `port`."""
    args = ["--model-path", cfg.model_path, "--host", cfg.host, "--port", str(port),
            "--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank),
            "--lora-target-modules", *cfg.lora_target_modules,
            "--max-loras-per-batch", str(cfg.max_loras_per_batch),
            "--enable-metrics", "--enable-cache-report"]
    if (mem := cfg.resolved_mem_fraction()) is not None:
        args += ["--mem-fraction-static", f"{mem:g}"]
    args += ["--enable-memory-saver"] if cfg.enable_memory_saver else []
    args += ["--enable-weights-cpu-backup"] if cfg.enable_weights_cpu_backup else []
    args += ["--schedule-policy", cfg.schedule_policy] if cfg.schedule_policy else []
    return args + (["--disable-radix-cache"] if cfg.disable_radix_cache else [])


API_KEY_ENV = "ARTSG_SGLANG_API_KEY"
# SGLang 0.5.14 takes its key only as `--api-key` (server_args.py: a plain str flag, no
# environment variable and no key file; `SGLANG_API_KEY` is a client-side convention, not read
# by the server), and /proc/<pid>/cmdline is world-readable. So the server runs this instead of
# `python -m sglang.launch_server`: it moves the key from the environment (readable only by the
# same user) into sys.argv *inside* the process — the kernel's argv page, which is what
# /proc/<pid>/cmdline shows, never holds it — and runs launch_server's __main__, which parses
# `prepare_server_args(sys.argv[1:])`. Subprocesses SGLang spawns get the parsed ServerArgs by
# pickle, not by argv. Plain code rather than a module of ours: the server environment need not
# have artsg_nb installed. SGLang prints its ServerArgs (key included) to the log, which is
# therefore created 0600 (procs.spawn).
LAUNCHER = key_launcher("sglang.launch_server", API_KEY_ENV)


def validate(cfg) -> None:
    if (cfg.port or 0) > 55535 and "SGLANG_GRPC_PORT" not in cfg.env:
        raise ValueError(f"port={cfg.port}: SGLang derives a gRPC port = port + 10000, which "
                         "must stay ≤ 65535; use a port ≤ 55535 (or None for a free one)")


def raw_payload(ids: list[int], n: int, params, model: str) -> tuple[str, dict]:
    """/generate with ids in and logprobs out, as the client sends it, for bench.raw."""
    return "/generate", {"input_ids": ids, "return_logprob": True, "sampling_params": {
        "max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
        "ignore_eos": params.ignore_eos, "n": n}}


def raw_merge_chunks(chunks: list[dict]) -> list[dict]:
    """Streamed /generate chunks (cumulative, or deltas with --incremental-streaming-output) →
    one object per sample, by index."""
    by_index: dict[int, dict] = {}
    for chunk in chunks:
        i = chunk.get("index", 0)
        by_index[i] = merge_stream_chunk(by_index.get(i), chunk)
    return [by_index[i] for i in sorted(by_index)]


def raw_samples(answer, n_prompt: int) -> list[tuple[list[int], int, int]]:
    objs = answer if isinstance(answer, list) else [answer]
    return [(o["output_ids"], o["meta_info"]["prompt_tokens"], o["meta_info"].get("cached_tokens") or 0)
            for o in objs]


RAW = RawDialect(payload=raw_payload, merge_chunks=raw_merge_chunks, samples=raw_samples)

CHAT_TOKEN_IDS = {"return_meta_info": True, "return_prompt_token_ids": True}
"""What a chat completion asks for to get its ids back (protocol.py's ChatCompletionRequest)."""

SPEC = EngineSpec(
    name="sglang", client_class=SGLangClient, entry="sglang.launch_server", package="sglang",
    chat_token_ids=CHAT_TOKEN_IDS, raw=RAW,
    launch_args=launch_args, validate=validate, api_key_env=API_KEY_ENV, launcher=LAUNCHER, lora_n_problem=lora_n_problem,
    auth_probe="/model_info", tp_flag="--tp-size", mem_fraction_of="free", warm_up_from_flop=WARM_UP_FROM_FLOP,
    native_n="warm-up",
    python_var="ARTSG_SERVER_PYTHON", pythonpath_var="ARTSG_SERVER_PYTHONPATH", env_var="ARTSG_SERVER_ENV",
    conda_env="artsg-server", venv_dir=".venv-server",
    create_commands=("conda env create -f environment-server.yml", "make server-env"),
    metric_prefix="sglang:", prompt_counters=("sglang:prompt_tokens_total",),
    cached_counters=("sglang:cached_tokens_total",), progress_counters=("sglang:realtime_tokens_total",))
