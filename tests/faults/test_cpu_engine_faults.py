"""Faults a client can inject into the CPU engine: bad values, bad adapter files, a huge prompt.

One CPU engine subprocess (`server`, module scope), started as a run starts it. Each test sends
what an adversarial probe found to hurt it and checks that only that request is refused, with a
400 in SGLang's error shape, and that every other client is still served.

In order (injected fault → what is checked):
  - temperature NaN / stop_token_ids outside the vocabulary among 6 good requests in one decode
    batch → 400 for the bad one at the request boundary, 200 for every good one (the bad one
    failed the whole batch with 500 before);
  - Infinity as max_new_tokens or temperature, a sampling_seed beyond a torch seed → 400 (was 500);
  - adapter files that are garbage (adapter_config.json, adapter_model.safetensors) → 400 naming
    the file and what to do (was 500);
  - an adapter whose tensors do not fit the model (lora_A of the wrong width) → refused at load
    with 400 naming the tensor and its module; /generate keeps working (before: loaded, then every
    request failed with 500 while /health said 200);
  - a 1e6-character prompt being tokenised (~1 s) → a small request sent meanwhile is answered
    before it (the event loop tokenised it and stalled every client before).
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from artsg_nb.serving.server import ServerConfig, start_server

pytestmark = pytest.mark.faults

GOOD = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with start_server(ServerConfig(engine="cpu", model_path=str(model_dir),
                                   run_dir=str(tmp_path_factory.mktemp("cpu-engine-faults")), max_lora_rank=8)) as srv:
        yield srv


def post(server, path: str, body: dict | str, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=timeout,
                      headers={"content-type": "application/json", **auth(server)})


def auth(server) -> dict:
    """The server's key (servers require one by default; these tests are about bad bodies)."""
    return {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}


