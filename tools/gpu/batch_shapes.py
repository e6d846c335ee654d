"""How a step's turn-1 requests reach SGLang, and what each way costs (issue 26: the 8-token rollout).

usage: python3 tools/gpu/batch_shapes.py --model-path DIR [--task addition_chat] [--groups 16]
           [--group-size 8] [--max-new-tokens 8] [--repeats 5] [--out JSON]

One GRPORun on RunConfig defaults takes one step (so a trained adapter is served), then the same
held-out groups are sent under that adapter in each of these shapes, the prefix cache flushed
before each batch, `--repeats` batches per shape, wall time from the first byte sent to the last
answer parsed:

  per_group      what the client sends today on SGLang <= 0.5.14 (sglang#36894's workaround): per
                 group a warm-up (max_new_tokens 0) and, when it answers, one batch request of its G
                 samples; the groups concurrently (2 x groups HTTP requests)
  one_batch      the same work in two HTTP requests: one warm-up batch of every group's prompt, then
                 one batch of every sample
  one_batch_cold every sample in one batch request, no warm-up (identical prompts in one prefill
                 batch are all computed: fewer round trips, more prefill)
  singles        every sample as its own request, all at once (schedule "naive")

It prints one JSON line per shape (wall median, min, the prefix-cache hit rate, completion tokens)
and the server's /metrics deltas of its latency histograms over the shape's batches.

What it does not do: change how artsg_nb sends requests (this measures; the client decides), or
train beyond the one step.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from artsg_nb import GRPORun, RunConfig  # noqa: E402
from artsg_nb.rollout.chat_tokens import render_ids  # noqa: E402
from step_profile import server_delta  # noqa: E402

SHAPES = ("per_group", "one_batch", "one_batch_cold", "singles")


def sampling(max_new: int, seed: int | None = None) -> dict:
    params = {"max_new_tokens": max_new, "temperature": 1.0, "top_p": 1.0, "n": 1}
    return params if seed is None else {**params, "sampling_seed": seed}


async def post(client, payload: dict):
    return (await client._request("POST", "/generate", "use", json=payload)).json()


async def per_group(client, prompts, size, max_new, adapter):
    async def group(ids):
        await post(client, {"input_ids": ids, "sampling_params": sampling(0), "lora_path": adapter})
        return await post(client, {"input_ids": [ids] * size, "sampling_params": [sampling(max_new)] * size,
                                   "return_logprob": True, "lora_path": adapter})
    return [x for g in await asyncio.gather(*map(group, prompts)) for x in g]


async def one_batch(client, prompts, size, max_new, adapter, warm=True):
    if warm:
        await post(client, {"input_ids": prompts, "sampling_params": [sampling(0)] * len(prompts),
                            "lora_path": [adapter] * len(prompts)})
    ids = [p for p in prompts for _ in range(size)]
    return await post(client, {"input_ids": ids, "sampling_params": [sampling(max_new)] * len(ids),
                               "return_logprob": True, "lora_path": [adapter] * len(ids)})


async def singles(client, prompts, size, max_new, adapter):
    return await asyncio.gather(*(post(client, {"input_ids": p, "sampling_params": sampling(max_new),
                                                "return_logprob": True, "lora_path": adapter})
                                  for p in prompts for _ in range(size)))


async def send(shape, client, prompts, size, max_new, adapter):
    if shape == "per_group":
        return await per_group(client, prompts, size, max_new, adapter)
    if shape == "one_batch":
        return await one_batch(client, prompts, size, max_new, adapter)
    if shape == "one_batch_cold":
        return await one_batch(client, prompts, size, max_new, adapter, warm=False)
    return await singles(client, prompts, size, max_new, adapter)


async def measure(run: GRPORun, shape: str, prompts, a) -> dict:
    walls, hits, tokens = [], [], []
    before = await run.client.metrics_text()
    for _ in range(a.repeats):
        await run.client.flush_cache(timeout_s=30)
        t0 = time.perf_counter()
        out = await send(shape, run.client, prompts, a.group_size, a.max_new_tokens, run.adapter)
        walls.append(time.perf_counter() - t0)
        metas = [o["meta_info"] for o in out]
        prompt = sum(m["prompt_tokens"] for m in metas)
        hits.append(sum(m.get("cached_tokens") or 0 for m in metas) / max(prompt, 1))
        tokens.append(sum(len(o["output_ids"]) for o in out))
    server = server_delta(before, await run.client.metrics_text())
    keep = {k: v for k, v in server.items() if "mean_s" in v or "forward" in k or "cuda_graph" in k}
    return {"shape": shape, "wall_s_median": round(statistics.median(walls), 4), "wall_s_min": round(min(walls), 4),
            "walls_s": [round(w, 4) for w in walls], "samples": len(out),
            "completion_tokens": statistics.median(tokens), "hit_rate": round(statistics.median(hits), 3),
            "server_per_batch": {k: {f: round(x / a.repeats if f in ("n", "s", "total") else x, 5)
                                     for f, x in v.items()} for k, v in keep.items()}}


async def main_async(a) -> dict:
    cfg = RunConfig(model_path=a.model_path, run_dir=a.run_dir, task=a.task, groups_per_step=a.groups,
                    group_size=a.group_size, max_new_tokens=a.max_new_tokens)
    run = GRPORun(cfg).start()
    record = {"model": a.model_path, "task": a.task, "groups": a.groups, "group_size": a.group_size,
              "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "rows": []}
    try:
        await run.step()
        record["adapter"] = run.adapter
        record["sglang_version"] = (await run.client.server_info()).get("version")
        seeds = list(range(10_000, 10_000 + a.groups))
        prompts = [render_ids(run.trainer.tokenizer, run.task.make_env(s).reset(), add_generation_prompt=True)
                   for s in seeds]
        record["prompt_tokens"] = [len(p) for p in prompts]
        for shape in SHAPES:  # once unmeasured, so no shape pays a first-use cost for the others
            await send(shape, run.client, prompts, a.group_size, a.max_new_tokens, run.adapter)
        for shape in SHAPES:
            row = await measure(run, shape, prompts, a)
            print(json.dumps(row), flush=True)
            record["rows"].append(row)
    finally:
        run.stop()
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: the shipped tiny model")
    p.add_argument("--task", default="addition_chat")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--run-dir", default="/tmp/runs/batch-shapes")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    record = asyncio.run(main_async(a))
    if a.out:
        Path(a.out).write_text(json.dumps(record, indent=1))
    by = {r["shape"]: r["wall_s_median"] for r in record["rows"]}
    print("wall medians: " + ", ".join(f"{k} {v:.3f} s" for k, v in by.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
