"""vLLM, the baseline users compare SGLang against: its HTTP dialect, launch, environment, metrics.

What it does: generate through POST /v1/completions with the prompt as a token-id list and
`return_token_ids`, so ids and logprobs come from the server (never re-tokenised); select an
adapter with `"model": "<adapter>"`; load/unload adapters through /v1/load_lora_adapter (needs
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; success is a plain-text 200); flush with /reset_prefix_cache
(needs VLLM_SERVER_DEV_MODE=1). Cached tokens appear only with --enable-prompt-tokens-details.
Around training, `release_memory` puts the server to sleep (POST /sleep?level=1&mode=wait: weights
offloaded to CPU RAM, KV cache discarded, whatever the tags; `mode=wait` lets running requests
finish) and `resume_memory` wakes it (POST /wake_up); both are dev-mode routes and need the server
started with --enable-sleep-mode (vLLM 0.26: vllm/entrypoints/serve/dev/sleep/api_router.py,
vllm/v1/engine/core.py `sleep`).

SPEC launches `vllm.entrypoints.openai.api_server` with runtime LoRA updating and dev-mode routes
(both by environment), prefix caching, `--logprobs-mode processed_logprobs` and prompt-token
details; vLLM accepts only the LoRA ranks in VLLM_LORA_RANKS.

What it does not do: anything engine-neutral (base.py), or vLLM's RL weight-sync routes.
vLLM's default logprobs are pre-temperature; `check_logprobs_mode` catches a server started
without `--logprobs-mode processed_logprobs`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .base import (DEFAULT_TAGS, EngineClient, Generation, SamplingParams, chat_payload, memory_tags,
                   normalise_finish_reason, response_body, saver_problem)
from .errors import AdapterExistsError, EngineError, MemorySaverError
from .spec import EngineSpec, RawDialect

log = logging.getLogger(__name__)

_RUNTIME_LORA = "Set VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in the vLLM server's environment."
_DEV_MODE = "Set VLLM_SERVER_DEV_MODE=1 in the vLLM server's environment."


class VLLMClient(EngineClient):
    """vLLM's OpenAI-compatible server."""

    engine = "vllm"
    route_hints = {
        "/v1/load_lora_adapter": _RUNTIME_LORA,
        "/v1/unload_lora_adapter": _RUNTIME_LORA,
        "/reset_prefix_cache": _DEV_MODE,
        "/server_info": _DEV_MODE,
        "/sleep": _DEV_MODE,
        "/wake_up": _DEV_MODE,
    }
    released_tags: tuple[str, ...] = ()
    """("weights", "kv_cache") while this client has the server asleep."""

    def _model(self, adapter: str | None) -> str:
        return adapter or self.served_model  # vLLM: the adapter's own name selects it

    def _generate_payload(self, input_ids: list[int], params: SamplingParams, adapter: str | None) -> dict:
        payload = {"model": self._model(adapter), "prompt": list(input_ids), "max_tokens": params.max_new_tokens,
                   "temperature": params.temperature, "top_p": params.top_p, "n": params.n,
                   "ignore_eos": params.ignore_eos, "return_token_ids": True,
                   "logprobs": 1}  # the sampled token's logprob is always included; top-1 is free
        payload.update(params.optional_fields(seed_key="seed"))
        return payload

    async def _generate(self, input_ids, params, adapter) -> list[Generation]:
        resp = await self._request("POST", "/v1/completions", "use" if adapter else "other",
                                   json=self._generate_payload(input_ids, params, adapter))
        body = resp.json()
        cached = cached_tokens(body.get("usage"))
        return [self._parse_choice(c, len(input_ids), cached) for c in sorted(body["choices"], key=_index)]

    async def _generate_streamed(self, input_ids, params, adapter, signal) -> list[Generation]:
        payload = {**self._generate_payload(input_ids, params, adapter),
                   "stream": True, "stream_options": {"include_usage": True}}
        # Each chunk carries deltas per choice index; usage arrives in the last chunk.
        choices: dict[int, dict] = {}
        usage = None
        async for chunk in self._sse("/v1/completions", payload, "use" if adapter else "other"):
            usage = chunk.get("usage") or usage
            for delta in chunk.get("choices") or []:
                acc = choices.setdefault(_index(delta), {"index": _index(delta), "token_ids": [], "text": "",
                                                         "logprobs": {"token_logprobs": []}, "finish_reason": None})
                acc["token_ids"] += delta.get("token_ids") or []
                acc["logprobs"]["token_logprobs"] += (delta.get("logprobs") or {}).get("token_logprobs") or []
                acc["text"] += delta.get("text") or ""
                acc["finish_reason"] = delta.get("finish_reason") or acc["finish_reason"]
                if delta.get("token_ids"):
                    await signal.fire()
        cached = cached_tokens(usage)
        return [self._parse_choice(choices[i], len(input_ids), cached) for i in sorted(choices)]

    def _parse_choice(self, choice: dict, prompt_tokens: int, cached: int) -> Generation:
        ids = list(choice.get("token_ids") or [])
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(lps) != len(ids) or any(lp is None for lp in lps):
            raise EngineError(
                f"vLLM returned {len(ids)} token_ids but {len(lps)} logprobs: they cannot be aligned. "
                "The request sends return_token_ids and logprobs; does this vLLM support return_token_ids?",
                body=choice)
        finish = normalise_finish_reason(choice.get("finish_reason"))
        if finish == "abort":
            log.warning("vllm aborted a request: finish_reason=%s", choice.get("finish_reason"))
        return Generation(output_ids=ids, logprobs=[float(x) for x in lps], prompt_tokens=prompt_tokens,
                          cached_tokens=cached, finish_reason=finish, text=choice.get("text") or "", e2e_s=0.0)

    async def chat(self, messages: list[dict], params: SamplingParams | None = None,
                   adapter: str | None = None, logprobs: bool = True, **extra) -> dict:
        payload = chat_payload(self._model(adapter), messages, params or SamplingParams(), logprobs, extra)
        return (await self._request("POST", "/v1/chat/completions", "use" if adapter else "other",
                                    json=payload)).json()

    async def load_adapter(self, name: str, path: str) -> float:
        # Never load_inplace from one path: vLLM keys its prefix cache by (name, path) → stale KV.
        t0 = time.perf_counter()
        try:
            await self._admin("POST", "/v1/load_lora_adapter", f"load adapter {name}", "load",
                              json={"lora_name": name, "lora_path": path})
        except AdapterExistsError as e:  # sent twice and served the first time (base.EngineClient._request)
            if not (e.retried and (await self.list_adapters()).get(name) == path):
                raise
        return time.perf_counter() - t0

    async def unload_adapter(self, name: str) -> None:
        await self._admin("POST", "/v1/unload_lora_adapter", f"unload adapter {name}", "unload", json={"lora_name": name})

    async def flush_cache(self, timeout_s: float | None = None) -> None:
        """Reset the prefix cache (dev-mode route). vLLM refuses while blocks are in use; with
        `timeout_s` it is retried until then."""
        deadline = time.monotonic() + (timeout_s or 0)
        while True:
            body = response_body(await self._admin("POST", "/reset_prefix_cache", "reset the prefix cache"))
            if not isinstance(body, dict) or body.get("success", True):
                return
            if time.monotonic() >= deadline:
                raise EngineError("vllm POST /reset_prefix_cache → success: false (blocks are still in use "
                                  "by running requests). Flush when no request is in flight, or pass "
                                  "timeout_s to retry.", 200, body)
            await asyncio.sleep(0.2)

    async def server_info(self) -> dict:
        """The server's full configuration (dev-mode route)."""
        return (await self._admin("GET", "/server_info", "report its configuration", params={"config_format": "json"})).json()

    async def check_memory_saver(self, tags=DEFAULT_TAGS) -> None:
        """Raise MemorySaverError unless the server runs with --enable-sleep-mode (read from the
        dev-mode /server_info)."""
        memory_tags(tags)
        try:
            sleep_mode = find_key(await self.server_info(), "enable_sleep_mode")
        except EngineError as e:
            if e.status != 404:
                raise
            raise MemorySaverError(f"vllm has no /server_info, so sleep mode cannot be checked. {_DEV_MODE}") from e
        # Level 1 always keeps a CPU copy of the weights: no backup flag to check.
        problem = saver_problem({"enable_memory_saver": sleep_mode}, (), "vllm", "--enable-sleep-mode")
        if problem:
            raise MemorySaverError(problem, body={"enable_sleep_mode": sleep_mode})

    async def release_memory(self, tags=DEFAULT_TAGS, idle_timeout_s: float = 60.0) -> float:
        """Sleep at level 1 (weights to CPU RAM, KV cache dropped: vLLM frees both whatever the
        tags); seconds taken. Running requests finish first (mode=wait; idle_timeout_s is unused)."""
        memory_tags(tags)
        if self.released_tags:
            raise EngineError("vllm is already asleep (released by this client); call resume_memory() first")
        await self.check_memory_saver()
        t0 = time.perf_counter()
        # mode=wait lets running requests finish first: allow for that beyond the admin timeout.
        await self._admin("POST", "/sleep", "sleep (release memory)", params={"level": 1, "mode": "wait"},
                          timeout_s=self.admin_timeout_s + idle_timeout_s)
        self.released_tags = ("weights", "kv_cache")
        return time.perf_counter() - t0

    async def resume_memory(self) -> float:
        """Wake the server up (all tags); seconds taken. Not asleep by this client: 0.0."""
        if not self.released_tags:
            return 0.0
        t0 = time.perf_counter()
        await self._admin("POST", "/wake_up", "wake up (resume memory)")
        self.released_tags = ()
        return time.perf_counter() - t0

    async def check_logprobs_mode(self) -> str | None:
        """The server's --logprobs-mode; raises EngineError unless it is processed_logprobs.
        None when it cannot be read (the server is not in dev mode)."""
        try:
            mode = find_key(await self.server_info(), "logprobs_mode")
        except EngineError as e:
            if e.status != 404:
                raise
            log.info("cannot read vLLM's --logprobs-mode (no /server_info without VLLM_SERVER_DEV_MODE=1)")
            return None
        if mode is not None and "processed_logprobs" not in str(mode):
            raise EngineError(
                f"vLLM runs with --logprobs-mode {mode}: its logprobs are not of the tempered distribution "
                "the samples come from, so importance ratios would be wrong. Restart it with "
                "--logprobs-mode processed_logprobs.")
        return None if mode is None else str(mode)

    async def score(self, input_ids: list[int], adapter: str | None = None,
                    temperature: float = 1.0) -> list[float]:
        # vLLM prompt logprobs: [None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]
        payload = {"model": self._model(adapter), "prompt": list(input_ids), "max_tokens": 1,
                   "temperature": temperature, "prompt_logprobs": 0}
        body = (await self._request("POST", "/v1/completions", "use" if adapter else "other", json=payload)).json()
        entries = body["choices"][0]["prompt_logprobs"]
        return [float(entry[str(tok)]["logprob"]) for entry, tok in zip(entries[1:], input_ids[1:])]


