"""Shared-prefix speedup of the CPU engine's radix cache: the same GRPO-shaped load, cache on vs off.

    .venv/bin/python benchmarks/cpu_prefix_cache.py [--group-size 8] [--prompt-tokens 3072]
        [--new-tokens 4] [--groups 7] [--size tiny]

What it measures: two CPU engines are started from the same tiny model, one with the radix
cache and one with --disable-radix-cache. Each serves `--groups` groups, the two engines taking
turns group by group (so a busy machine slows both alike); a group is G requests for the same
long prompt (a new prompt per group, so nothing carries over between groups), sent
concurrently, with few new tokens each: a prefill-heavy load, like the G samples of one GRPO
prompt. The default prompt is 3072 tokens (the tiny model has 4096 positions) because the tiny
model is all attention: a decode step of 8 rows over a 1.5k context costs about a third of a
1.5k prefill, so at 1536 tokens the 5 decode steps of a group weigh as much as the prefill the
cache saves, and the speedup is lower (~2.5x measured; pass --prompt-tokens 1536 to see it).

Printed per engine: seconds per group (median), the speedup of cache on over cache off, and the
prefix-cache hit rate measured from /metrics (Δ sglang:cached_tokens_total /
Δ sglang:prompt_tokens_total over the timed groups) next to its theoretical maximum (G-1)/G.
The engine recomputes the last prompt token of every request (as SGLang does), so the best
reachable rate is (G-1)/G · (L-1)/L for a prompt of L tokens; both are printed.

What it does not do: compare with SGLang or vLLM (artsg_nb.bench does, on a GPU), measure
decode-heavy loads, or test correctness (tests/cpu_engine/test_cpu_engine.py does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from artsg_nb.serving.metrics import cache_counters, hit_rate
from artsg_nb.serving.server import ServerConfig, start_server
from artsg_nb.models.tiny import default_model_dir


def make_prompt(group: int, length: int, vocab: int) -> list[int]:
    """A deterministic prompt, different for every group (so groups never share a prefix)."""
    return [3 + (group * 7919 + i * 104729) % (vocab - 3) for i in range(length)]


async def run_group(http: httpx.AsyncClient, prompt: list[int], group_size: int, new_tokens: int) -> float:
    """G concurrent requests for one prompt; seconds until the last one finished."""
    # Encoded once: the client's JSON work is not what is measured.
    body = json.dumps({"input_ids": prompt, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}})
    headers = {"content-type": "application/json"}
    t0 = time.perf_counter()
    responses = await asyncio.gather(*(http.post("/generate", content=body, headers=headers)
                                       for _ in range(group_size)))
    for r in responses:
        r.raise_for_status()
    return time.perf_counter() - t0


async def measure(urls: dict[str, str], args: argparse.Namespace, vocab: int) -> dict[str, dict]:
    """Alternate groups between the engines, so background load on the machine hits both alike."""
    clients = {label: httpx.AsyncClient(base_url=url, timeout=600) for label, url in urls.items()}
    try:
        warmup = make_prompt(10_000, args.prompt_tokens, vocab)
        for http in clients.values():
            await run_group(http, warmup, args.group_size, args.new_tokens)
        before = {label: cache_counters((await http.get("/metrics")).text, "cpu") for label, http in clients.items()}
        seconds = {label: [] for label in clients}
        for g in range(args.groups):
            for label, http in clients.items():
                prompt = make_prompt(g, args.prompt_tokens, vocab)
                seconds[label].append(await run_group(http, prompt, args.group_size, args.new_tokens))
        results = {}
        for label, http in clients.items():
            after = cache_counters((await http.get("/metrics")).text, "cpu")
            results[label] = {"s_per_group": statistics.median(seconds[label]),
                              "hit_rate": hit_rate(before[label], after) or 0.0}
        return results
    finally:
        for http in clients.values():
            await http.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--group-size", type=int, default=8, help="G: requests per shared prompt")
    p.add_argument("--prompt-tokens", type=int, default=3072, help="prompt length (capped below max_position)")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--groups", type=int, default=7, help="timed groups per engine")
    p.add_argument("--size", default="tiny", choices=["tiny", "0.5b"])
    args = p.parse_args()

    model_dir = default_model_dir(args.size)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    args.prompt_tokens = min(args.prompt_tokens, config["max_position_embeddings"] - args.new_tokens - 8)
    print(f"model {model_dir} | G={args.group_size} | prompt {args.prompt_tokens} tokens | "
          f"{args.new_tokens} new tokens | {args.groups} groups per engine")

    with tempfile.TemporaryDirectory(prefix="cpu_prefix_cache.") as run_dir, ExitStack() as servers:
        urls = {}
        for label, disable in (("cache on", False), ("cache off", True)):
            cfg = ServerConfig(engine="cpu", model_path=str(model_dir), run_dir=Path(run_dir) / label.replace(" ", "_"),
                               disable_radix_cache=disable)
            urls[label] = servers.enter_context(start_server(cfg)).url
        results = asyncio.run(measure(urls, args, config["vocab_size"]))

    g, length = args.group_size, args.prompt_tokens
    on, off = results["cache on"], results["cache off"]
    print(f"{'engine':<10} {'s/group':>9} {'hit rate':>9}")
    for label, r in results.items():
        print(f"{label:<10} {r['s_per_group']:>9.3f} {r['hit_rate']:>9.3f}")
    print(f"speedup (cache on vs off): {off['s_per_group'] / on['s_per_group']:.2f}x  (goal >= 3x)")
    print(f"hit rate: {on['hit_rate']:.4f} measured | {(g - 1) / g:.4f} = (G-1)/G | "
          f"{(g - 1) / g * (length - 1) / length:.4f} = (G-1)/G*(L-1)/L reachable")


if __name__ == "__main__":
    main()
