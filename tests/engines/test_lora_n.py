"""n > 1 under a LoRA adapter on SGLang (sglang#36894): which request shapes the client sends.

SGLang up to at least 0.5.14 releases one adapter reference it never took for each prompt sent with
n > 1, and the adapter's next unload then waits forever. The client must never send that shape
with an adapter to such a server, and must send everything else unchanged. Checked on an httpx
MockTransport that records each /generate body, so the shapes are exact.
"""
from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from artsg_nb import engines
from artsg_nb.engines import EngineError, SamplingParams
from artsg_nb.engines.sglang import lora_n_problem


def sample(ids: list[int], n_out: int = 2) -> dict:
    out = list(range(100, 100 + n_out))
    return {"text": "", "output_ids": out,
            "meta_info": {"prompt_tokens": len(ids), "cached_tokens": len(ids) - 1, "finish_reason": {"type": "length"},
                          "output_token_logprobs": [[-0.5, t, None] for t in out]}}


def recording_client(version: str = "0.5.14", engine: str = "sglang", model: str = "base"):
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/server_info", "/get_server_info"):
            return httpx.Response(200, json={"version": version})
        body = json.loads(request.content)
        bodies.append(body)
        ids = body["input_ids"]
        if ids and isinstance(ids[0], list):
            return httpx.Response(200, json=[sample(p) for p in ids])
        n = body["sampling_params"].get("n", 1)
        return httpx.Response(200, json=[sample(ids)] * n if n > 1 else sample(ids))

    client = engines.make_client(engine, "http://test", model, transport=httpx.MockTransport(handler))
    return client, bodies


def test_releases_before_the_fix_are_affected_and_named():
    for version in ("0.4.10", "0.5.14", "0.5.21", "0.5.2rc2", "0.5.3rc0", "0.5.21.post1", None):
        problem = lora_n_problem({"version": version} if version else {})
        assert problem and "sglang#36894" in problem


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23", "0.6.0"])
def test_releases_with_the_fix_use_native_n_under_an_adapter(version):
    """0.5.22's warm-up borrows the samples' references (`_release_lora_once`): native n is safe,
    one request per group, and its samples read the prompt the server's own warm-up cached."""
    assert lora_n_problem({"version": version}) is None
    client, bodies = recording_client(version=version)
    gens = asyncio.run(client.generate([1, 2, 3], SamplingParams(max_new_tokens=5, n=3), adapter="a"))
    assert len(bodies) == 1 and bodies[0]["sampling_params"]["n"] == 3
    assert [g.submission for g in gens] == ["warm-up first"] * 3


def test_n_under_an_adapter_goes_as_a_warm_up_then_one_balanced_batch():
    client, bodies = recording_client()
    gens = asyncio.run(client.generate([1, 2, 3], SamplingParams(max_new_tokens=5, n=3, seed=40), adapter="a"))
    assert len(gens) == 3
    warm_up, batch = bodies
    assert warm_up["input_ids"] == [1, 2, 3] and warm_up["lora_path"] == "a"
    assert warm_up["sampling_params"]["max_new_tokens"] == 0 and warm_up["sampling_params"]["n"] == 1
    assert batch["input_ids"] == [[1, 2, 3]] * 3 and batch["lora_path"] == "a" and batch["return_logprob"]
    assert [p["n"] for p in batch["sampling_params"]] == [1, 1, 1]
    assert [p["sampling_seed"] for p in batch["sampling_params"]] == [40, 41, 42]  # as native n seeds sample j
    assert all(p["max_new_tokens"] == 5 for p in batch["sampling_params"])


