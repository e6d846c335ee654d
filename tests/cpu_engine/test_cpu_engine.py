"""The CPU engine as a real subprocess, exercised over HTTP, and checked against SGLang's shapes.

One engine per module (`python -m artsg_nb.cpu_engine`, a free port, its own process group)
serves every HTTP test; its boot adapter is written by hand (plain safetensors), the adapters
the tests load are made with PEFT with non-zero lora_B while the engine boots. Conformance
tests compare key sets and value types with the responses recorded from a real SGLang 0.5.14
(shared/fixtures/sglang-0.5.14/). A few in-process tests drive the scheduler directly
(radix cache off vs on, batched vs alone, flush refused while busy) and the app without a model
(--api-key, the flush route's busy answers).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file
from sglang_fixtures import fixture
from waiting import poll_until

ALLOWED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MAX_RANK = 8
PROMPT = [5, 17, 33, 101, 250, 7, 9, 64, 300, 12, 45, 88]


# ---- model and adapters --------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_engine_model_dir(request) -> Path:
    """The tiny Qwen2: conftest's tiny_model_dir when there is one, else the cached default build."""
    try:
        return Path(request.getfixturevalue("tiny_model_dir"))
    except pytest.FixtureLookupError:
        from artsg_nb.models.tiny import default_model_dir

        return default_model_dir()


def write_lora(out: Path, model_dir: Path, rank: int = 4, targets=("q_proj", "v_proj"), seed: int = 0,
               extra_config: dict | None = None) -> Path:
    """A LoRA directory written by hand (no PEFT import), shaped from the model's config."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    hidden = config["hidden_size"]
    dims = {"q_proj": (hidden, config["num_attention_heads"] * head_dim),
            "k_proj": (hidden, config["num_key_value_heads"] * head_dim),
            "v_proj": (hidden, config["num_key_value_heads"] * head_dim),
            "o_proj": (config["num_attention_heads"] * head_dim, hidden),
            "up_proj": (hidden, config["intermediate_size"])}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in targets:
            block = "mlp" if module.endswith(("up_proj", "gate_proj", "down_proj")) else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            d_in, d_out = dims[module]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
           "target_modules": list(targets), "base_model_name_or_path": str(model_dir), "lora_dropout": 0.0,
           "bias": "none", "inference_mode": True, **(extra_config or {})}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def make_peft_adapter(model_dir: Path, out: Path, rank: int = 4, targets=("q_proj", "v_proj"), seed: int = 1,
                      safe: bool = True) -> Path:
    """A PEFT LoRA with random, non-zero lora_B (a fresh LoRA is a no-op: B starts at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir)),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(out), safe_serialization=safe)
    return out


# ---- the engine subprocess -----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "artsg_nb.cpu_engine", "--host", "127.0.0.1", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        if poll_until(healthy, timeout_s, poll_s=0.2):
            return
        raise TimeoutError(f"no /health after {timeout_s} s:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def adapters(cpu_engine_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"boot": write_lora(root / "boot", cpu_engine_model_dir, seed=3)}


@pytest.fixture(scope="module")
def engine(cpu_engine_model_dir, adapters, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    proc = EngineProcess(["--model-path", str(cpu_engine_model_dir), "--max-lora-rank", str(MAX_RANK),
                          "--lora-target-modules", *ALLOWED_MODULES, "--lora-paths", f"boot={adapters['boot']}",
                          "--enable-cache-report", "--max-loras-per-batch", "4", "--random-seed", "0"], log_path)
    try:
        # Build the PEFT adapters (and the refused ones) while the engine boots.
        root = adapters["boot"].parent
        model_dir = cpu_engine_model_dir
        adapters["a"] = make_peft_adapter(model_dir, root / "a", seed=1)
        adapters["b"] = make_peft_adapter(model_dir, root / "b", targets=ALLOWED_MODULES, seed=2)
        adapters["bin"] = make_peft_adapter(model_dir, root / "bin", seed=4, safe=False)
        adapters["rank16"] = write_lora(root / "rank16", model_dir, rank=16)
        adapters["mlp"] = write_lora(root / "mlp", model_dir, targets=("q_proj", "up_proj"))
        adapters["dora"] = write_lora(root / "dora", model_dir, extra_config={"use_dora": True})
        # a second *.safetensors half written beside the adapter: SGLang reads it too, and fails
        adapters["beside"] = make_peft_adapter(model_dir, root / "beside", seed=5)
        (adapters["beside"] / "optimizer.safetensors").write_bytes(b"\0" * 64)
        proc.wait_ready()
        with httpx.Client(base_url=proc.url, timeout=60) as http:
            for name in ("a", "b"):
                r = http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters[name])})
                assert r.status_code == 200, r.text
            yield proc, http
    finally:
        proc.stop()


