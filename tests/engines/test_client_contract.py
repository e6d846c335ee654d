"""Contract tests of the engine clients' parsing (artsg_nb/engines/), against bodies recorded from a real SGLang 0.5.14
(tests/fixtures/sglang-0.5.14/) and vLLM shapes from the serving-API reference.

A fake transport (httpx.MockTransport) answers with those bodies and records what the client
sent, so the checks cover both directions: the request each dialect builds (adapter selection
above all) and how it reads each response shape, error shape and status code. Integration
against a live engine process lives with the CPU engine's tests.
"""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import pytest

from artsg_nb.engines import (AdapterExistsError, AdapterRankError, EngineError, MemorySaverError, SamplingParams,
                              ServerUnavailableError, SGLangClient, UnknownAdapterError, VLLMClient, make_client,
                              run_sync)
from artsg_nb.engines.sglang import merge_stream_chunk
from sglang_fixtures import fixture

SERVED = "/models/base"  # the recorded server's served model name


class FakeServer:
    """Answers (method, path) from a table of (status, body) and records every request."""

    def __init__(self, routes: dict[tuple[str, str], object]):
        self.routes, self.requests = routes, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.routes.get((request.method, request.url.path), (404, {"detail": "Not Found"}))
        if callable(answer):
            return answer(request)
        status, body = answer
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    def sent(self, i: int = -1) -> dict:
        return json.loads(self.requests[i].content)


def sglang(routes, **kwargs) -> tuple[SGLangClient, FakeServer]:
    server = FakeServer(routes)
    return SGLangClient("http://sglang.test", SERVED, transport=httpx.MockTransport(server), **kwargs), server


def vllm(routes) -> tuple[VLLMClient, FakeServer]:
    server = FakeServer(routes)
    return VLLMClient("http://vllm.test", "base", transport=httpx.MockTransport(server)), server


def recorded(name: str):
    f = fixture(name)
    return f["status"], f["body"]


def run(coro):
    return asyncio.run(coro)


# ---- SGLang /generate ---------------------------------------------------------------------

def test_generate_n1_parses_ids_logprobs_and_meta():
    client, server = sglang({("POST", "/generate"): recorded("generate_logprob.json")})
    body = fixture("generate_logprob.json")["body"]
    params = SamplingParams(max_new_tokens=8, temperature=0.7, stop_token_ids=[2])
    [gen] = run(client.generate([42, 71, 78, 299, 1098, 3794], params))

    assert gen.output_ids == body["output_ids"]
    assert gen.logprobs == [t[0] for t in body["meta_info"]["output_token_logprobs"]]
    assert len(gen.logprobs) == len(gen.output_ids) == 8
    assert (gen.prompt_tokens, gen.cached_tokens, gen.finish_reason) == (6, 0, "length")
    assert gen.text == " Disden" and gen.e2e_s > 0 and gen.ttft_s is None
    sent = server.sent()
    assert sent["input_ids"] == [42, 71, 78, 299, 1098, 3794] and sent["return_logprob"] is True
    assert sent["sampling_params"] == {"max_new_tokens": 8, "temperature": 0.7, "top_p": 1.0,
                                       "ignore_eos": False, "n": 1, "stop_token_ids": [2]}
    assert "lora_path" not in sent and "model" not in sent


def test_generate_with_adapter_sends_lora_path_name():
    client, server = sglang({("POST", "/generate"): recorded("generate_logprob_lora1.json")})
    [gen] = run(client.generate([1, 2, 3], SamplingParams(), adapter="lora1"))
    assert server.sent()["lora_path"] == "lora1"
    assert gen.output_ids == fixture("generate_logprob_lora1.json")["body"]["output_ids"]


def test_generate_n_gt_1_list_shape():
    samples = [fixture("generate_logprob.json")["body"], fixture("generate_logprob_lora1.json")["body"]]
    samples[1]["meta_info"]["cached_tokens"] = 5  # the second sample of a group hits the prefix cache
    client, server = sglang({("POST", "/generate"): (200, samples)})
    gens = run(client.generate([1, 2, 3], SamplingParams(n=2)))
    assert [g.output_ids for g in gens] == [s["output_ids"] for s in samples]
    assert [g.cached_tokens for g in gens] == [0, 5]
    assert server.sent()["sampling_params"]["n"] == 2


