"""Async HTTP clients for the inference engines: one dialect class per engine.

What it does: `SGLangClient` (also used for the CPU engine, which speaks SGLang's native API) and
`VLLMClient` (client_vllm.py) share one interface, `EngineClient`: generate with token ids in and
token ids + logprobs out, chat, load/unload LoRA adapters, flush the prefix cache, scrape
/metrics, and give the server's GPU memory back around training (`release_memory` /
`resume_memory`, client_memory.py). Every difference between the engines lives here and only here:

* adapter selection: SGLang /generate takes `lora_path: <name>`, its OpenAI routes take
  `model: "<served>:<adapter>"` (the bare adapter name silently serves the base model); vLLM
  takes `model: "<adapter>"`.
* logprobs: SGLang returns temperature-scaled logprobs; vLLM does only when started with
  `--logprobs-mode processed_logprobs` (`VLLMClient.check_logprobs_mode` verifies it).
* error bodies: `{"success": false, "error_message"}` (SGLang LoRA), `{"error": {"message"}}`
  (generic), `{"error": "<str>"}` (SGLang 0.5.23 strict sampling_params), plain text; all become
  `EngineError` or one of its subclasses, with the server's message and what to try.
* cached tokens: SGLang `meta_info.cached_tokens`; vLLM `usage.prompt_tokens_details`.

What it does not do: start servers (server.py), schedule requests (rollout.py), or retry (except
once, when the server dropped a kept-alive connection before reading the request). Everything is
async; `run_sync` runs a coroutine from sync code, also inside Jupyter.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import inspect
import itertools
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import httpx

from .client_memory import SGLangMemoryMixin

log = logging.getLogger(__name__)

POOL_CONNECTIONS = 64  # connections per httpx pool (see EngineClient.__init__)

# Called (or set) once, when the first output token of a streamed request arrives.
FirstTokenHook = Callable[[], Any] | asyncio.Event


@dataclass
class SamplingParams:
    """How to sample; the same fields mean the same thing on every engine."""

    max_new_tokens: int = 64
    """Upper bound on generated tokens per sample."""
    temperature: float = 1.0
    """Softmax temperature; returned logprobs are of this tempered distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    stop: list[str] | None = None
    """Stop strings (the stopping tokens stay in output_ids)."""
    stop_token_ids: list[int] | None = None
    """Extra token ids that end a sample (eos already does unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past eos (benchmarks with a fixed output length)."""
    n: int = 1
    """Samples per request (a GRPO group shares one prompt)."""
    seed: int | None = None
    """Per-request sampling seed; sample j of an n-request uses seed + j (SGLang `sampling_seed`,
    honoured only with --enable-deterministic-inference, and refused by the flashinfer sampler with
    top-p/top-k; vLLM `seed`; the CPU engine always). None: the server's own random stream."""


@dataclass
class Generation:
    """One sample, as the server produced it."""

    output_ids: list[int]
    logprobs: list[float]
    """Temperature-scaled logprob of each output id, aligned with output_ids."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    finish_reason: str
    """"stop" | "length" | "abort"."""
    text: str
    e2e_s: float
    """Seconds from sending the request to its complete response (client side)."""
    ttft_s: float | None = None
    """Seconds to the first output token; only measured when streamed (on_first_token)."""


class EngineError(RuntimeError):
    """The server refused or failed a request. `.status` is the HTTP status, `.body` its body."""

    def __init__(self, message: str, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.status, self.body = status, body


class AdapterExistsError(EngineError):
    """An adapter of that name is already loaded (names are immutable on SGLang)."""


class UnknownAdapterError(EngineError):
    """The server holds no adapter of that name."""


class AdapterRankError(EngineError):
    """The adapter's rank or target modules do not fit the server's LoRA memory pool."""


class ServerUnavailableError(EngineError):
    """No HTTP answer: the server is down, still starting, or too slow."""


class MemorySaverError(EngineError):
    """The server cannot release its memory as asked: started without the memory saver (SGLang
    --enable-memory-saver, vLLM --enable-sleep-mode), or "weights" asked without a weights backup."""


_EXISTS = ("already loaded", "already been loaded", "already exists")
_UNKNOWN = ("does not exist", "never been loaded", "cannot be found", "not found")
# Whole words: a path such as /home/frank/... in the message must not read as a rank problem.
_RANK = re.compile(r"\brank\b|target[ _-]modules?")
_HINTS = {
    AdapterExistsError: "Adapter names are immutable: load each version under a new name "
                        "(policy-step-N) from a new directory, or unload the old one first.",
    UnknownAdapterError: "Load it first with load_adapter(name, path); list_adapters() shows what "
                         "the server holds.",
    AdapterRankError: "Restart the server with --max-lora-rank at least the adapter's r and "
                      "--lora-target-modules covering its target_modules (or train a matching adapter).",
}


def server_message(body: Any) -> str:
    """The human-readable message inside any of the engines' error bodies."""
    if isinstance(body, dict):
        err = body.get("error")
        for msg in (body.get("error_message"), err.get("message") if isinstance(err, dict) else err,
                    body.get("detail"), body.get("message")):
            if msg:
                return str(msg)
    return str(body).strip() or "(empty body)"