@pytest.fixture
def http(engine) -> httpx.Client:
    return engine[1]


def generate(http, input_ids=PROMPT, lora=None, status=200, **kw) -> dict | list:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
            "return_logprob": True, **kw}
    if lora is not None:
        body["lora_path"] = lora
    r = http.post("/generate", json=body)
    assert r.status_code == status, r.text
    return r.json()


def logprobs(out: dict) -> list[float]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def flush(http) -> None:
    r = http.post("/flush_cache", params={"timeout": 30})
    assert r.status_code == 200, r.text


# ---- readiness and info --------------------------------------------------------------------
def test_health_routes(http):
    assert http.get("/health").status_code == 200 and http.get("/health").text == ""
    assert http.get("/health_generate").status_code == 200


def test_model_info_matches_sglang_keys(http, cpu_engine_model_dir):
    expected = fixture("model_info.json")["body"]
    for route in ("/model_info", "/get_model_info"):
        body = http.get(route).json()
        assert set(expected) <= set(body)
        assert body["model_type"] == "qwen2" and body["architectures"] == ["Qwen2ForCausalLM"]
        assert body["model_path"] == str(cpu_engine_model_dir) and body["is_generation"] is True


def test_server_info_reports_the_resolved_args(http, adapters):
    for route in ("/server_info", "/get_server_info"):
        info = http.get(route).json()
        assert info["max_lora_rank"] == MAX_RANK
        assert info["lora_target_modules"] == list(ALLOWED_MODULES)
        assert info["disable_radix_cache"] is False and info["enable_cache_report"] is True
        assert info["max_loras_per_batch"] == 4 and info["random_seed"] == 0
        assert info["version"].startswith("artsg-cpu-")
        assert info["lora_paths"][0]["lora_name"] == "boot"
        assert info["lora_paths"][0]["lora_path"] == str(adapters["boot"])


def test_v1_models_lists_base_and_adapters(http, cpu_engine_model_dir, adapters):
    expected = fixture("v1_models.json")["body"]
    body = http.get("/v1/models").json()
    assert set(body) == set(expected) and body["object"] == "list"
    cards = {c["id"]: c for c in body["data"]}
    base = cards[str(cpu_engine_model_dir)]
    assert set(base) == set(expected["data"][0]) and base["parent"] is None and base["max_model_len"] > 0
    for name in ("boot", "a", "b"):
        assert set(cards[name]) == set(expected["data"][1])
        assert cards[name]["root"] == str(adapters[name])
        assert cards[name]["parent"] == str(cpu_engine_model_dir)


# ---- /generate -----------------------------------------------------------------------------
def test_generate_matches_sglang_shape(http):
    expected = fixture("generate_logprob.json")["body"]
    out = http.post("/generate", json={"text": "Hello kalo mine", "sampling_params": {"max_new_tokens": 8,
                    "temperature": 0.0}, "return_logprob": True, "top_logprobs_num": 2,
                    "logprob_start_len": 0}).json()
    assert set(out) == set(expected)
    assert set(out["meta_info"]) == set(expected["meta_info"])
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8} or meta["finish_reason"]["type"] == "stop"
    n = len(out["output_ids"])
    assert meta["completion_tokens"] == n == meta["output_token_logprobs_length"]
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(isinstance(t[0], float) and t[2] is None for t in meta["output_token_logprobs"])
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"]) and meta["input_top_logprobs"][0] is None
    for key in ("e2e_latency", "queue_time", "request_received_ts"):
        assert isinstance(meta[key], float)
    assert isinstance(meta["cached_tokens"], int) and isinstance(out["text"], str)