def test_generate_wrong_sample_count_is_an_error():
    client, _ = sglang({("POST", "/generate"): recorded("generate_logprob.json")})
    with pytest.raises(EngineError, match="1 samples for n=2"):
        run(client.generate([1], SamplingParams(n=2)))


def test_generate_rejects_logprobs_not_aligned_with_ids():
    body = fixture("generate_logprob.json")["body"]
    body["meta_info"]["output_token_logprobs"] = body["meta_info"]["output_token_logprobs"][:-1]
    client, _ = sglang({("POST", "/generate"): (200, body)})
    with pytest.raises(EngineError, match="cannot be aligned"):
        run(client.generate([1]))


@pytest.mark.parametrize("raw, expected", [
    ({"type": "stop", "matched": 2}, "stop"), ({"type": "stop", "matched": "\n"}, "stop"),
    ({"type": "length", "length": 8}, "length"), ({"type": "abort", "message": "too long"}, "abort"),
    (None, "abort")])
def test_finish_reasons_normalised(raw, expected):
    body = fixture("generate_logprob.json")["body"]
    body["meta_info"]["finish_reason"] = raw
    client, _ = sglang({("POST", "/generate"): (200, body)})
    assert run(client.generate([1]))[0].finish_reason == expected


def _sse(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def _stream_chunks(body: dict, incremental: bool) -> list[dict]:
    """The recorded response cut into per-token stream chunks, as SGLang sends them."""
    ids, triples = body["output_ids"], body["meta_info"]["output_token_logprobs"]
    chunks = []
    for k in range(1, len(ids) + 1):
        lo = k - 1 if incremental else 0
        meta = {**body["meta_info"], "completion_tokens": k, "output_token_logprobs": triples[lo:k],
                "finish_reason": body["meta_info"]["finish_reason"] if k == len(ids) else None}
        text = body["text"] if k == len(ids) else ""
        chunks.append({"text": "" if incremental else text, "output_ids": ids[lo:k], "meta_info": meta})
    if incremental:
        chunks[-1]["text"] = body["text"]
    return chunks


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("hook_kind", ["event", "callback", "coroutine"])
def test_generate_streamed_fires_first_token_once_and_matches_unstreamed(incremental, hook_kind):
    body = fixture("generate_logprob.json")["body"]
    client, server = sglang({("POST", "/generate"): (200, _sse(_stream_chunks(body, incremental)))})
    calls = []

    async def main():
        event = asyncio.Event()

        async def coroutine():
            calls.append(1)
        hook = {"event": event, "callback": lambda: calls.append(1), "coroutine": coroutine}[hook_kind]
        gens = await client.generate([1, 2], SamplingParams(max_new_tokens=8), on_first_token=hook)
        return gens, event.is_set()

    [gen], event_set = run(main())
    assert server.sent()["stream"] is True
    assert event_set if hook_kind == "event" else calls == [1]  # fired exactly once
    assert gen.output_ids == body["output_ids"]
    assert gen.logprobs == [t[0] for t in body["meta_info"]["output_token_logprobs"]]
    assert gen.text == body["text"] and gen.finish_reason == "length"
    assert gen.ttft_s is not None and 0 < gen.ttft_s <= gen.e2e_s


def test_error_event_inside_a_stream_raises():
    stream = _sse([{"error": {"message": "Got LoRA adapter that has never been loaded: x", "code": 400}}])
    client, _ = sglang({("POST", "/generate"): (200, stream)})
    with pytest.raises(UnknownAdapterError, match="never been loaded"):
        run(client.generate([1], adapter="x", on_first_token=asyncio.Event()))


def test_stream_merge_of_parallel_samples_by_index():
    a, b = fixture("generate_logprob.json")["body"], fixture("generate_logprob_lora1.json")["body"]
    chunks = [dict(c, index=0) for c in _stream_chunks(a, True)] + [dict(c, index=1) for c in _stream_chunks(b, True)]
    chunks = [c for pair in zip(chunks[:8], chunks[8:]) for c in pair]  # interleaved, as the server does
    client, _ = sglang({("POST", "/generate"): (200, _sse(chunks))})
    gens = run(client.generate([1], SamplingParams(n=2), on_first_token=asyncio.Event()))
    assert [g.output_ids for g in gens] == [a["output_ids"], b["output_ids"]]


def test_merge_stream_chunk_cumulative_replaces_delta_appends():
    first = {"output_ids": [5], "text": "a", "meta_info": {"completion_tokens": 1, "output_token_logprobs": [[-1, 5, None]]}}
    cumulative = {"output_ids": [5, 5], "text": "aa", "meta_info": {"completion_tokens": 2,
                                                                     "output_token_logprobs": [[-1, 5, None], [-2, 5, None]]}}
    delta = {"output_ids": [5], "text": "a", "meta_info": {"completion_tokens": 2, "output_token_logprobs": [[-2, 5, None]]}}
    assert merge_stream_chunk(first, cumulative)["output_ids"] == [5, 5]
    merged = merge_stream_chunk(first, delta)
    assert merged["output_ids"] == [5, 5] and merged["text"] == "aa"
    assert merged["meta_info"]["output_token_logprobs"] == cumulative["meta_info"]["output_token_logprobs"]


def test_score_returns_prompt_logprobs_after_the_first_token():
    client, server = sglang({("POST", "/generate"): recorded("generate_logprob.json")})
    lps = run(client.score([42, 71, 78, 299, 1098, 3794], adapter="lora1"))
    assert lps == [t[0] for t in fixture("generate_logprob.json")["body"]["meta_info"]["input_token_logprobs"][1:]]
    assert server.sent()["logprob_start_len"] == 0 and server.sent()["lora_path"] == "lora1"


def test_a_wrapped_transport_sees_every_later_request_and_passes_it_through():
    """EngineClient.wrap_transport, the seam a measuring tool times requests at
    (tools/gpu/step_profile.py): every request from then on goes through the wrapper, answers
    unchanged; the pools made before it are closed and made again."""
    seen = []

    class Counting(httpx.AsyncBaseTransport):
        def __init__(self, inner):
            self.inner = inner

        async def handle_async_request(self, request):
            seen.append(request.url.path)
            return await self.inner.handle_async_request(request)

    client, server = sglang({("POST", "/generate"): recorded("generate_logprob.json"), ("GET", "/health"): (200, {})})

    async def go():
        before = await client.score([42, 71, 78, 299, 1098, 3794])
        await client.wrap_transport(Counting)
        assert await client.health() and await client.score([42, 71, 78, 299, 1098, 3794]) == before
        await client.aclose()
    run(go())
    assert seen == ["/health", "/generate"] and len(server.requests) == 3


# ---- SGLang adapters, cache, info ---------------------------------------------------------

def test_load_and_unload_adapter_success():
    client, server = sglang({("POST", "/load_lora_adapter"): recorded("load_lora_adapter.json"),
                             ("POST", "/unload_lora_adapter"): recorded("unload_lora_adapter.json")})
    seconds = run(client.load_adapter("lora1_v2", "/models/lora2"))
    assert isinstance(seconds, float) and seconds >= 0
    assert server.sent(0) == {"lora_name": "lora1_v2", "lora_path": "/models/lora2"}
    assert run(client.unload_adapter("lora1_v2")) is None
    assert server.sent(1) == {"lora_name": "lora1_v2"}


def test_bad_adapter_path_raises_with_the_servers_message():
    client, _ = sglang({("POST", "/load_lora_adapter"): recorded("load_lora_adapter_bad.json")})
    with pytest.raises(EngineError) as info:
        run(client.load_adapter("bad", "/nonexistent/adapter"))
    err = info.value
    assert type(err) is EngineError and err.status == 400 and err.body["success"] is False
    assert fixture("load_lora_adapter_bad.json")["body"]["error_message"] in str(err)


def _lora_failure(message: str):
    body = copy.deepcopy(fixture("load_lora_adapter_bad.json")["body"])
    body["error_message"] = message
    return 400, body


@pytest.mark.parametrize("route, message, cls", [
    ("/load_lora_adapter", "Failed to load LoRA adapter lora1 because it is already loaded", AdapterExistsError),
    ("/load_lora_adapter", "LoRA adapter lora1 with rank 64 is incompatible with the current LoRA memory pool "
                           "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                           "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.",
     AdapterRankError),
    ("/unload_lora_adapter", "LoRA with name nope does not exist. Loaded LoRAs: lora1", UnknownAdapterError)])
def test_lora_failures_map_to_exceptions(route, message, cls):
    client, _ = sglang({("POST", route): _lora_failure(message)})
    call = client.load_adapter("lora1", "/p") if route == "/load_lora_adapter" else client.unload_adapter("nope")
    with pytest.raises(cls, match="HTTP 400") as info:
        run(call)
    assert message.split(".")[0] in str(info.value) and isinstance(info.value, EngineError)


def test_success_false_with_200_is_still_an_error():
    status, body = _lora_failure("Failed to load LoRA adapter x because it is already loaded")
    client, _ = sglang({("POST", "/load_lora_adapter"): (200, body)})
    with pytest.raises(AdapterExistsError):
        run(client.load_adapter("x", "/p"))


def test_generate_with_never_loaded_adapter_is_unknown_adapter():
    body = {"error": {"message": "Got LoRA adapter that has never been loaded: nope"}}
    client, _ = sglang({("POST", "/generate"): (400, body)})
    with pytest.raises(UnknownAdapterError, match="never been loaded"):
        run(client.generate([1], adapter="nope"))


def test_strict_sampling_error_string_shape():
    # SGLang 0.5.23 validates sampling_params strictly and answers {"error": "<str>"}.
    message = "sampling_params: unknown field 'seed'"
    client, _ = sglang({("POST", "/generate"): (400, {"error": message})})
    with pytest.raises(EngineError, match="unknown field 'seed'") as info:
        run(client.generate([1]))
    assert type(info.value) is EngineError and info.value.status == 400


def test_flush_cache_plain_text_and_refusal():
    client, server = sglang({("POST", "/flush_cache"): recorded("flush_cache.json")})
    assert run(client.flush_cache()) is None
    busy, _ = sglang({("POST", "/flush_cache"): (400, "Cache not flushed because there are pending requests.")})
    with pytest.raises(EngineError, match="pending requests"):
        run(busy.flush_cache(timeout_s=5))
    assert busy._transport.handler.requests[0].url.params["timeout"] == "5"


def test_health_metrics_models_and_server_info():
    metrics = fixture("metrics.txt")
    client, _ = sglang({("GET", "/health"): recorded("health.json"), ("GET", "/metrics"): (200, metrics),
                        ("GET", "/v1/models"): recorded("v1_models.json"),
                        ("GET", "/get_server_info"): recorded("get_server_info.json")})
    assert run(client.health()) is True
    assert run(client.metrics_text()) == metrics
    assert run(client.list_adapters()) == {"lora1": "/models/lora1"}
    info = run(client.server_info())  # /server_info is missing here: falls back to /get_server_info
    assert info["max_lora_rank"] == 16 and info["enable_lora"] is True


def saver_info(**flags) -> tuple[int, dict]:
    """The recorded /server_info body (memory saver off) with `flags` changed."""
    status, body = recorded("get_server_info.json")
    return status, {**copy.deepcopy(body), **flags}


def test_release_refused_when_the_server_has_no_memory_saver():
    # As recorded, SGLang runs without --enable-memory-saver: its routes would answer 200 and free nothing.
    client, server = sglang({("GET", "/server_info"): saver_info()})
    with pytest.raises(MemorySaverError, match="--enable-memory-saver.*torch_memory_saver"):
        run(client.release_memory())
    assert [r.url.path for r in server.requests] == ["/server_info"]  # nothing released, nothing flushed
    backup_off, _ = sglang({("GET", "/server_info"): saver_info(enable_memory_saver=True)})
    with pytest.raises(MemorySaverError, match="--enable-weights-cpu-backup"):
        run(backup_off.release_memory(("kv_cache", "weights")))
    with pytest.raises(ValueError, match="kv_cache"):
        run(backup_off.release_memory(["kv-cache"]))  # SGLang would ignore the typo silently


def test_release_waits_for_idle_then_resume_sends_the_same_tags():
    client, server = sglang({("GET", "/server_info"): saver_info(enable_memory_saver=True),
                             ("POST", "/flush_cache"): recorded("flush_cache.json"),
                             ("POST", "/release_memory_occupation"): (200, None),
                             ("POST", "/resume_memory_occupation"): (200, None)})
    assert run(client.resume_memory()) == 0.0 and not server.requests  # nothing released: no request
    assert run(client.release_memory(idle_timeout_s=30)) >= 0
    paths = [r.url.path for r in server.requests]
    assert paths == ["/server_info", "/flush_cache", "/release_memory_occupation"]
    assert server.requests[1].url.params["timeout"] == "30"
    assert server.sent() == {"tags": ["kv_cache", "cuda_graph"]} and client.released_tags == ("kv_cache", "cuda_graph")
    with pytest.raises(EngineError, match="already released"):
        run(client.release_memory())
    run(client.resume_memory())
    assert server.requests[-1].url.path == "/resume_memory_occupation"
    assert server.sent() == {"tags": ["kv_cache", "cuda_graph"]} and client.released_tags == ()


def test_release_refused_while_busy_says_so_and_releases_nothing():
    client, server = sglang({("GET", "/server_info"): saver_info(enable_memory_saver=True),
                             ("POST", "/flush_cache"): (400, "Timed out waiting for idle state.")})
    with pytest.raises(EngineError, match="did not become idle within 2 s"):
        run(client.release_memory(idle_timeout_s=2))
    assert "/release_memory_occupation" not in [r.url.path for r in server.requests] and not client.released_tags


def test_missing_metrics_route_says_how_to_enable_it():
    client, _ = sglang({})
    with pytest.raises(EngineError, match="--enable-metrics"):
        run(client.metrics_text())


def test_health_false_on_503_and_on_no_connection():
    client, _ = sglang({("GET", "/health"): (503, "")})
    assert run(client.health()) is False

    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)
    down, _ = sglang({("GET", "/health"): refuse, ("POST", "/generate"): refuse})
    assert run(down.health()) is False
    with pytest.raises(ServerUnavailableError, match="no connection"):
        run(down.generate([1]))


