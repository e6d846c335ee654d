"""Two CPU engines behind the real sglang-router, driven through the toolkit's SGLang client.

Checks what scale-out needs from the router: both workers get work, the samples of a group
(same prompt) land on one worker so its prefix cache is hit, the per-worker /metrics counters add
up to what the client saw, and outputs/logprobs keep the shapes rollout.py relies on. Adapters
are loaded on each worker directly (the router has no /load_lora_adapter). Marked slow (~40 s).
"""
import asyncio
import random

import pytest

from artsg_nb.engines import SamplingParams, make_client
from artsg_nb.serving.metrics import cache_counters, hit_rate, parse_metrics
from artsg_nb.serving.router import RouterError, build_router_command, start_router
from artsg_nb.serving.server import ServerConfig, start_server
from lora_files import make_adapter

pytest.importorskip("sglang_router", reason="needs the sglang-router package (environment-train.yml)")
pytestmark = pytest.mark.slow


KEY = "router-test-key"  # one key for the router and its workers: it forwards the client's


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    servers = [start_server(ServerConfig(engine="cpu", model_path=str(tiny_model_dir), max_lora_rank=16, api_key=KEY,
                                         run_dir=tmp_path_factory.mktemp(f"worker{i}"))) for i in range(2)]
    router = start_router([s.url for s in servers], tmp_path_factory.mktemp("router"), api_key=KEY)
    adapter = make_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapters") / "a")
    yield servers, router, adapter
    router.stop()
    for s in servers:
        s.stop()


def _counters(server):
    text = asyncio.run(server.client().metrics_text())
    return cache_counters(text, "cpu"), parse_metrics(text).get("sglang:num_requests_total", 0.0)


async def _group(client, ids, adapter, g):
    """Like rollout.py's shared-prefix groups: one sample first, then the other g-1 at once."""
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    first = await client.generate(ids, params, adapter=adapter)
    rest = await asyncio.gather(*[client.generate(ids, params, adapter=adapter) for _ in range(g - 1)])
    return first + [gen for gens in rest for gen in gens]


def test_groups_spread_over_workers_and_keep_their_prefix(cluster, tiny_model_dir):
    servers, router, adapter = cluster
    for s in servers:  # every worker serves every adapter version: load it on each one
        asyncio.run(s.client().load_adapter("policy-step-1", adapter))
    before = [_counters(s) for s in servers]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 2000) for _ in range(48)] for _ in range(6)]

    async def rollout():
        async with make_client("sglang", router.url, str(tiny_model_dir), api_key=KEY) as client:
            return await asyncio.gather(*[_group(client, p, "policy-step-1", 4) for p in prompts])

    groups = asyncio.run(rollout())
    after = [_counters(s) for s in servers]

    requests = [a[1] - b[1] for a, b in zip(after, before)]
    assert all(n > 0 for n in requests), f"requests per worker {requests}: the router used one worker only"
    assert sum(requests) == 6 * 4
    for prompt, gens in zip(prompts, groups):
        assert len(gens) == 4
        # The first sample computes the prompt; each later one must find it in the cache of the
        # worker it landed on, i.e. the same worker (the cache is per adapter, per worker).
        assert [g.cached_tokens >= len(prompt) - 1 for g in gens[1:]] == [True] * 3, [g.cached_tokens for g in gens]
        for g in gens:
            assert g.prompt_tokens == len(prompt)
            assert len(g.output_ids) == len(g.logprobs) >= 1 and all(lp <= 0.0 for lp in g.logprobs)
    # The workers' counters account for exactly what the client saw: per-worker hit rates are real.
    cached_seen = sum(g.cached_tokens for gens in groups for g in gens)
    assert sum(a[0].cached_tokens - b[0].cached_tokens for a, b in zip(after, before)) == cached_seen
    rates = [hit_rate(b[0], a[0]) for a, b in zip(after, before)]
    assert all(r is not None and r > 0.6 for r in rates), f"per-worker hit rates {rates}"


def test_n_samples_in_one_request_come_back_through_the_router(cluster, tiny_model_dir, tiny_tokenizer):
    _, router, _ = cluster
    ids = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "What is 3+4?"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    client = make_client("sglang", router.url, str(tiny_model_dir), api_key=KEY)
    gens = asyncio.run(client.generate(ids, SamplingParams(max_new_tokens=5, n=3), adapter="policy-step-1"))
    assert len(gens) == 3 and all(len(g.output_ids) == len(g.logprobs) for g in gens)


def test_router_does_not_fan_out_adapter_loads(cluster):
    import httpx

    _, router, adapter = cluster
    resp = httpx.post(f"{router.url}/load_lora_adapter", json={"lora_name": "x", "lora_path": adapter})
    assert resp.status_code == 404, "the router now forwards /load_lora_adapter: revisit docs/scale-out.md"


def test_start_fails_with_the_log_tail_when_a_worker_is_missing(tmp_path):
    with pytest.raises(RouterError, match="did not see all 1 workers healthy") as err:
        start_router(["http://127.0.0.1:9"], tmp_path, startup_timeout_s=8)  # the router has logged by then under CI load
    assert "smg::" in str(err.value) and "\x1b" not in str(err.value), "no readable log tail"
    assert not list(tmp_path.glob("*.server.json")), "a failed start left its record behind"


def test_command_line():
    cmd = build_router_command(["http://a:1", "http://b:2"], 30001, 30002, python="py")
    assert cmd[:2] == ["py", "-c"] and "sglang_router.launch_router" in cmd[2]
    assert "--api-key" not in cmd  # the key goes by environment (LAUNCHER), never argv
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--policy")] == ["http://a:1", "http://b:2"]
    assert cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--cache-threshold") + 1] == "0.9"  # not SGLang's 0.3: see DEFAULT_CACHE_THRESHOLD
    with pytest.raises(ValueError):
        build_router_command([], 1, 2)


def test_router_needs_the_key_and_keeps_it_out_of_argv(cluster, tiny_model_dir):
    import httpx
    import psutil

    _, router, _ = cluster
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{router.url}/generate", json=body, timeout=30).status_code == 401
    ok = httpx.post(f"{router.url}/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200, ok.text
    for proc in [psutil.Process(router.proc.pid), *psutil.Process(router.proc.pid).children(recursive=True)]:
        assert KEY not in " ".join(proc.cmdline()), f"the router's key is in the argv of pid {proc.pid}"