@pytest.mark.parametrize("prompt_tokens, warm_up", [(40, False), (600, True)])
def test_the_warm_up_is_left_out_where_prefilling_the_copies_costs_less(tmp_path, prompt_tokens, warm_up):
    # A 270 MB model (SmolLM2-135M in bf16): 8 copies of a 40-token prompt redo 7.6e10 FLOPs of
    # prefill, below SGLang's warm_up_from_flop (1e12); 600 tokens redo 1.1e12.
    (tmp_path / "model.safetensors").write_bytes(b"")
    os.truncate(tmp_path / "model.safetensors", 270_000_000)  # sparse: no disk written
    client, bodies = recording_client(model=str(tmp_path))
    prompt = list(range(1, prompt_tokens + 1))
    gens = asyncio.run(client.generate(prompt, SamplingParams(max_new_tokens=5, n=8, seed=1), adapter="a"))
    assert len(gens) == 8
    shapes = [(len(b["input_ids"]) if isinstance(b["input_ids"][0], list) else 1,
               b["sampling_params"]["max_new_tokens"] if isinstance(b["sampling_params"], dict) else 5) for b in bodies]
    assert shapes == ([(1, 0)] if warm_up else []) + [(8, 5)]
    assert all(b["lora_path"] == "a" for b in bodies)


@pytest.mark.parametrize("case", ["cpu engine", "quantized"])
def test_the_warm_up_stays_where_its_cost_is_not_known_to_be_less(tmp_path, case):
    # The CPU engine's prefill is dear (warm_up_from_flop 0: always); a quantized model's bytes
    # undercount its FLOPs.
    (tmp_path / "model.safetensors").write_bytes(b"")
    os.truncate(tmp_path / "model.safetensors", 270_000_000)
    if case == "quantized":
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    client, bodies = recording_client(engine="cpu" if case == "cpu engine" else "sglang", model=str(tmp_path))
    if case == "cpu engine":
        client.lora_n_problem = lora_n_problem  # the CPU engine balancing as on SGLang
    asyncio.run(client.generate(list(range(1, 41)), SamplingParams(max_new_tokens=5, n=8, seed=1), adapter="a"))
    assert bodies[0]["sampling_params"]["max_new_tokens"] == 0, "no warm-up was sent"


def test_native_n_where_it_is_safe():
    client, bodies = recording_client()  # no adapter: no reference is counted
    asyncio.run(client.generate([1, 2, 3], SamplingParams(n=4)))
    assert [b["sampling_params"]["n"] for b in bodies] == [4]
    client, bodies = recording_client(engine="cpu")  # the CPU engine balances its references
    asyncio.run(client.generate([1, 2, 3], SamplingParams(n=4), adapter="a"))
    assert [b["sampling_params"]["n"] for b in bodies] == [4]


def test_n_1_requests_are_unchanged():
    client, bodies = recording_client()
    asyncio.run(client.generate([1, 2, 3], SamplingParams(n=1), adapter="a"))
    assert len(bodies) == 1 and bodies[0]["sampling_params"]["n"] == 1 and bodies[0]["lora_path"] == "a"


@pytest.mark.parametrize("call", ["stream", "chat"])
def test_shapes_that_cannot_be_balanced_are_refused_before_sending(call):
    client, bodies = recording_client()
    params = SamplingParams(n=2)
    coro = (client.generate([1, 2], params, adapter="a", on_first_token=lambda: None) if call == "stream"
            else client.chat([{"role": "user", "content": "hi"}], params, adapter="a"))
    with pytest.raises(EngineError, match="sglang#36894"):
        asyncio.run(coro)
    assert bodies == []


def test_behind_a_router_the_n_samples_go_as_single_requests():
    """sglang-router 0.3 refuses a per-sample sampling_params list; the engine's version comes from a worker."""
    client, bodies = recording_client(version="0.5.14")
    worker, _ = recording_client(version="0.5.14")
    client.info_source = worker
    gens = asyncio.run(client.generate([1, 2, 3], SamplingParams(n=3, seed=5), adapter="a"))
    assert len(gens) == 3
    warm_up, *singles = bodies
    assert warm_up["sampling_params"]["max_new_tokens"] == 0
    assert [b["input_ids"] for b in singles] == [[1, 2, 3]] * 3
    assert sorted(b["sampling_params"]["sampling_seed"] for b in singles) == [5, 6, 7]
    assert all(b["sampling_params"]["n"] == 1 and b["lora_path"] == "a" for b in singles)