def test_timeout_is_server_unavailable():
    def slow(request):
        raise httpx.ReadTimeout("timed out", request=request)
    client, _ = sglang({("POST", "/generate"): slow}, timeout_s=3)
    with pytest.raises(ServerUnavailableError, match="no answer within 3 s"):
        run(client.generate([1]))


def test_dropped_keepalive_connection_is_retried_once():
    attempts = []

    def flaky(request):
        attempts.append(1)
        if len(attempts) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, json=fixture("generate_logprob.json")["body"])
    client, _ = sglang({("POST", "/generate"): flaky})
    assert len(run(client.generate([1]))) == 1 and len(attempts) == 2

    def dead(request):
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
    client, server = sglang({("POST", "/generate"): dead})
    with pytest.raises(ServerUnavailableError, match="RemoteProtocolError"):
        run(client.generate([1]))
    assert len(server.requests) == 2


def test_api_key_is_sent_as_bearer_token():
    client, server = sglang({("GET", "/health"): (200, "")}, api_key="sk-test")
    run(client.health())
    assert server.requests[0].headers["authorization"] == "Bearer sk-test"


# ---- chat: adapter selection per dialect --------------------------------------------------

def test_sglang_chat_selects_adapter_with_served_colon_adapter():
    client, server = sglang({("POST", "/v1/chat/completions"): recorded("chat_lora1_modelsyntax.json")})
    messages = [{"role": "user", "content": "Say something about kalo mine ranto."}]
    out = run(client.chat(messages, SamplingParams(max_new_tokens=16, temperature=0.0), adapter="lora1"))
    sent = server.sent()
    assert sent["model"] == "/models/base:lora1"  # never the bare "lora1": that serves the base model
    assert sent["messages"] == messages and sent["max_tokens"] == 16 and sent["logprobs"] is True
    assert out == fixture("chat_lora1_modelsyntax.json")["body"]