def test_adapter_outputs_and_logprobs_differ_from_base(http):
    base = generate(http)
    for name in ("a", "b", "boot"):
        adapted = generate(http, lora=name)
        assert logprobs(adapted) != pytest.approx(logprobs(base), abs=1e-3), name
    assert logprobs(generate(http, lora="a")) == pytest.approx(logprobs(generate(http, lora="a")), abs=1e-5)


def test_cached_tokens_grow_on_a_repeated_prefix_and_reuse_is_exact(http):
    flush(http)
    cold = generate(http)
    assert cold["meta_info"]["cached_tokens"] == 0
    hot = generate(http)
    # Like SGLang, the last prompt token is always recomputed for its logits.
    assert hot["meta_info"]["cached_tokens"] == len(PROMPT) - 1
    assert hot["output_ids"] == cold["output_ids"]
    assert logprobs(hot) == pytest.approx(logprobs(cold), abs=1e-5)
    longer = generate(http, input_ids=PROMPT + cold["output_ids"] + [42, 43])
    # The first request's prompt + output is cached: a multi-turn continuation hits all of it.
    assert longer["meta_info"]["cached_tokens"] == len(PROMPT) + len(cold["output_ids"]) - 1


def test_cache_is_namespaced_per_adapter_load(http, adapters):
    prompt = [9, 8, 7, 6, 5, 4, 3, 200, 201, 202]
    generate(http, input_ids=prompt, lora="a")
    assert generate(http, input_ids=prompt, lora="a")["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert generate(http, input_ids=prompt)["meta_info"]["cached_tokens"] == 0
    assert generate(http, input_ids=prompt, lora="b")["meta_info"]["cached_tokens"] == 0
    # The same directory under a new name is a new load id: a new namespace.
    r = http.post("/load_lora_adapter", json={"lora_name": "a-again", "lora_path": str(adapters["a"])})
    assert r.status_code == 200
    out = generate(http, input_ids=prompt, lora="a-again")
    assert out["meta_info"]["cached_tokens"] == 0
    assert logprobs(out) == pytest.approx(logprobs(generate(http, input_ids=prompt, lora="a")), abs=1e-5)
    assert http.post("/unload_lora_adapter", json={"lora_name": "a-again"}).status_code == 200


def test_n_samples_are_batched_and_share_the_prompt(http):
    flush(http)
    out = http.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 5, "temperature": 1.0, "n": 4, "sampling_seed": 7, "ignore_eos": True}}).json()
    assert isinstance(out, list) and len(out) == 4
    assert [o["meta_info"]["cached_tokens"] for o in out] == [0] + [len(PROMPT) - 1] * 3
    assert all(len(o["output_ids"]) == 5 for o in out)
    assert len({tuple(o["output_ids"]) for o in out}) > 1  # seed + j per sample
    again = http.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 5, "temperature": 1.0, "n": 4, "sampling_seed": 7, "ignore_eos": True}}).json()
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]


def test_batch_input_returns_a_list(http):
    out = generate(http, input_ids=[PROMPT, PROMPT[:5]])
    assert isinstance(out, list) and [o["meta_info"]["prompt_tokens"] for o in out] == [len(PROMPT), 5]


def test_temperature_scales_the_logprobs(http):
    hot = http.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                                       "sampling_params": {"max_new_tokens": 1, "temperature": 0.5}}).json()
    greedy = http.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                                          "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}).json()
    hot_in = [t[0] for t in hot["meta_info"]["input_token_logprobs"][1:]]
    greedy_in = [t[0] for t in greedy["meta_info"]["input_token_logprobs"][1:]]
    assert hot_in != pytest.approx(greedy_in, abs=1e-3)


