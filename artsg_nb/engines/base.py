"""What every engine dialect shares: sampling parameters, samples, errors and the HTTP transport.

What it does: `EngineClient` is the interface every engine's client offers — generate with token
ids in and token ids + logprobs out, chat, load/unload LoRA adapters, flush the prefix cache,
scrape /metrics, release/resume the server's GPU memory around training — and the HTTP/SSE
plumbing under it (pooled httpx clients, one retry of a request the server dropped on a
kept-alive connection, error bodies of every engine turned into `EngineError` subclasses with
what to try). Also here: the vocabulary of memory release (`MEMORY_TAGS`), and `run_sync`.

What it does not do: anything that differs between engines (sglang.py, vllm.py, cpu.py), start
servers (server.py), schedule requests (rollout.py), or retry beyond that one dropped connection.
Everything is async; `run_sync` runs a coroutine from sync code, also inside Jupyter.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import functools
import inspect
import itertools
import json
import logging
import math
import ssl
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable

import httpx

from .errors import (AdminTimeoutError, EngineError, ServerUnavailableError, classify_error, hint_for,
                     server_message)

log = logging.getLogger(__name__)

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""What SGLang can release (`sglang/srt/constants.py:2-10`)."""
DEFAULT_TAGS = ("kv_cache", "cuda_graph")
"""Safe with LoRA and without a weights backup; the KV cache is most of the server's share."""
_START_WITH = ("Start the server with ServerConfig(enable_memory_saver=True) (SGLang --enable-memory-saver, "
               "vLLM --enable-sleep-mode) and install torch_memory_saver in the server environment "
               "(offline GPU bundle: .whl-tms, see tools/gpu/README.md), or train without release_memory.")


def memory_tags(tags: Iterable[str]) -> tuple[str, ...]:
    """`tags` checked against MEMORY_TAGS, duplicates dropped; ValueError names the valid ones."""
    tags = (tags,) if isinstance(tags, str) else tuple(dict.fromkeys(tags))
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown or not tags:
        raise ValueError(f"memory tags {list(tags)}: choose one or more of {list(MEMORY_TAGS)} "
                         "(SGLang ignores unknown tags silently, so they are refused here)")
    return tags


def saver_problem(info: dict, tags: tuple[str, ...], engine: str = "sglang",
                  flag: str = "--enable-memory-saver") -> str | None:
    """Why a server with these resolved flags cannot release `tags`; None when it can."""
    if not info.get("enable_memory_saver"):
        return (f"{engine} was started without {flag}, so it cannot release its memory (SGLang would "
                f"answer 200 and free nothing). {_START_WITH}")
    if "weights" in tags and not info.get("enable_weights_cpu_backup"):
        return (f"{engine} was started without --enable-weights-cpu-backup, so releasing 'weights' would "
                "discard the base model (resume maps uninitialised memory). Release only "
                f"{list(DEFAULT_TAGS)}, or start it with ServerConfig(enable_weights_cpu_backup=True).")
    return None


POOL_CONNECTIONS = 64  # connections per httpx pool (see EngineClient.__init__)
KEEPALIVE_EXPIRY_S = 2.0
"""Idle connections are dropped by the client after this long, well before the server drops them
(uvicorn's timeout_keep_alive is 5 s): at equal expiries a request may go out on a connection the
server is closing at that moment (2.3 % of requests in a probe failed so)."""
# What a connection the server closed under a request raises before any byte of the answer came.
_DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)

ADMIN_TIMEOUT_S = 60.0
"""Default seconds an admin call (adapter load/unload, memory release/resume, cache flush, info and
metrics) may take before it counts as hung. Each takes well under a second on a healthy server; a
stuck one (SGLang 0.5.14's unload after n > 1 requests, sglang#36894) would otherwise hold a cell
for the 600 s request timeout."""


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One verifying TLS context for every pool of every client in this process. httpx builds a
    new one per AsyncClient (loading the CA bundle each time: ~20 ms), and a client makes 16 pools
    on each event loop it meets (`EngineClient._client`): 0.3 s before a run's first request, and
    again after every server restart, for servers that are plain http:// on 127.0.0.1 anyway."""
    return httpx.create_ssl_context()  # what httpx's verify=True builds (certifi)


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

    def optional_fields(self, seed_key: str) -> dict:
        """stop, stop_token_ids and the seed (under the engine's `seed_key`), only those set:
        engines refuse or misread explicit nulls (SGLang >= 0.5.23 rejects unknown keys)."""
        fields = {"stop": list(self.stop or ()), "stop_token_ids": list(self.stop_token_ids or ()),
                  seed_key: self.seed}
        return {k: v for k, v in fields.items() if v not in (None, [])}


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
    submission: str | None = None
    """How this sample of an n > 1 request reached the server, which decides what the prefix
    cache could serve it: "warm-up first" (its prompt was cached by a prefill-only request before
    it: a warm-up, or the engine's own for native n), "prefilled together" (the n copies computed in
    one batch on purpose: nothing to reuse), "first copy" / "after first copy" (the engine
    prefills the copies one after another: all but the first read the first's prompt); None for a
    plain n = 1 request, or an engine that does not say (SUBMISSIONS)."""