def cached_tokens(usage: dict | None) -> int:
    """usage.prompt_tokens_details.cached_tokens, 0 when absent (vLLM reports it only with
    --enable-prompt-tokens-details)."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def find_key(obj: Any, key: str) -> Any:
    """The first value of `key` anywhere in nested dicts/lists, else None."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for item in obj:
            if (found := find_key(item, key)) is not None:
                return found
    return None


def _index(choice: dict) -> int:
    return int(choice.get("index", 0))


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The only --max-lora-rank values vLLM accepts."""


def launch_args(cfg, port: int) -> list[str]:
    """The flags for a server.ServerConfig `cfg` listening on `port`."""
    args = ["--model", cfg.model_path, "--host", cfg.host, "--port", str(port),
            "--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank),
            "--max-loras", str(cfg.max_loras_per_batch),
            "--no-enable-prefix-caching" if cfg.disable_radix_cache else "--enable-prefix-caching",
            "--logprobs-mode", "processed_logprobs",  # post-temperature, like SGLang (fact 4)
            "--enable-prompt-tokens-details"]         # cached_tokens in usage
    if (mem := cfg.resolved_mem_fraction()) is not None:
        args += ["--gpu-memory-utilization", f"{mem:g}"]
    return args + (["--enable-sleep-mode"] if cfg.enable_memory_saver else [])



def validate(cfg) -> None:
    if cfg.max_lora_rank not in VLLM_LORA_RANKS:
        ok = min(r for r in VLLM_LORA_RANKS if r >= cfg.max_lora_rank) if cfg.max_lora_rank <= 512 else 512
        raise ValueError(f"vLLM accepts max_lora_rank only in {VLLM_LORA_RANKS}, got "
                         f"{cfg.max_lora_rank}; use {ok} (adapters of smaller rank still load)")


def raw_payload(ids: list[int], n: int, params, model: str) -> tuple[str, dict]:
    """/v1/completions with ids in (`prompt` as a list) and token ids out, for bench.raw."""
    return "/v1/completions", {
        "model": model, "prompt": ids, "max_tokens": params.max_new_tokens, "n": n,
        "temperature": params.temperature, "top_p": params.top_p, "ignore_eos": params.ignore_eos,
        "return_token_ids": True, "logprobs": 1}


def raw_merge_chunks(chunks: list[dict]) -> dict:
    """Streamed completion chunks (deltas of token_ids per choice; usage in the last) → one answer."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for c in chunk.get("choices") or []:
            acc = choices.setdefault(c.get("index", 0), {"index": c.get("index", 0), "token_ids": []})
            acc["token_ids"] += c.get("token_ids") or []
    return {"choices": list(choices.values()), "usage": usage}