def test_sglang_chat_base_uses_served_model():
    client, server = sglang({("POST", "/v1/chat/completions"): recorded("chat_base.json")})
    out = run(client.chat([{"role": "user", "content": "hi"}], logprobs=False, return_meta_info=True))
    assert server.sent()["model"] == SERVED and server.sent()["return_meta_info"] is True
    assert out["choices"][0]["finish_reason"] == "length"


# ---- vLLM ---------------------------------------------------------------------------------

def _vllm_completion(choices: list[dict], cached: int | None = 3) -> dict:
    usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
             "prompt_tokens_details": None if cached is None else {"cached_tokens": cached}}
    return {"id": "cmpl-1", "object": "text_completion", "model": "step-1", "choices": choices, "usage": usage}


def _vllm_choice(index: int, ids: list[int], finish: str = "stop") -> dict:
    lps = [-0.5 * (i + 1) for i in range(len(ids))]
    return {"index": index, "text": "x" * len(ids), "token_ids": ids, "prompt_token_ids": [1, 2, 3, 4],
            "finish_reason": finish, "stop_reason": None,
            "logprobs": {"text_offset": list(range(len(ids))), "token_logprobs": lps,
                         "tokens": ["x"] * len(ids), "top_logprobs": [{"x": lp} for lp in lps]}}