SUBMISSIONS = ("warm-up first", "prefilled together", "first copy", "after first copy")
"""Values of Generation.submission; "warm-up first" and "after first copy" read the whole prompt
(less its last token) from the cache, the other two nothing."""


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
    timeout_s: per generation request; generous because a rollout request can wait in the server's queue.
    admin_timeout_s: per admin call (load/unload, release/resume, flush, info, metrics): seconds,
    not minutes, so a stuck one raises AdminTimeoutError naming the operation instead of hanging.
    transport: an httpx transport in place of the network (tests, in-process ASGI apps).
    """

    engine = "engine"
    route_hints: dict[str, str] = {}  # what to do when the server lacks a route (404 "Not Found")

    def __init__(self, base_url: str, served_model: str, api_key: str | None = None,
                 timeout_s: float = 600.0, max_connections: int = 1024,
                 transport: httpx.AsyncBaseTransport | None = None, admin_timeout_s: float = ADMIN_TIMEOUT_S):
        self.base_url, self.served_model, self.timeout_s = base_url.rstrip("/"), served_model, timeout_s
        self.admin_timeout_s = admin_timeout_s
        self.in_flight = 0
        """Generation requests sent and not yet answered (the watchdog's "is work outstanding")."""
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Rollouts send hundreds of concurrent requests; the httpx default (100 connections) would
        # queue them here. httpcore's pool does O(connections) work per request, so connections are
        # spread over pools of at most POOL_CONNECTIONS (about half the client CPU at 400 in flight).
        self._pool_count = max(1, math.ceil(max_connections / POOL_CONNECTIONS))
        per_pool = math.ceil(max_connections / self._pool_count)
        self._limits = httpx.Limits(max_connections=per_pool, max_keepalive_connections=per_pool,
                                    keepalive_expiry=KEEPALIVE_EXPIRY_S)
        self._transport = transport
        self._wrap: Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport] | None = None
        self._pools: list[httpx.AsyncClient] | None = None
        self._turn = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def auth_headers(self) -> dict[str, str]:
        """The Authorization header this client sends (for a raw httpx baseline of the same server)."""
        return dict(self._headers)

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
        self.in_flight += 1
        try:
            if on_first_token is None:
                gens, ttft_s = await self._generate(input_ids, params, adapter), None
            else:
                signal = _FirstToken(on_first_token, t0)
                gens = await self._generate_streamed(input_ids, params, adapter, signal)
                ttft_s = signal.ttft_s
        finally:
            self.in_flight -= 1
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
        return (await self._admin("GET", "/metrics", "read the metrics")).text

    async def list_adapters(self) -> dict[str, str]:
        """Adapters the server holds, name → path (from GET /v1/models)."""
        cards = (await self._admin("GET", "/v1/models", "list the adapters")).json()["data"]
        return {c["id"]: c.get("root") for c in cards if c.get("parent") and c["id"] != self.served_model}

    async def check_logprobs_mode(self) -> str | None:
        """The server's logprobs mode; raises EngineError if they are not of the tempered distribution."""
        return "processed_logprobs"  # SGLang (and the CPU engine) scale by temperature by default

    async def wrap_transport(self, wrap: Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport]) -> None:
        """Send every later request through `wrap(transport)` (the network's, or the one given at
        construction): the seam a measuring tool times requests at (tools/gpu/step_profile.py).
        The wrapper must pass requests and answers through unchanged. The pools made so far are
        closed; the next request makes new ones, each over its own wrapped transport."""
        await self.aclose()
        self._wrap = wrap

    # ---- HTTP plumbing ----------------------------------------------------------------------
    def _pool_transport(self) -> httpx.AsyncBaseTransport | None:
        """A new pool's transport: the one given, else httpx's default (None) — or, once
        `wrap_transport` was called, either one wrapped (the default then made here, with the
        limits and TLS settings the pool would give it)."""
        if self._wrap is None:
            return self._transport
        return self._wrap(self._transport or httpx.AsyncHTTPTransport(verify=tls_context(), limits=self._limits))

    def _client(self) -> httpx.AsyncClient:
        # An httpx client's connections belong to one event loop; run_sync (and each asyncio.run)
        # makes a new loop, so pools made on another loop are replaced, not reused.
        loop = asyncio.get_running_loop()
        if self._pools is None or self._loop is not loop:
            timeout = httpx.Timeout(self.timeout_s, connect=min(30.0, self.timeout_s))
            self._pools = [httpx.AsyncClient(base_url=self.base_url, headers=self._headers, limits=self._limits,
                                             timeout=timeout, transport=self._pool_transport(), verify=tls_context())
                           for _ in range(self._pool_count)]
            self._loop = loop
        return self._pools[next(self._turn) % len(self._pools)]

    async def _admin(self, method: str, path: str, what: str, op: str = "other", timeout_s: float | None = None,
                     **kwargs) -> httpx.Response:
        """An admin call under its own timeout (`admin_timeout_s` unless `timeout_s`): past it,
        AdminTimeoutError says which operation hung, instead of the generation timeout's wait."""
        limit_s = timeout_s or self.admin_timeout_s
        if not limit_s or limit_s <= 0:  # admin_timeout_s=0: no own limit, the generation timeout applies
            return await self._request(method, path, op, **kwargs)
        try:
            return await self._request(method, path, op, timeout=httpx.Timeout(limit_s, connect=min(30.0, limit_s)),
                                       **kwargs)
        except ServerUnavailableError as e:
            if not isinstance(e.__cause__, httpx.TimeoutException):
                raise
            raise AdminTimeoutError(
                f"{self.engine} did not {what} within {limit_s:g} s ({method} {self.base_url}{path}); the server may "
                "still answer /health, but this operation hung (SGLang's unload after n > 1 requests does: "
                "sglang#36894). Inside a GRPORun the server is restarted and the step redone. Its log says where it "
                "stopped (server.log_tail()); if the operation is only slow here (a large adapter on a network "
                "disk), raise RunConfig.admin_timeout_s.", operation=what) from e

    async def _request(self, method: str, path: str, op: str = "other", **kwargs) -> httpx.Response:
        """One request; `resp.retried` says whether it went out twice (see below). An error
        answer raises EngineError, its `.retried` set the same way."""
        client = self._client()
        for attempt in range(2):
            request = client.build_request(method, path, **kwargs)
            try:
                resp = await client.send(request, stream=True)
            except _DROPPED as e:
                # The server closed a kept-alive connection as the request went out (uvicorn drops
                # idle ones), before any byte of an answer: retried once on a new connection.
                # Safe for every route used here: a /generate that was served anyway only cost
                # compute, and a load that was served answers "already loaded" (load_adapter).
                if attempt:
                    raise self._unavailable(method, path, e, kwargs.get("timeout")) from e
                log.info("%s %s%s: connection dropped before an answer (%s); retrying once", method,
                         self.base_url, path, type(e).__name__)
                continue
            except httpx.HTTPError as e:
                raise self._unavailable(method, path, e, kwargs.get("timeout")) from e
            try:
                await resp.aread()  # a drop in the middle of an answer is not retried
            except httpx.HTTPError as e:
                raise self._unavailable(method, path, e, kwargs.get("timeout")) from e
            finally:
                await resp.aclose()
            break
        resp.retried = bool(attempt)
        if resp.status_code >= 400:
            err = self._error(method, path, resp.status_code, response_body(resp), op)
            err.retried = resp.retried
            raise err
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
            except _DROPPED as e:  # as in _request, retried once if nothing came yet
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

    def _unavailable(self, method: str, path: str, err: Exception,
                     timeout: httpx.Timeout | None = None) -> ServerUnavailableError:
        limit_s = timeout.read if isinstance(timeout, httpx.Timeout) else self.timeout_s
        what = f"no answer within {limit_s:g} s" if isinstance(err, httpx.TimeoutException) else "no connection"
        return ServerUnavailableError(
            f"{self.engine} {method} {self.base_url}{path}: {what} ({type(err).__name__}: {err}). "
            "Is the server running and ready? Check server.alive() and server.log_tail().")

    def _error(self, method: str, path: str, status: int, body: Any, op: str) -> EngineError:
        message = server_message(body)
        cls = classify_error(status, message, op)
        if cls is not EngineError:
            hint = hint_for(cls)
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


def chat_payload(model: str, messages: list[dict], params: SamplingParams, logprobs: bool, extra: dict) -> dict:
    """An OpenAI chat request body; SGLang and vLLM both accept stop_token_ids / ignore_eos."""
    payload = {"model": model, "messages": messages, "max_tokens": params.max_new_tokens,
               "temperature": params.temperature, "top_p": params.top_p, "n": params.n, "logprobs": logprobs}
    if params.ignore_eos:
        payload["ignore_eos"] = True
    return {**payload, **params.optional_fields(seed_key="seed"), **extra}




def run_sync(coro):
    """Run a coroutine to completion from sync code, also where a loop already runs (Jupyter):
    there it runs on a fresh loop in a worker thread. In a notebook cell prefer `await`."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