def test_concurrent_requests_match_requests_run_alone(http):
    jobs = [(PROMPT, None), (PROMPT[:7] + [400, 401], "a"), (list(range(20, 45)), "b"), (PROMPT[2:], "boot")]
    alone = [generate(http, input_ids=ids, lora=lora) for ids, lora in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: generate(http, input_ids=job[0], lora=job[1]), jobs))
    for a, t in zip(alone, together):
        assert t["output_ids"] == a["output_ids"]
        assert logprobs(t) == pytest.approx(logprobs(a), abs=1e-5)


def test_stop_token_ids_and_stop_strings(http):
    first = generate(http)["output_ids"]
    out = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.0, "stop_token_ids": [first[1]]}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[1]}
    assert out["output_ids"][-1] == first[1] and len(out["output_ids"]) <= 2
    text = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.0, "skip_special_tokens": False}}).json()["text"]
    stop = text.strip()[:1]
    if stop:
        out = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 6, "temperature": 0.0, "stop": [stop], "skip_special_tokens": False}}).json()
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop not in out["text"]


def test_streaming_sends_sse_chunks_then_done(engine):
    proc, _ = engine
    with httpx.stream("POST", proc.url + "/generate", timeout=60, json={
            "input_ids": PROMPT, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_generate_errors(http):
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"seed": 1}})
    assert r.status_code == 400 and isinstance(r.json()["error"], str) and "seed" in r.json()["error"]
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"repetition_penalty": 1.3}})
    assert r.status_code == 400 and "repetition_penalty" in r.json()["error"]
    r = http.post("/generate", json={"input_ids": PROMPT, "lora_path": "nope"})
    assert r.status_code == 400 and "has never been loaded" in r.json()["error"]["message"]
    r = http.post("/generate", content=b'{"input_ids": [1, 2', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    assert http.post("/generate", json={"sampling_params": {}}).status_code == 400
    assert http.post("/generate", json={"input_ids": [10**7]}).status_code == 400
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10**6}})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]


# ---- /v1/chat/completions ------------------------------------------------------------------
MESSAGES = [{"role": "user", "content": "Say something about kalo mine ranto."}]


def chat(http, model, **kw) -> dict:
    r = http.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 8,
                                                "temperature": 0.0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_matches_sglang_shape_and_selects_adapters(http, cpu_engine_model_dir):
    served = str(cpu_engine_model_dir)
    expected = fixture("chat_base.json")["body"]
    base = chat(http, served, logprobs=True)
    assert set(base) == set(expected) and set(base["usage"]) == set(expected["usage"])
    choice = base["choices"][0]
    assert set(choice) == set(expected["choices"][0])
    assert set(choice["message"]) == set(expected["choices"][0]["message"])
    entry = choice["logprobs"]["content"][0]
    assert set(entry) == {"token", "bytes", "logprob", "top_logprobs"}
    by_model = chat(http, f"{served}:a", logprobs=True)
    by_lora_path = chat(http, served, lora_path="a", logprobs=True)
    bare = chat(http, "a", logprobs=True)  # no colon: the base model, as on SGLang

    def lps(resp):
        return [e["logprob"] for e in resp["choices"][0]["logprobs"]["content"]]

    assert lps(by_model) == pytest.approx(lps(by_lora_path), abs=1e-5)
    assert lps(by_model) != pytest.approx(lps(base), abs=1e-3)
    assert lps(bare) == pytest.approx(lps(base), abs=1e-5)
    assert chat(http, f"{served}:a", lora_path="b")["choices"][0]["message"] == by_model["choices"][0]["message"]