def test_vllm_generate_request_and_parsing():
    body = _vllm_completion([_vllm_choice(1, [7, 8], "length"), _vllm_choice(0, [5, 6, 2])])
    client, server = vllm({("POST", "/v1/completions"): (200, body)})
    gens = run(client.generate([1, 2, 3, 4], SamplingParams(n=2, temperature=0.9), adapter="step-1"))
    sent = server.sent()
    assert sent["model"] == "step-1" and sent["prompt"] == [1, 2, 3, 4]
    assert sent["return_token_ids"] is True and sent["logprobs"] in (0, 1) and sent["n"] == 2
    assert [g.output_ids for g in gens] == [[5, 6, 2], [7, 8]]  # ordered by choice index
    assert gens[0].logprobs == [-0.5, -1.0, -1.5] and gens[1].finish_reason == "length"
    assert [(g.prompt_tokens, g.cached_tokens) for g in gens] == [(4, 3), (4, 3)]


def test_vllm_cached_tokens_absent_without_prompt_tokens_details():
    client, _ = vllm({("POST", "/v1/completions"): (200, _vllm_completion([_vllm_choice(0, [5])], cached=None))})
    assert run(client.generate([1]))[0].cached_tokens == 0


def test_vllm_streamed_generate_accumulates_deltas():
    choice = _vllm_choice(0, [5, 6, 2])
    chunks = [{"choices": [{"index": 0, "text": "x", "token_ids": [t], "finish_reason": None,
                            "logprobs": {"token_logprobs": [lp]}}]}
              for t, lp in zip(choice["token_ids"], choice["logprobs"]["token_logprobs"])]
    chunks[-1]["choices"][0]["finish_reason"] = "stop"
    chunks.append({"choices": [], "usage": _vllm_completion([])["usage"]})
    client, server = vllm({("POST", "/v1/completions"): (200, _sse(chunks))})
    [gen] = run(client.generate([1, 2, 3, 4], on_first_token=lambda: None))
    assert server.sent()["stream_options"] == {"include_usage": True}
    assert gen.output_ids == [5, 6, 2] and gen.logprobs == [-0.5, -1.0, -1.5]
    assert (gen.cached_tokens, gen.finish_reason, gen.text) == (3, "stop", "xxx") and gen.ttft_s is not None