async def _batch(server, bad_body: str) -> tuple[list[httpx.Response], httpx.Response]:
    """Six good requests and one bad one, sent together so that they share decode batches."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=auth(server)) as client:
        good = [client.post("/generate", json={"input_ids": [5, 6, 7 + i], "sampling_params": GOOD})
                for i in range(6)]
        bad = client.post("/generate", content=bad_body, headers={"content-type": "application/json"})
        *goods, bad_resp = await asyncio.gather(*good, bad)
    return goods, bad_resp


@pytest.mark.parametrize("bad_params", ['{"max_new_tokens": 24, "temperature": NaN, "ignore_eos": true}',
                                        '{"max_new_tokens": 24, "stop_token_ids": [1000000000], "ignore_eos": true}'])
def test_one_bad_request_fails_alone_with_400(server, bad_params):
    goods, bad = asyncio.run(_batch(server, f'{{"input_ids": [5, 6, 9], "sampling_params": {bad_params}}}'))
    assert bad.status_code == 400, bad.text
    assert isinstance(bad.json()["error"], (str, dict))  # SGLang's {"error": ...}
    assert ("temperature" in bad.text and "finite" in bad.text) or "outside the vocabulary" in bad.text
    assert [r.status_code for r in goods] == [200] * 6, [r.text[:200] for r in goods if r.status_code != 200]
    assert all(len(r.json()["output_ids"]) == GOOD["max_new_tokens"] for r in goods)


@pytest.mark.parametrize("bad_params", ['{"max_new_tokens": Infinity}', '{"temperature": Infinity}',
                                        '{"sampling_seed": 1000000000000000000000000000000}'])
def test_out_of_range_numbers_are_400(server, bad_params):
    resp = post(server, "/generate", f'{{"input_ids": [5, 6, 7], "sampling_params": {bad_params}}}')
    assert resp.status_code == 400, resp.text
    assert "sampling_params" in resp.text or "must be" in resp.text


def _adapter(path, model_dir, a_width=None):
    """q_proj and v_proj of layer 0, rank 8, B = 0 (the base outputs); with `a_width` q_proj's
    lora_A has that width instead of hidden_size, and v_proj's weights are random (they fit)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden = cfg["hidden_size"]
    kv_out = cfg["num_key_value_heads"] * (cfg.get("head_dim") or hidden // cfg["num_attention_heads"])
    q, v = (f"base_model.model.model.layers.0.self_attn.{m}" for m in ("q_proj", "v_proj"))
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": str(model_dir), "lora_dropout": 0.0, "bias": "none"}))
    fill = torch.randn if a_width else torch.zeros
    save_file({f"{q}.lora_A.weight": torch.zeros(8, a_width or hidden), f"{q}.lora_B.weight": torch.zeros(hidden, 8),
               f"{v}.lora_A.weight": fill(8, hidden), f"{v}.lora_B.weight": fill(kv_out, 8)},
              str(path / "adapter_model.safetensors"))
    return path


def test_garbage_adapter_files_are_400_naming_the_file(server, model_dir, tmp_path):
    bad_json = _adapter(tmp_path / "bad-json", model_dir)
    (bad_json / "adapter_config.json").write_bytes(b"\xff\xfe{not json")
    bad_weights = _adapter(tmp_path / "bad-weights", model_dir)
    (bad_weights / "adapter_model.safetensors").write_bytes(b"\xff" * 64)  # "header too large"
    for name, path, file in (("j", bad_json, "adapter_config.json"), ("w", bad_weights, "adapter_model.safetensors")):
        resp = post(server, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert resp.status_code == 400, resp.text
        body = resp.json()
        assert body["success"] is False and f"{path}/{file}" in body["error_message"]
        assert "save the adapter again" in body["error_message"]


def test_adapter_of_the_wrong_shape_is_refused_at_load(server, model_dir, tmp_path):
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    path = _adapter(tmp_path / "wide", model_dir, a_width=hidden * 2)
    greedy = {"input_ids": [5, 6, 7], "sampling_params": {**GOOD, "temperature": 0.0}}
    base_before = post(server, "/generate", greedy).json()["output_ids"]
    resp = post(server, "/load_lora_adapter", {"lora_name": "wide", "lora_path": str(path)})
    assert resp.status_code == 400, resp.text
    assert "wide" not in httpx.get(f"{server.url}/v1/models", headers=auth(server)).text
    # the first adapter load of this server failed: the base model must be untouched by it
    after = post(server, "/generate", greedy)
    assert after.status_code == 200 and after.json()["output_ids"] == base_before, after.text
    good = _adapter(tmp_path / "good", model_dir)  # and adapters that fit still load and serve
    assert post(server, "/load_lora_adapter", {"lora_name": "good", "lora_path": str(good)}).status_code == 200
    with_good = post(server, "/generate", {**greedy, "lora_path": "good"})  # B = 0: the base outputs
    assert with_good.status_code == 200 and with_good.json()["output_ids"] == base_before, with_good.text
    assert httpx.get(f"{server.url}/health").status_code == 200
    msg = resp.json()["error_message"]
    assert "layers.0.self_attn.q_proj.lora_A.weight" in msg and f"[8, {hidden * 2}]" in msg and "(r, " in msg


def test_a_huge_prompt_does_not_stall_other_clients(server):
    huge = {"text": "12 + 345 = 357. " * 62500, "sampling_params": {"max_new_tokens": 1}}  # 1e6 characters

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=auth(server)) as client:
            done = {}

            async def timed(name, coro):
                resp = await coro
                done[name] = time.perf_counter()
                return resp

            done["sent"] = time.perf_counter()
            big = asyncio.create_task(timed("huge", client.post("/generate", json=huge)))
            await asyncio.sleep(0.15)  # its body is in (and, were it tokenised, its tokenising under way)
            done["small_sent"] = time.perf_counter()
            small = await timed("small", client.post("/generate", json={"input_ids": [5, 6, 7],
                                                                         "sampling_params": {"max_new_tokens": 1}}))
            return small, await big, done

    small, big, done = asyncio.run(go())
    assert small.status_code == 200 and big.status_code == 400  # longer than the context: refused
    # Refused by its length before any tokenising (~0.7 s for 1e6 characters), and the small request
    # meanwhile answered at once: nothing held the event loop.
    assert done["small"] - done["small_sent"] < 1.0, "the small request waited behind the huge prompt"
    assert done["huge"] - done["sent"] < 1.0, "the huge prompt was worked on before it was refused"


def test_a_request_failing_in_the_decode_batch_fails_alone(model_dir):
    """Past the request boundary (a value no check foresaw): its sampling fails in the middle of
    a decode batch → that request ends with its error, the others of the batch finish normally."""
    import threading

    from artsg_nb.cpu_engine.metrics import EngineMetrics
    from artsg_nb.cpu_engine.model import ModelRunner
    from artsg_nb.cpu_engine.request import Request
    from artsg_nb.cpu_engine.sampling import RequestSampling
    from artsg_nb.cpu_engine.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(ModelRunner(str(model_dir)), SchedulerConfig(), EngineMetrics("faults"))
    scheduler.start()
    done = threading.Semaphore(0)
    good = RequestSampling(max_new_tokens=8, ignore_eos=True, sampling_seed=3)
    bad = RequestSampling(max_new_tokens=8, ignore_eos=True, temperature=float("nan"))  # not via the checks
    reqs = [Request(input_ids=[5, 6, 7 + i], params=bad if i == 2 else good, return_logprob=True,
                    on_event=lambda r, finished: finished and done.release()) for i in range(4)]
    try:
        scheduler.submit(reqs)
        for _ in reqs:
            assert done.acquire(timeout=60)
    finally:
        scheduler.stop()
    assert reqs[2].error and "probability tensor" in reqs[2].error
    assert [r.error for i, r in enumerate(reqs) if i != 2] == [None] * 3
    assert all(len(r.output_ids) == 8 for i, r in enumerate(reqs) if i != 2)
