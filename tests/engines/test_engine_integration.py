"""The same client code path against a live engine: the CPU engine in CI, real SGLang on a GPU.

ARTSG_TEST_ENGINES (default "cpu") lists the engines to run, e.g. "cpu,sglang" on the H200 host
(where the SGLang parameters carry the gpu and sglang markers). Each engine is started with
`start_server`, exactly as a notebook does, and every check goes through `artsg_nb.engines`.
"""
import asyncio
import math
import os
import shlex

import pytest

from artsg_nb.engines import AdapterExistsError, AdapterRankError, SamplingParams, UnknownAdapterError
from artsg_nb.serving.metrics import cache_counters
from artsg_nb.serving.server import ServerConfig, start_server
from lora_files import make_adapter

ENGINES = [e.strip() for e in os.environ.get("ARTSG_TEST_ENGINES", "cpu").split(",") if e.strip()]
PARAMS = [pytest.param(e, marks=[pytest.mark.gpu, pytest.mark.sglang] if e == "sglang" else []) for e in ENGINES]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module", params=PARAMS)
def engine(request, tiny_model_dir, tmp_path_factory):
    name = request.param
    run_dir = tmp_path_factory.mktemp(f"engine-{name}")
    extra = tuple(shlex.split(os.environ.get("ARTSG_SGLANG_ARGS", ""))) if name == "sglang" else ()
    server = start_server(ServerConfig(engine=name, model_path=str(tiny_model_dir), run_dir=run_dir,
                                       max_lora_rank=16, extra_args=extra))
    adapters = tmp_path_factory.mktemp(f"adapters-{name}")
    paths = {"a": make_adapter(tiny_model_dir, adapters / "a", seed=1),
             "b": make_adapter(tiny_model_dir, adapters / "b", seed=2),
             "r32": make_adapter(tiny_model_dir, adapters / "r32", rank=32)}
    yield name, server, paths
    server.stop()


@pytest.fixture
def client(engine):
    return engine[1].client()


def _prompt(tokenizer, text="What is 3+4?"):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def test_generate_returns_ids_with_aligned_logprobs(engine, client, tiny_tokenizer):
    ids = _prompt(tiny_tokenizer)
    gens = run(client.generate(ids, SamplingParams(max_new_tokens=8, temperature=1.0, n=3)))
    assert len(gens) == 3
    for g in gens:
        assert 0 < len(g.output_ids) <= 8 and len(g.logprobs) == len(g.output_ids)
        assert all(lp <= 0 and math.isfinite(lp) for lp in g.logprobs)
        assert g.prompt_tokens == len(ids) and g.finish_reason in ("stop", "length")


def test_default_server_refuses_requests_without_its_key(engine, tiny_tokenizer):
    """Secure by default (the fixture starts it with defaults): without the key /generate and the
    tensor-loading route (unauthenticated remote code execution on SGLang 0.5.14 without a key)
    answer 401, /health stays open, the key works, and no process of the server has it in argv."""
    import httpx
    import psutil

    name, server, _ = engine
    body = {"input_ids": _prompt(tiny_tokenizer), "sampling_params": {"max_new_tokens": 2}}
    assert server.api_key, "a server started with defaults has a key"
    assert httpx.post(f"{server.url}/generate", json=body, timeout=60).status_code == 401
    assert httpx.post(f"{server.url}/load_lora_adapter_from_tensors", json={}, timeout=60).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    auth = {"Authorization": f"Bearer {server.api_key}"}
    assert httpx.post(f"{server.url}/generate", json=body, headers=auth, timeout=60).status_code == 200
    leader = psutil.Process(server.pid)
    for proc in [leader, *leader.children(recursive=True)]:
        assert server.api_key not in " ".join(proc.cmdline()), f"{name}: the key is in the argv of pid {proc.pid}"