def test_vllm_chat_selects_adapter_by_its_own_name():
    client, server = vllm({("POST", "/v1/chat/completions"): (200, {"choices": []})})
    run(client.chat([{"role": "user", "content": "hi"}], adapter="step-1"))
    assert server.sent()["model"] == "step-1"
    run(client.chat([{"role": "user", "content": "hi"}]))
    assert server.sent()["model"] == "base"


def test_vllm_load_plain_text_200_and_errors():
    ok = "Success: LoRA adapter 'step-1' added successfully."
    exists = {"error": {"message": "The lora adapter 'step-1' has already been loaded. If you want to load the "
                                   "adapter in place, set 'load_inplace' to True.",
                        "type": "BadRequestError", "param": None, "code": 400}}
    client, server = vllm({("POST", "/v1/load_lora_adapter"): (200, ok)})
    assert run(client.load_adapter("step-1", "/runs/a/step-1")) >= 0
    assert server.sent() == {"lora_name": "step-1", "lora_path": "/runs/a/step-1"}
    client, _ = vllm({("POST", "/v1/load_lora_adapter"): (400, exists)})
    with pytest.raises(AdapterExistsError, match="already been loaded"):
        run(client.load_adapter("step-1", "/runs/a/step-1"))


def test_vllm_unknown_adapter_404s():
    gone = {"error": {"message": "The lora adapter 'old' cannot be found.", "type": "NotFoundError",
                      "param": None, "code": 404}}
    model = {"error": {"message": "The model `old` does not exist.", "type": "NotFoundError", "param": None,
                       "code": 404}}
    client, _ = vllm({("POST", "/v1/unload_lora_adapter"): (404, gone), ("POST", "/v1/completions"): (404, model)})
    with pytest.raises(UnknownAdapterError, match="cannot be found") as info:
        run(client.unload_adapter("old"))
    assert info.value.status == 404 and info.value.body == gone
    with pytest.raises(UnknownAdapterError, match="does not exist"):
        run(client.generate([1], adapter="old"))


