"""Start a real engine on a model through artsg_nb and probe what the toolkit relies on.

usage: python3 tools/gpu/probe_engine.py --engine sglang --model DIR --run-dir D [--out JSON]

Checks, each printed as one line and collected into a JSON summary: start-up time; generate
(n=4) returns ids with aligned temperature-scaled logprobs; an adapter's outputs and logprobs
differ from the base; loading an existing name is refused; cached tokens grow on a repeated
prefix and are 0 under a fresh adapter namespace; the counter hit rate; load/unload latency; the
trainer's logprobs (transformers + PEFT on this GPU) agree with the server's for the same adapter.
Extra server flags come from ARTSG_SGLANG_ARGS / ARTSG_VLLM_ARGS.
"""
import argparse
import asyncio
import json
import statistics
import sys
import time
import traceback
from pathlib import Path


def make_adapter(model_dir: str, out: Path, rank: int = 16, seed: int = 1, scale: float = 0.05) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    pm = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, scale)
    pm.save_pretrained(out, safe_serialization=True)
    return str(out)


async def probe(client, model_dir, adapters, engine, results):
    from transformers import AutoTokenizer

    from artsg_nb.engines import AdapterExistsError, SamplingParams
    from artsg_nb.serving.metrics import cache_counters

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 3+4? " * 30}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    gens = await client.generate(ids, SamplingParams(max_new_tokens=16, temperature=0.8, n=4))
    results["generate_n4"] = all(len(g.logprobs) == len(g.output_ids) > 0 for g in gens) and len(gens) == 4
    results["cached_tokens_n4"] = [g.cached_tokens for g in gens]
    lat = []
    for i in range(5):
        t0 = time.perf_counter()
        await client.load_adapter(f"lat-{i}", adapters["a"])
        lat.append(time.perf_counter() - t0)
    ulat = []
    for i in range(5):
        t0 = time.perf_counter()
        await client.unload_adapter(f"lat-{i}")
        ulat.append(time.perf_counter() - t0)
    results["load_s_median"], results["unload_s_median"] = statistics.median(lat), statistics.median(ulat)
    await client.load_adapter("a", adapters["a"])
    try:
        await client.load_adapter("a", adapters["a"])
        results["duplicate_refused"] = False
    except AdapterExistsError:
        results["duplicate_refused"] = True
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    base = (await client.generate(ids, greedy))[0]
    lora = (await client.generate(ids, greedy, adapter="a"))[0]
    probe_ids = ids + base.output_ids
    b_lp = await client.score(probe_ids)
    a_lp = await client.score(probe_ids, adapter="a")
    results["adapter_logprob_maxdiff"] = max(abs(x - y) for x, y in zip(b_lp, a_lp))
    results["adapter_output_differs"] = base.output_ids != lora.output_ids
    msgs = [{"role": "user", "content": "Tell me something"}]
    p = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    c_base = (await client.chat(msgs, p))["choices"][0]["message"]["content"]
    c_lora = (await client.chat(msgs, p, adapter="a"))["choices"][0]["message"]["content"]
    results["chat_adapter_differs"] = c_base != c_lora
    before = cache_counters(await client.metrics_text(), engine)
    p1 = SamplingParams(max_new_tokens=2)
    first = (await client.generate(ids, p1, adapter="a"))[0]
    second = (await client.generate(ids, p1, adapter="a"))[0]
    await client.load_adapter("b", adapters["b"])
    other = (await client.generate(ids, p1, adapter="b"))[0]
    after = cache_counters(await client.metrics_text(), engine)
    results["cached_repeat"] = second.cached_tokens
    results["cached_new_namespace"] = other.cached_tokens
    results["counter_hit_rate_window"] = (after.cached_tokens - before.cached_tokens) / max(
        after.prompt_tokens - before.prompt_tokens, 1)
    # trainer vs server logprobs for adapter "a" at temperature 0.8 and 1.0
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    model = PeftModel.from_pretrained(model, adapters["a"]).to(dev).eval()
    for temp in (1.0, 0.8):
        with torch.no_grad():
            x = torch.tensor([probe_ids], device=dev)
            logits = model(input_ids=x).logits[0, :-1].float() / temp
            tr = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1).tolist()
        sv = await client.score(probe_ids, adapter="a", temperature=temp)
        d = [abs(a - b) for a, b in zip(tr, sv)]
        results[f"trainer_vs_server_mad_T{temp}"] = sum(d) / len(d)
        results[f"trainer_vs_server_max_T{temp}"] = max(d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="sglang")
    ap.add_argument("--model", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from artsg_nb import engines
    from artsg_nb.serving.server_env import server_args
    from artsg_nb.serving.server import ServerConfig, start_server

    results = {"engine": a.engine, "model": a.model}
    extra = server_args(engines.get(a.engine))
    adir = Path(a.run_dir) / "probe-adapters"
    adapters = {"a": make_adapter(a.model, adir / "a", seed=1), "b": make_adapter(a.model, adir / "b", seed=2)}
    t0 = time.perf_counter()
    server = None
    try:
        server = start_server(ServerConfig(engine=a.engine, model_path=a.model, run_dir=a.run_dir,
                                           max_lora_rank=16, extra_args=extra))
        results["startup_s"] = time.perf_counter() - t0
        asyncio.run(probe(server.client(), a.model, adapters, a.engine, results))
        results["ok"] = True
    except Exception as e:  # a probe script: record and show everything
        results["ok"] = False
        results["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        if server is not None:
            print(server.log_tail(40))
    finally:
        if server is not None:
            server.stop()
    for k, v in results.items():
        print(f"{k}: {v}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2, default=str))
    return 0 if results.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