def test_chat_token_ids_usage_and_cache_report(http, cpu_engine_model_dir):
    """SGLang 0.5.14's chat route gives ids back only through return_prompt_token_ids (the
    choice's prompt_token_ids) and return_meta_info (meta_info.output_token_logprobs, [logprob,
    id, text] triples when logprobs are asked for); `return_token_ids` is vLLM's and SGLang
    ignores it, so the CPU engine must too (ART trajectories relied on it: sglang gave no ids)."""
    served = str(cpu_engine_model_dir)
    flush(http)
    ask = {"return_prompt_token_ids": True, "return_meta_info": True, "logprobs": True}
    first = chat(http, served, **ask)
    assert first["usage"]["prompt_tokens_details"] is None  # SGLang: only when something hit
    again = chat(http, served, n=2, **ask)
    choice = again["choices"][0]

    def reply_ids(c):
        return [t[1] for t in c["meta_info"]["output_token_logprobs"]]

    assert len(choice["prompt_token_ids"]) == again["usage"]["prompt_tokens"]
    assert reply_ids(choice) == reply_ids(first["choices"][0])
    assert [t[0] for t in choice["meta_info"]["output_token_logprobs"]] == [e["logprob"] for e in choice["logprobs"]["content"]]
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": again["usage"]["prompt_tokens"] - 1}
    assert again["usage"]["completion_tokens"] == sum(len(reply_ids(c)) for c in again["choices"])
    vllm_style = chat(http, served, return_token_ids=True, logprobs=True)["choices"][0]
    assert not {"response_token_ids", "token_ids", "prompt_token_ids", "meta_info"} & set(vllm_style)
    r = http.post("/v1/chat/completions", json={"model": served, "messages": MESSAGES, "lora_path": "nope"})
    assert r.status_code == 400 and r.json()["object"] == "error"