def test_adapter_outputs_and_logprobs_differ_from_base(engine, client, tiny_tokenizer):
    name, _, paths = engine
    run(client.load_adapter("diff-a", paths["a"]))
    ids = _prompt(tiny_tokenizer, "Say something")
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    base = run(client.generate(ids, greedy))[0]
    lora = run(client.generate(ids, greedy, adapter="diff-a"))[0]
    probe = ids + base.output_ids
    base_lp = run(client.score(probe))
    lora_lp = run(client.score(probe, adapter="diff-a"))
    assert max(abs(a - b) for a, b in zip(base_lp, lora_lp)) > 1e-2, "adapter logprobs equal the base's"
    assert base.output_ids != lora.output_ids or base.logprobs != lora.logprobs
    run(client.unload_adapter("diff-a"))


def test_chat_selects_adapter_only_with_base_colon_adapter(engine, client):
    name, server, paths = engine
    run(client.load_adapter("chat-a", paths["a"]))
    msgs = [{"role": "user", "content": "Tell me a number"}]
    p = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    base = run(client.chat(msgs, p))["choices"][0]["message"]["content"]
    lora = run(client.chat(msgs, p, adapter="chat-a"))["choices"][0]["message"]["content"]
    assert base != lora, "the client's chat request did not select the adapter"
    run(client.unload_adapter("chat-a"))


def test_adapter_name_errors(engine, client):
    name, _, paths = engine
    run(client.load_adapter("dup", paths["a"]))
    with pytest.raises(AdapterExistsError):
        run(client.load_adapter("dup", paths["b"]))
    run(client.unload_adapter("dup"))
    with pytest.raises(UnknownAdapterError):
        run(client.unload_adapter("never-loaded"))
    with pytest.raises(AdapterRankError):
        run(client.load_adapter("too-big", paths["r32"]))  # server started with max_lora_rank=16


def test_prefix_cache_reuse_is_namespaced_per_adapter(engine, client, tiny_tokenizer):
    name, _, paths = engine
    ids = _prompt(tiny_tokenizer, "a shared prompt " * 20)
    p = SamplingParams(max_new_tokens=2, temperature=1.0)
    run(client.generate(ids, p))
    again = run(client.generate(ids, p))[0]
    assert again.cached_tokens >= len(ids) // 2, f"repeated prefix not reused: {again.cached_tokens}"
    run(client.load_adapter("ns-b", paths["b"]))
    first_under_adapter = run(client.generate(ids, p, adapter="ns-b"))[0]
    assert first_under_adapter.cached_tokens == 0, "prefix computed by the base model reused under an adapter"
    run(client.unload_adapter("ns-b"))


def test_hit_rate_from_server_counters(engine, client, tiny_tokenizer):
    before = cache_counters(run(client.metrics_text()), "sglang")
    ids = _prompt(tiny_tokenizer, "counters " * 15)
    for _ in range(3):
        run(client.generate(ids, SamplingParams(max_new_tokens=1)))
    after = cache_counters(run(client.metrics_text()), "sglang")
    assert after.prompt_tokens - before.prompt_tokens >= 3 * len(ids) - 3
    assert after.cached_tokens > before.cached_tokens


@pytest.mark.parametrize("warm_up, submission", [("always", "warm-up first"), ("never", "prefilled together")])
def test_what_each_sample_reads_from_the_cache_is_what_its_submission_says(engine, client, tiny_tokenizer,
                                                                        warm_up, submission):
    """The reachable hit rate a step shows (serving/metrics.py) rests on this: after a warm-up every
    sample reads the prompt less its last token from the cache; copies prefilled together read
    nothing. Real SGLang only: the CPU engine prefills a batch's copies one after another."""
    name, _, paths = engine
    if name != "sglang":
        pytest.skip("the CPU engine prefills a batch's copies in order (SGLang: together)")
    adapter = f"sub-{warm_up}"
    run(client.load_adapter(adapter, paths["a"]))
    try:
        client.prompt_warm_up = warm_up
        ids = _prompt(tiny_tokenizer, f"a prompt sent with prompt_warm_up={warm_up} " * 4)
        gens = run(client.generate(ids, SamplingParams(max_new_tokens=2, n=4), adapter=adapter))
    finally:
        client.prompt_warm_up = "auto"
        run(client.unload_adapter(adapter))
    assert [g.submission for g in gens] == [submission] * 4
    expected = len(ids) - 1 if warm_up == "always" else 0
    assert [g.cached_tokens for g in gens] == [expected] * 4