def raw_samples(answer: dict, n_prompt: int) -> list[tuple[list[int], int, int]]:
    cached = ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return [(c.get("token_ids") or [], n_prompt, cached) for c in sorted(answer["choices"], key=lambda c: c.get("index", 0))]


RAW = RawDialect(payload=raw_payload, merge_chunks=raw_merge_chunks, samples=raw_samples,
                 stream_fields={"stream_options": {"include_usage": True}})


SPEC = EngineSpec(
    name="vllm", client_class=VLLMClient, entry="vllm.entrypoints.openai.api_server", package="vllm",
    launch_args=launch_args, validate=validate, ignored_options=("schedule_policy",),
    tp_flag="--tensor-parallel-size", chat_token_ids={"return_token_ids": True}, raw=RAW,
    # vLLM reads its key from VLLM_API_KEY when --api-key is absent (vllm/envs.py; the app's
    # AuthenticationMiddleware in api_server.py), so it never goes on the command line. vLLM
    # guards only the routes of its OpenAI API (/v1/...): the dev routes (/sleep, /wake_up,
    # /reset_prefix_cache) answer without a key — keep VLLM_SERVER_DEV_MODE servers on 127.0.0.1.
    api_key_env="VLLM_API_KEY", auth_probe="/v1/models",
    server_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",  # /v1/load_lora_adapter exists only with it
                "VLLM_SERVER_DEV_MODE": "1"},             # /reset_prefix_cache, /sleep, /wake_up
    python_var="ARTSG_VLLM_PYTHON", pythonpath_var="ARTSG_VLLM_PYTHONPATH", env_var="ARTSG_VLLM_ENV",
    conda_env="artsg-vllm", venv_dir=".venv-vllm",
    create_commands=("conda env create -f environment-vllm.yml", "make vllm-env"),
    metric_prefix="vllm:",
    # The old vllm:gpu_prefix_cache_* names are accepted too.
    prompt_counters=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total",
                     "vllm:gpu_prefix_cache_queries"),
    cached_counters=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total",
                     "vllm:gpu_prefix_cache_hits"),
    progress_counters=("vllm:prompt_tokens_total", "vllm:generation_tokens_total"))  # per engine step