# ---- adapters ------------------------------------------------------------------------------
def test_load_and_unload_match_sglang_shape(http, adapters):
    r = http.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["a"])})
    assert r.status_code == 200 and set(r.json()) == set(fixture("load_lora_adapter.json")["body"])
    assert r.json()["success"] is True and r.json()["error_message"] == ""
    assert r.json()["loaded_adapters"]["c"] == str(adapters["a"])
    r = http.post("/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 200 and set(r.json()) == set(fixture("unload_lora_adapter.json")["body"])
    assert "c" not in r.json()["loaded_adapters"]
    r = http.post("/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 400 and r.json()["error_message"].startswith("LoRA with name c does not exist.")
    assert http.post("/generate", json={"input_ids": PROMPT, "lora_path": "c"}).status_code == 400


@pytest.mark.parametrize("name, message", [
    ("a", "Failed to load LoRA adapter a because it is already loaded"),
    ("missing", "is not a directory"),
    ("rank16", "exceeds --max-lora-rank 8"),
    ("mlp", "['up_proj']"),
    ("bin", "safetensors only"),
    ("dora", "DoRA"),
    ("beside", "optimizer.safetensors is not a readable safetensors file"),
])
def test_refused_adapters_get_400(http, adapters, name, message):
    path = str(adapters.get(name, "/nonexistent/adapter"))
    r = http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    assert r.status_code == 400
    body = r.json()
    assert set(body) == set(fixture("load_lora_adapter_bad.json")["body"])
    assert body["success"] is False and message in body["error_message"]
    assert body["loaded_adapters"]["a"] == str(adapters["a"])


def test_unload_waits_for_in_flight_requests(engine, adapters):
    proc, http = engine
    r = http.post("/load_lora_adapter", json={"lora_name": "busy", "lora_path": str(adapters["b"])})
    assert r.status_code == 200
    first_token, chunks, done = threading.Event(), [], []

    def stream():
        with httpx.stream("POST", proc.url + "/generate", timeout=60, json={
                "input_ids": PROMPT, "lora_path": "busy", "stream": True,
                "sampling_params": {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}}) as r:
            for line in r.iter_lines():
                first_token.set()
                if line == "data: [DONE]":
                    done.append(True)
                elif line.startswith("data: "):
                    chunks.append(json.loads(line[len("data: "):]))

    worker = threading.Thread(target=stream)
    worker.start()
    assert first_token.wait(30)
    r = http.post("/unload_lora_adapter", json={"lora_name": "busy"})
    # Asked of the server the moment unload answers (client-side timestamps of two threads race):
    running = http.get("/server_info").json()["internal_states"][0]["num_running_reqs"]
    worker.join(30)
    assert r.status_code == 200 and "busy" not in r.json()["loaded_adapters"]
    assert running == 0, "unload answered while the request using the adapter was still running"
    assert done and chunks[-1]["meta_info"]["completion_tokens"] == 40  # finished, not cut off


# ---- cache control and metrics -------------------------------------------------------------
def test_flush_cache_text_and_flush_after_an_aborted_stream(engine):
    proc, http = engine
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.text == fixture("flush_cache.json")["body"]
    assert http.get("/flush_cache").status_code == 200
    with httpx.stream("POST", proc.url + "/generate", timeout=60, json={
            "input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0.0, "ignore_eos": True}}) as stream:
        next(stream.iter_lines())  # admitted
    # Closing the stream aborts the request; the engine is idle again soon after.
    assert http.post("/flush_cache", params={"timeout": 30}).status_code == 200


def test_scheduler_refuses_to_flush_while_a_request_is_queued_or_running(cpu_engine_model_dir):
    """Stepped by hand (no scheduler thread), so "while running" does not depend on how fast this
    CPU decodes: a 2000-token request finishes in under a second here, and a flush sent over HTTP
    under load could arrive after it."""
    from artsg_nb.cpu_engine.metrics import EngineMetrics
    from artsg_nb.cpu_engine.model import ModelRunner
    from artsg_nb.cpu_engine.request import Request
    from artsg_nb.cpu_engine.sampling import RequestSampling
    from artsg_nb.cpu_engine.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(ModelRunner(str(cpu_engine_model_dir)), SchedulerConfig(), EngineMetrics("m"))
    finished = []
    params = RequestSampling(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    scheduler.submit([Request(input_ids=PROMPT, params=params, on_event=lambda r, done: done and finished.append(r))])
    assert scheduler.flush_cache() is False  # queued
    scheduler._round()
    assert scheduler.batch.reqs and scheduler.flush_cache() is False  # running
    cached_while_running = scheduler.cache.total_tokens
    while not finished:
        scheduler._round()
    assert len(finished[0].output_ids) == 8
    assert scheduler.cache.total_tokens >= cached_while_running > 0  # the refusals kept the cache
    assert scheduler.flush_cache() is True and scheduler.cache.total_tokens == 0


def test_flush_route_answers_like_sglang_when_the_engine_is_busy(cpu_engine_model_dir):
    from fastapi.testclient import TestClient

    from artsg_nb.cpu_engine.__main__ import parse_args
    from artsg_nb.cpu_engine.engine import Engine
    from artsg_nb.cpu_engine.routes import FLUSH_NOTE, create_app

    engine = Engine(parse_args(["--model-path", str(cpu_engine_model_dir)]))
    refusals = []

    async def busy() -> bool:
        refusals.append(time.monotonic())
        return False

    engine.healthy, engine.flush_cache = (lambda: True), busy
    client = TestClient(create_app(engine))  # no `with`: the model is never loaded
    r = client.post("/flush_cache")
    assert (r.status_code, r.text) == (400, "Cache not flushed.\n" + FLUSH_NOTE) and len(refusals) == 1
    r = client.get("/flush_cache", params={"timeout": 0.3})
    assert (r.status_code, r.text) == (400, "Timed out waiting for idle state.\n")
    assert len(refusals) > 2 and refusals[-1] - refusals[1] >= 0.25  # it kept asking until the timeout


def test_release_memory_is_refused_while_a_request_runs(cpu_engine_model_dir):
    """SGLang asserts its scheduler is idle on /release_memory_occupation; the CPU engine answers
    that refusal instead. Stepped by hand like the flush test above: over HTTP a 120-token request
    on the tiny model can finish before the release arrives (the race test_client_memory had)."""
    import asyncio

    from artsg_nb.cpu_engine.__main__ import parse_args
    from artsg_nb.cpu_engine.engine import Engine
    from artsg_nb.cpu_engine.memory import OccupationError
    from artsg_nb.cpu_engine.metrics import EngineMetrics
    from artsg_nb.cpu_engine.model import ModelRunner
    from artsg_nb.cpu_engine.request import Request
    from artsg_nb.cpu_engine.sampling import RequestSampling
    from artsg_nb.cpu_engine.scheduler import Scheduler, SchedulerConfig

    engine = Engine(parse_args(["--model-path", str(cpu_engine_model_dir), "--enable-memory-saver"]))
    scheduler = engine.scheduler = Scheduler(ModelRunner(str(cpu_engine_model_dir)), SchedulerConfig(),
                                             EngineMetrics("m"))  # never started: this test steps it
    finished = []
    params = RequestSampling(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    scheduler.submit([Request(input_ids=PROMPT, params=params, on_event=lambda r, done: done and finished.append(r))])
    scheduler._round()
    assert scheduler.batch.reqs and not finished

    async def release_between_rounds() -> None:
        release = asyncio.ensure_future(engine.release_memory(["kv_cache"]))
        await asyncio.sleep(0)  # its command is in the scheduler's inbox
        scheduler._round()  # the command runs between this round's steps
        await release

    with pytest.raises(OccupationError, match="only when server is idle"):
        asyncio.run(release_between_rounds())
    assert engine.memory.released == set()
    while not finished:
        scheduler._round()
    assert len(finished[0].output_ids) == 8  # the refusal left the request running to its end
    asyncio.run(release_between_rounds())
    assert engine.memory.released == {"kv_cache"} and scheduler.cache.total_tokens == 0


def test_memory_routes_without_memory_saver_answer_like_sglang(engine):
    """No --enable-memory-saver: SGLang answers 200 with a null body and frees nothing, but a
    kv_cache release still flushes the radix cache; generation keeps working."""
    proc, http = engine
    generate(http)
    assert generate(http)["meta_info"]["cached_tokens"] > 0
    r = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert r.status_code == 200 and r.text == "null"
    assert generate(http)["meta_info"]["cached_tokens"] == 0  # flushed; not refused
    bad = http.post("/resume_memory_occupation", json={"tags": ["weights"]})  # SGLang: KeyError, server exits
    assert bad.status_code == 400 and "KeyError: 'weights'" in bad.json()["error"]["message"]
    assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert http.get("/release_memory_occupation").status_code == 200  # no body = every tag
    assert http.post("/resume_memory_occupation", json={}).status_code == 200
    assert http.get("/server_info").json()["enable_memory_saver"] is False

    from artsg_nb.engines import MemorySaverError, make_client, run_sync

    async def release():
        async with make_client("cpu", proc.url, http.get("/model_info").json()["model_path"]) as client:
            await client.release_memory()

    with pytest.raises(MemorySaverError, match="enable_memory_saver=True"):
        run_sync(release())


def test_metrics_names_match_sglang(http):
    generate(http)
    generate(http)  # a hit, so cached_tokens_total exists
    text = http.get("/metrics").text
    recorded = {line.split("{")[0].split(" ")[0] for line in fixture("metrics.txt").splitlines() if line}
    ours = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    required = {"sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:cached_tokens_total",
                "sglang:num_requests_total", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                "sglang:cache_hit_rate", "sglang:token_usage", "sglang:lora_pool_slots_used",
                "sglang:lora_pool_slots_total"}
    assert required <= ours <= recorded | {"sglang:gen_throughput"}
    assert 'cache_source="device"' in text and 'engine_type="unified"' in text
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["sglang:cached_tokens_total"].value > 0
    assert samples["sglang:prompt_tokens_total"].labels["model_name"]
    assert samples["sglang:lora_pool_slots_total"].value == 4


def test_through_the_client_module(engine, adapters):
    import artsg_nb.engines as client_mod

    proc, http = engine
    served = http.get("/model_info").json()["model_path"]

    async def scenario():
        async with client_mod.make_client("cpu", proc.url, served) as client:
            assert await client.health()
            params = client_mod.SamplingParams(max_new_tokens=4, temperature=1.0, n=3, ignore_eos=True)
            gens = await client.generate(PROMPT, params, adapter="a")
            assert len(gens) == 3 and all(len(g.output_ids) == len(g.logprobs) == 4 for g in gens)
            streamed = await client.generate(PROMPT, params, adapter="a", on_first_token=lambda: None)
            assert len(streamed) == 3 and streamed[0].ttft_s is not None
            scores = await client.score(PROMPT, adapter="a")
            assert len(scores) == len(PROMPT) - 1
            with pytest.raises(client_mod.AdapterExistsError):
                await client.load_adapter("a", str(adapters["a"]))
            with pytest.raises(client_mod.UnknownAdapterError):
                await client.generate(PROMPT, params, adapter="never-loaded")
            await client.flush_cache(timeout_s=10)
            assert "sglang:prompt_tokens_total" in await client.metrics_text()

    client_mod.run_sync(scenario())


# ---- in-process: scheduler and app ---------------------------------------------------------
def test_scheduler_cache_off_gives_the_same_tokens_and_logprobs(cpu_engine_model_dir):
    from artsg_nb.cpu_engine.metrics import EngineMetrics
    from artsg_nb.cpu_engine.model import ModelRunner
    from artsg_nb.cpu_engine.request import Request
    from artsg_nb.cpu_engine.sampling import RequestSampling
    from artsg_nb.cpu_engine.scheduler import Scheduler, SchedulerConfig

    runner = ModelRunner(str(cpu_engine_model_dir))

    def run(disable: bool) -> list[Request]:
        scheduler = Scheduler(runner, SchedulerConfig(disable_radix_cache=disable), EngineMetrics("m"))
        scheduler.start()
        params = RequestSampling(max_new_tokens=5, temperature=0.0, ignore_eos=True)
        done = threading.Semaphore(0)
        reqs = [Request(input_ids=PROMPT + [i], params=params, return_logprob=True,
                        on_event=lambda r, finished: finished and done.release()) for i in range(3)]
        scheduler.submit(reqs)
        for _ in reqs:
            assert done.acquire(timeout=60)
        scheduler.stop()
        return reqs

    on, off = run(False), run(True)
    assert [r.cached_tokens for r in off] == [0, 0, 0]
    assert [r.cached_tokens for r in on] == [0, len(PROMPT), len(PROMPT)]
    for a, b in zip(on, off):
        assert a.output_ids == b.output_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)


def test_api_key_guards_every_route_but_health_and_metrics(cpu_engine_model_dir, monkeypatch):
    from fastapi.testclient import TestClient

    from artsg_nb.cpu_engine.__main__ import parse_args
    from artsg_nb.cpu_engine.engine import Engine
    from artsg_nb.cpu_engine.routes import create_app

    monkeypatch.setenv("ARTSG_CPU_ENGINE_API_KEY", "sekrit")  # the key comes by environment, not argv
    engine = Engine(parse_args(["--model-path", str(cpu_engine_model_dir)]))
    assert "ARTSG_CPU_ENGINE_API_KEY" not in os.environ  # read once, not passed on to children
    client = TestClient(create_app(engine))  # no `with`: the model is never loaded
    assert client.get("/health").status_code == 503  # reachable without a key, not ready
    assert client.get("/metrics").status_code == 200  # open, as on SGLang
    assert client.get("/model_info").status_code == 401
    assert client.post("/generate", json={}).status_code == 401
    assert client.post("/load_lora_adapter", json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/model_info", headers={"Authorization": "Bearer sekrit"}).status_code == 200


def test_parse_model_parameter_follows_sglang():
    from artsg_nb.cpu_engine.protocol import parse_model_parameter

    assert parse_model_parameter("/m/base", "/m/base") == ("/m/base", None)
    assert parse_model_parameter("/m/base:lora1", "/m/base") == ("/m/base", "lora1")
    assert parse_model_parameter("lora1", "/m/base") == ("lora1", None)  # bare name: base model
    assert parse_model_parameter("s3://b/m:x", "s3://b/m") == ("s3://b/m", "x")
    assert parse_model_parameter("other:x:y", "/m/base") == ("other", "x:y")
    assert parse_model_parameter("/m/base:", "/m/base") == ("/m/base", None)