def classify_error(status: int, message: str, op: str) -> type[EngineError]:
    """Which EngineError a failure is; `op` is "load", "unload", "use" (a request naming an
    adapter) or "other"."""
    low = message.lower()
    if op == "load" and any(s in low for s in _EXISTS):
        return AdapterExistsError
    if op == "load" and _RANK.search(low):
        return AdapterRankError
    if op in ("unload", "use") and (status == 404 or any(s in low for s in _UNKNOWN)):
        return UnknownAdapterError
    return EngineError


def normalise_finish_reason(raw: Any) -> str:
    """SGLang `{"type": ...}` dicts and OpenAI strings → "stop" | "length" | "abort"."""
    kind = raw.get("type") if isinstance(raw, dict) else raw
    if kind in ("stop", "length", "abort"):
        return kind
    if kind in ("eos", "stop_token", "stop_str"):
        return "stop"
    return "abort"  # None (cut off) or an engine-specific failure: never a usable sample


def response_body(resp: httpx.Response) -> Any:
    """JSON when the body is JSON, else its text (SGLang flush and vLLM load answer plain text)."""
    try:
        return resp.json()
    except ValueError:
        return resp.text


class EngineClient(abc.ABC):
    """What every engine dialect offers. Use `make_client`, or a subclass directly.

    base_url: e.g. "http://127.0.0.1:30000". served_model: the base model's served name (SGLang:
    --served-model-name, else the model path). api_key: sent as `Authorization: Bearer ...`.
    timeout_s: per request; generous because a rollout request can wait in the server's queue.
    transport: an httpx transport in place of the network (tests, in-process ASGI apps).
    """

    engine = "engine"
    route_hints: dict[str, str] = {}  # what to do when the server lacks a route (404 "Not Found")

    def __init__(self, base_url: str, served_model: str, api_key: str | None = None,
                 timeout_s: float = 600.0, max_connections: int = 1024,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.base_url, self.served_model, self.timeout_s = base_url.rstrip("/"), served_model, timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Rollouts send hundreds of concurrent requests; the httpx default (100 connections) would
        # queue them here. httpcore's pool does O(connections) work per request, so connections are
        # spread over pools of at most POOL_CONNECTIONS (about half the client CPU at 400 in flight).
        self._pool_count = max(1, math.ceil(max_connections / POOL_CONNECTIONS))
        per_pool = math.ceil(max_connections / self._pool_count)
        self._limits = httpx.Limits(max_connections=per_pool, max_keepalive_connections=per_pool)
        self._transport = transport
        self._pools: list[httpx.AsyncClient] | None = None
        self._turn = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._pools is not None and self._loop is asyncio.get_running_loop():
            await asyncio.gather(*(pool.aclose() for pool in self._pools))
        self._pools = self._loop = None

    # ---- the interface (dialects implement the engine-specific half) ------------------------
    async def generate(self, input_ids: list[int], params: SamplingParams | None = None,
                       adapter: str | None = None, on_first_token: FirstTokenHook | None = None,
                       ) -> list[Generation]:
        """Sample `params.n` continuations of `input_ids` (under `adapter`, else the base model).

        With `on_first_token` the request is streamed: the hook is called (an Event is set) when
        the first output token arrives, e.g. to release the next request of a group once the shared
        prefix is cached, and each Generation gets `ttft_s`.
        """
        params = params or SamplingParams()
        t0 = time.perf_counter()
        if on_first_token is None:
            gens, ttft_s = await self._generate(input_ids, params, adapter), None
        else:
            signal = _FirstToken(on_first_token, t0)
            gens = await self._generate_streamed(input_ids, params, adapter, signal)
            ttft_s = signal.ttft_s
        e2e_s = time.perf_counter() - t0
        if len(gens) != params.n:
            raise EngineError(f"{self.engine} returned {len(gens)} samples for n={params.n}")
        for g in gens:
            g.e2e_s, g.ttft_s = e2e_s, ttft_s
        return gens

    async def health(self, timeout_s: float = 30.0) -> bool:
        """True when GET /health answers 200; False when it does not (or nothing answers)."""
        try:
            return (await self._request("GET", "/health", timeout=timeout_s)).status_code == 200
        except EngineError:
            return False

    async def metrics_text(self) -> str:
        """The Prometheus /metrics text (parse it with metrics.py)."""
        return (await self._request("GET", "/metrics")).text

    async def list_adapters(self) -> dict[str, str]:
        """Adapters the server holds, name → path (from GET /v1/models)."""
        cards = (await self._request("GET", "/v1/models")).json()["data"]
        return {c["id"]: c.get("root") for c in cards if c.get("parent") and c["id"] != self.served_model}

    async def check_logprobs_mode(self) -> str | None:
        """The server's logprobs mode; raises EngineError if they are not of the tempered distribution."""
        return "processed_logprobs"  # SGLang (and the CPU engine) scale by temperature by default

    # ---- HTTP plumbing ----------------------------------------------------------------------
    def _client(self) -> httpx.AsyncClient:
        # An httpx client's connections belong to one event loop; run_sync (and each asyncio.run)
        # makes a new loop, so pools made on another loop are replaced, not reused.
        loop = asyncio.get_running_loop()
        if self._pools is None or self._loop is not loop:
            timeout = httpx.Timeout(self.timeout_s, connect=min(30.0, self.timeout_s))
            self._pools = [httpx.AsyncClient(base_url=self.base_url, headers=self._headers, limits=self._limits,
                                             timeout=timeout, transport=self._transport)
                           for _ in range(self._pool_count)]
            self._loop = loop
        return self._pools[next(self._turn) % len(self._pools)]

    async def _request(self, method: str, path: str, op: str = "other", **kwargs) -> httpx.Response:
        for attempt in range(2):
            try:
                resp = await self._client().request(method, path, **kwargs)
                break
            except httpx.RemoteProtocolError as e:
                # The server closed a kept-alive connection as the request went out (uvicorn drops
                # idle ones): the request was not served, so it is retried once on a new connection.
                if attempt:
                    raise self._unavailable(method, path, e) from e
            except httpx.HTTPError as e:
                raise self._unavailable(method, path, e) from e
        if resp.status_code >= 400:
            raise self._error(method, path, resp.status_code, response_body(resp), op)
        return resp

    async def _sse(self, path: str, payload: dict, op: str) -> AsyncIterator[dict]:
        """POST `payload` and yield each `data: {...}` event of the server-sent-event stream."""
        for attempt in range(2):
            started = False
            try:
                async with self._client().stream("POST", path, json=payload) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise self._error("POST", path, resp.status_code, response_body(resp), op)
                    async for line in resp.aiter_lines():
                        if (event := self._sse_event(line, path, op)) is None:
                            continue
                        if event == "[DONE]":
                            return
                        started = True
                        yield event
                return
            except httpx.RemoteProtocolError as e:  # as in _request, retried once if nothing came yet
                if started or attempt:
                    raise self._unavailable("POST", path, e) from e
            except httpx.HTTPError as e:
                raise self._unavailable("POST", path, e) from e

    def _sse_event(self, line: str, path: str, op: str) -> dict | str | None:
        """One SSE line → its JSON event, "[DONE]", or None (not a data line)."""
        if not line.startswith("data:"):
            return None
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return data
        event = json.loads(data)
        if "error" in event:  # a failure after the 200 header arrives as an event
            err = event["error"]
            status = err.get("code") if isinstance(err, dict) else None
            raise self._error("POST", path, status if isinstance(status, int) else 400, event, op)
        return event

    def _unavailable(self, method: str, path: str, err: Exception) -> ServerUnavailableError:
        what = f"no answer within {self.timeout_s:g} s" if isinstance(err, httpx.TimeoutException) else "no connection"
        return ServerUnavailableError(
            f"{self.engine} {method} {self.base_url}{path}: {what} ({type(err).__name__}: {err}). "
            "Is the server running and ready? Check server.alive() and server.log_tail().")

    def _error(self, method: str, path: str, status: int, body: Any, op: str) -> EngineError:
        message = server_message(body)
        cls = classify_error(status, message, op)
        if cls is not EngineError:
            hint = _HINTS[cls]
        elif status == 404 and message == "Not Found":
            hint = self.route_hints.get(path, f"This server has no {path} route: check the engine and its version.")
        elif status >= 500:
            hint = "The server failed; its log says why (server.log_tail())."
        else:
            hint = "The server's message says which part of the request it refused."
        sep = " " if message.endswith(".") else ". "
        return cls(f"{self.engine} {method} {path} → HTTP {status}: {message}{sep}{hint}", status, body)

    # ---- implemented by each dialect ---------------------------------------------------------
    @abc.abstractmethod
    async def chat(self, messages: list[dict], params: SamplingParams | None = None,
                   adapter: str | None = None, logprobs: bool = True, **extra) -> dict:
        """POST /v1/chat/completions; the OpenAI-shaped response as it comes. `extra` is merged
        into the request body (e.g. SGLang return_meta_info=True, vLLM return_token_ids=True)."""

    @abc.abstractmethod
    async def load_adapter(self, name: str, path: str) -> float:
        """Load the adapter at `path` under `name`; seconds taken. Load each version under a new
        name from a new directory (SGLang names are immutable; vLLM caches KV by name and path)."""

    @abc.abstractmethod
    async def unload_adapter(self, name: str) -> None:
        """Unload `name`; UnknownAdapterError when the server does not hold it."""

    @abc.abstractmethod
    async def flush_cache(self, timeout_s: float | None = None) -> None:
        """Empty the prefix cache; refused while requests run unless idle within `timeout_s`."""

    @abc.abstractmethod
    async def server_info(self) -> dict:
        """The server's resolved configuration."""

    @abc.abstractmethod
    async def score(self, input_ids: list[int], adapter: str | None = None,
                    temperature: float = 1.0) -> list[float]:
        """log p(input_ids[i] | input_ids[:i]) for i = 1..len-1 (len(input_ids) - 1 values)."""

    @abc.abstractmethod
    async def _generate(self, input_ids, params, adapter) -> list[Generation]: ...

    @abc.abstractmethod
    async def _generate_streamed(self, input_ids, params, adapter, signal) -> list[Generation]: ...


class _FirstToken:
    """Fires the caller's first-token hook once and records the time to first token."""

    def __init__(self, hook: FirstTokenHook, t0: float):
        self.hook, self.t0, self.ttft_s = hook, t0, None

    async def fire(self) -> None:
        if self.ttft_s is not None:
            return
        self.ttft_s = time.perf_counter() - self.t0
        if isinstance(self.hook, asyncio.Event):
            self.hook.set()
        elif inspect.isawaitable(result := self.hook()):
            await result


class SGLangClient(SGLangMemoryMixin, EngineClient):
    """SGLang's native API (/generate with input_ids), and the CPU engine's, which copies it."""

    engine = "sglang"
    route_hints = {
        "/metrics": "Start SGLang with --enable-metrics.",
        "/load_lora_adapter": "This SGLang has no runtime LoRA loading: use SGLang >= 0.4.10.",
        "/release_memory_occupation": "This server cannot release memory: use SGLang 0.5.x, or run without it.",
    }

    async def _generate(self, input_ids, params, adapter) -> list[Generation]:
        resp = await self._request("POST", "/generate", "use" if adapter else "other",
                                   json=self._generate_payload(input_ids, params, adapter))
        body = resp.json()
        # One prompt with n > 1 comes back as a list of n objects, n == 1 as one object.
        return [self._parse_sample(obj) for obj in (body if isinstance(body, list) else [body])]

    async def _generate_streamed(self, input_ids, params, adapter, signal) -> list[Generation]:
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
        # SGLang >= 0.5.23 rejects unknown sampling keys (400), so send only what is set.
        if params.stop:
            sampling["stop"] = list(params.stop)
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
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
        # "<served>:<adapter>" selects the adapter; the bare adapter name would serve the base model.
        model = f"{self.served_model}:{adapter}" if adapter else self.served_model
        payload = chat_payload(model, messages, params or SamplingParams(), logprobs, extra)
        return (await self._request("POST", "/v1/chat/completions", "use" if adapter else "other",
                                    json=payload)).json()

    async def load_adapter(self, name: str, path: str) -> float:
        t0 = time.perf_counter()
        await self._lora_call("/load_lora_adapter", {"lora_name": name, "lora_path": path}, "load")
        return time.perf_counter() - t0

    async def unload_adapter(self, name: str) -> None:
        """Unload `name` (the server first waits for in-flight requests that use it)."""
        await self._lora_call("/unload_lora_adapter", {"lora_name": name}, "unload")

    async def _lora_call(self, path: str, payload: dict, op: str) -> dict:
        body = (await self._request("POST", path, op, json=payload)).json()
        if not body.get("success", False):  # a 200 carrying success: false is a failure too
            raise self._error("POST", path, 200, body, op)
        return body

    async def flush_cache(self, timeout_s: float | None = None) -> None:
        """Empty the prefix cache. The server refuses (400) while requests run; with `timeout_s`
        SGLang >= 0.5.23 waits up to that long for idle."""
        params = {"timeout": timeout_s} if timeout_s else None
        await self._request("POST", "/flush_cache", params=params)

    async def server_info(self) -> dict:
        """The resolved server arguments (GET /server_info, else the older /get_server_info)."""
        try:
            return (await self._request("GET", "/server_info")).json()
        except EngineError as e:
            if e.status != 404:
                raise
        return (await self._request("GET", "/get_server_info")).json()

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


def chat_payload(model: str, messages: list[dict], params: SamplingParams, logprobs: bool, extra: dict) -> dict:
    """An OpenAI chat request body; SGLang and vLLM both accept stop_token_ids / ignore_eos."""
    payload = {"model": model, "messages": messages, "max_tokens": params.max_new_tokens,
               "temperature": params.temperature, "top_p": params.top_p, "n": params.n, "logprobs": logprobs}
    if params.stop:
        payload["stop"] = list(params.stop)
    if params.stop_token_ids:
        payload["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        payload["ignore_eos"] = True
    if params.seed is not None:
        payload["seed"] = params.seed
    return {**payload, **extra}


def make_client(engine: str, base_url: str, served_model: str, api_key: str | None = None,
                timeout_s: float = 600.0, **kwargs) -> EngineClient:
    """The client for `engine`: "sglang", "cpu" (speaks SGLang's API) or "vllm"."""
    if engine in ("sglang", "cpu"):
        client = SGLangClient(base_url, served_model, api_key=api_key, timeout_s=timeout_s, **kwargs)
        client.engine = engine
        return client
    if engine == "vllm":
        from .client_vllm import VLLMClient

        return VLLMClient(base_url, served_model, api_key=api_key, timeout_s=timeout_s, **kwargs)
    raise ValueError(f"unknown engine {engine!r}: expected 'sglang', 'cpu' or 'vllm'")


def run_sync(coro):
    """Run a coroutine to completion from sync code, also where a loop already runs (Jupyter):
    there it runs on a fresh loop in a worker thread. In a notebook cell prefer `await`."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