def test_vllm_missing_runtime_lora_route_names_the_env_var():
    client, _ = vllm({})
    with pytest.raises(EngineError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
        run(client.load_adapter("a", "/p"))


def test_vllm_logprobs_mode_check():
    def info(mode):
        return (200, {"vllm_config": {"model_config": {"logprobs_mode": mode}}})
    good, _ = vllm({("GET", "/server_info"): info("processed_logprobs")})
    assert run(good.check_logprobs_mode()) == "processed_logprobs"
    raw, _ = vllm({("GET", "/server_info"): info("raw_logprobs")})
    with pytest.raises(EngineError, match="--logprobs-mode processed_logprobs"):
        run(raw.check_logprobs_mode())
    no_dev_mode, _ = vllm({})
    assert run(no_dev_mode.check_logprobs_mode()) is None


def test_vllm_flush_uses_reset_prefix_cache():
    client, server = vllm({("POST", "/reset_prefix_cache"): (200, {"success": True})})
    run(client.flush_cache())
    busy, _ = vllm({("POST", "/reset_prefix_cache"): (200, {"success": False})})
    with pytest.raises(EngineError, match="still in use"):
        run(busy.flush_cache())


def test_vllm_release_sleeps_at_level_1_and_resume_wakes_up():
    info = (200, {"vllm_config": {"model_config": {"enable_sleep_mode": True}}})
    client, server = vllm({("GET", "/server_info"): info, ("POST", "/sleep"): (200, ""),
                           ("POST", "/wake_up"): (200, "")})
    run(client.release_memory())
    sleep = server.requests[-1]
    assert sleep.url.path == "/sleep" and dict(sleep.url.params) == {"level": "1", "mode": "wait"}
    run(client.resume_memory())
    assert server.requests[-1].url.path == "/wake_up" and client.released_tags == ()
    no_sleep_mode, _ = vllm({("GET", "/server_info"): (200, {"vllm_config": {"model_config": {}}})})
    with pytest.raises(MemorySaverError, match="--enable-sleep-mode"):
        run(no_sleep_mode.release_memory())


# ---- factory and sync use -----------------------------------------------------------------

def test_make_client_dialects():
    assert type(make_client("sglang", "http://h:1", "m")) is SGLangClient
    cpu = make_client("cpu", "http://h:1", "m")
    assert type(cpu) is SGLangClient and cpu.engine == "cpu"
    assert type(make_client("vllm", "http://h:1/", "m")) is VLLMClient
    with pytest.raises(ValueError, match="unknown engine"):
        make_client("tgi", "http://h:1", "m")


def test_run_sync_outside_and_inside_a_running_loop():
    client, _ = sglang({("GET", "/health"): (200, "")})
    assert run_sync(client.health()) is True
    assert run_sync(client.health()) is True  # a second loop gets its own connections

    async def inside_jupyter():
        return run_sync(client.health())
    assert asyncio.run(inside_jupyter()) is True


def test_async_context_manager_closes():
    async def main():
        client, _ = sglang({("GET", "/health"): (200, "")})
        async with client:
            assert await client.health()
            pools = client._pools
        return pools, client._pools
    pools, after = run(main())
    assert after is None and all(pool.is_closed for pool in pools)


def test_connections_are_spread_over_pools():
    client = make_client("sglang", "http://h:1", "m")
    assert client._pool_count * client._limits.max_connections >= 1024 and client._pool_count > 1


def test_pools_share_one_tls_context_across_event_loops(monkeypatch):
    # httpx builds a TLS context (loading the CA bundle) per AsyncClient: 16 pools on every event
    # loop cost ~0.3 s before a run's first request and after every restart. One is built per process.
    import ssl
    from artsg_nb.engines import base
    if hasattr(base, "tls_context"):
        base.tls_context.cache_clear()
    built = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or real(*a, **k))
    client = make_client("sglang", "https://h:1", "m")  # no transport: real httpx transports are made

    async def pools():
        client._client()
        return client._pools
    first, second = asyncio.run(pools()), asyncio.run(pools())
    assert first is not second and len(first) == client._pool_count > 1  # a new loop, new pools
    assert len(built) == 1
    contexts = {id(pool._transport._pool._ssl_context) for pool in first + second}
    assert len(contexts) == 1
