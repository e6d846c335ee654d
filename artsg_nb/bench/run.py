"""The benchmark driver: servers, runs, and the measurements each run row holds.

What it does: for each engine setting (radix cache on/off) it starts the server (server.py; or
uses `server_url`), then for each submission schedule (rollout.SCHEDULES) plays P prompts x
G samples x T turns of synthetic text (bench.workloads.SyntheticTask, fixed output length via
ignore_eos) through the toolkit's own `collect_groups`, and measures:
  wall time, output and total tokens/s, TTFT p50/p95 (streamed first token), end-to-end
  latency p50/p95, the hit rate from the server's counters (metrics.cache_counters before and
  after) and from per-request cached tokens, the theoretical maximum hit rate
  (metrics.theoretical_hit_rate), and the adapter reload latency (PEFT save + load_adapter +
  the first request the new adapter serves).
With raw mode on, the same token payloads are replayed with plain httpx (bench.raw) so the
toolkit's throughput can be given as a fraction of the raw engine's (goal >= 0.95). The cache is
flushed between runs and each run uses fresh prompts. `bench_engines` runs it once per engine,
`engine_availability` says which engines this machine can run.

What it does not do: the result files and tables (bench.results), plots (plots.py), or the CLI
(bench.__main__).
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import pandas as pd
import pynvml
import torch
import tyro

from ..engines import SamplingParams, make_client, run_sync
from ..serving.metrics import cache_counters, hit_rate, theoretical_hit_rate
from ..rollout.groups import SCHEDULES, collect_groups
from ..rollout.trajectory import rollout_stats
from ..serving.server import TARGET_MODULES, ServerConfig, start_server
from ..serving.server_env import ServerEnvNotFoundError, find_server_env
from ..models.tiny import default_model_dir
from .raw import RAW_SCHEDULES, raw_plans, replay_raw
from .results import COLUMNS, results_frame, save_results
from .workloads import SyntheticTask

log = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    """One benchmark invocation (the CLI flags, one field each)."""

    engine: Literal["cpu", "sglang", "vllm"] = "cpu"
    """The engine to start (or that answers at server_url)."""
    model_path: str | None = None
    """Model directory; None: the tiny model (cpu) or its 0.5B-shaped sibling (GPU engines)."""
    groups: int = 8
    """P: prompts (GRPO groups) per run."""
    group_size: int = 8
    """G: samples per prompt."""
    prompt_tokens: int = 1500
    """Turn-1 prompt length, chat template included (approximate: text is re-tokenised)."""
    new_tokens: int = 128
    """Tokens generated per model turn (fixed: ignore_eos)."""
    turns: int = 1
    """T: model turns per episode."""
    env_tokens: int = 32
    """Length of each env message between turns."""
    schedules: tuple[str, ...] = ("naive", "prefix")
    """Submission schedules to compare (rollout.SCHEDULES)."""
    radix: tuple[bool, ...] = (True,)
    """Prefix cache settings to start the server with (one server per setting)."""
    raw: bool = True
    """Also replay each run with plain httpx (schedules in bench.raw.RAW_SCHEDULES)."""
    stream_all: bool = True
    """Stream every request so each has a TTFT (else only the schedule's leaders stream)."""
    reload: bool = True
    """Measure adapter save + load + first request."""
    reload_repeats: int = 3
    """Adapter versions loaded for the reload figure (medians are reported)."""
    repeats: int = 1
    """Runs of each schedule."""
    warmup: int = 1
    """Unrecorded runs before measuring (first-request and compilation costs)."""
    temperature: float = 1.0
    """Sampling temperature."""
    concurrency: int | None = None
    """Requests in flight; None: all of them (P x G)."""
    server_url: str | None = None
    """Use this running server instead of starting one (radix then only labels the rows)."""
    run_dir: str = "runs/bench"
    """Server logs and the adapters saved for the reload figure."""
    extra_args: tuple[str, ...] = ()
    """Extra server command-line arguments (e.g. the GPU bundle's --attention-backend triton);
    empty takes $ARTSG_SGLANG_ARGS / $ARTSG_VLLM_ARGS, as every start_server does (server.with_env_args)."""
    out: str | None = None
    """CSV path; None: runs/bench/<date>-<engine>-<hardware>.csv (results.BENCH_RUNS)."""
    flags: tyro.conf.Suppress[str] = ""
    """The command line, recorded in each row (set by the CLI)."""
    workload: str | None = None
    """A short label for the workload's shape (e.g. "A"), recorded in each row; the notebook
    shows it before the shape (bench.results.label_workloads)."""
    seed: int = 0
    """Base seed of the synthetic prompts."""


# ---------------------------------------------------------------------------- environment facts

def hardware_name(engine: str) -> str:
    """GPU name and count from NVML, or "cpu" (also for the CPU engine on a GPU host)."""
    if engine == "cpu":
        return f"cpu x{os.cpu_count()}"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return f"{name.decode() if isinstance(name, bytes) else name} x{count}"
    except Exception:  # no driver, no library: not a GPU host
        return "cpu"


async def engine_version(client) -> str:
    """Version reported by the server (/server_info "version", vLLM /version)."""
    for path in ("/server_info", "/get_server_info", "/version"):
        try:
            resp = await client._client().get(path, timeout=10.0)
            if resp.status_code == 200 and (version := resp.json().get("version")):
                return str(version)
        except Exception:  # an engine without that route: try the next
            continue
    return "unknown"  # vLLM's dev-mode /server_info has no "version": its /version answers


def default_model(engine: str) -> str:
    """The tiny model (CPU engine) or its 0.5B-shaped sibling (GPU engines)."""

    return str(default_model_dir("tiny" if engine == "cpu" else "0.5b"))


# ---------------------------------------------------------------------------- measurements

def _pct(values: Sequence[float], q: float) -> float:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else float("nan")


def _timing_row(wall_s: float, samples: Sequence, prompt_tokens: Sequence[int]) -> dict:
    out = sum(len(s.output_ids) for s in samples)
    prompt = sum(s.prompt_tokens for s in samples)
    cached = sum(s.cached_tokens for s in samples)
    return {"samples": len(samples), "wall_s": wall_s, "out_tok_s": out / wall_s,
            "total_tok_s": (out + prompt) / wall_s,
            "mean_prompt_tokens": float(np.mean(prompt_tokens)) if prompt_tokens else float("nan"),
            "ttft_p50_s": _pct([s.ttft_s for s in samples], 50), "ttft_p95_s": _pct([s.ttft_s for s in samples], 95),
            "e2e_p50_s": _pct([s.e2e_s for s in samples], 50), "e2e_p95_s": _pct([s.e2e_s for s in samples], 95),
            "hit_rate_requests": cached / prompt if prompt else float("nan")}


async def _counters(client, engine: str):
    return cache_counters(await client.metrics_text(), engine)


async def _flush(client) -> bool:
    try:
        await client.flush_cache()
        return True
    except Exception as e:  # noqa: BLE001 - a server without a flush route still benchmarks
        log.warning("could not flush the prefix cache (%s); runs use fresh prompts anyway", e)
        return False


def _params(cfg: BenchConfig) -> SamplingParams:
    return SamplingParams(max_new_tokens=cfg.new_tokens, temperature=cfg.temperature, ignore_eos=True)


async def _noop_hook() -> None:
    return None


class RecordingClient:
    """Forwards `generate` to `client` and records every Generation (TTFT, e2e, tokens).

    With `stream_all`, requests the schedule did not stream are streamed with a no-op hook, so
    every request has a TTFT (at the price of the streaming work in client and server).
    """

    def __init__(self, client, stream_all: bool = True):
        self.client, self.stream_all, self.records, self.calls = client, stream_all, [], 0

    async def generate(self, input_ids, params, adapter=None, on_first_token=None):
        self.calls += 1
        hook = on_first_token or (_noop_hook if self.stream_all else None)
        gens = await self.client.generate(input_ids, params, adapter=adapter, on_first_token=hook)
        self.records.extend(gens)
        return gens


async def run_toolkit(client, cfg: BenchConfig, task: SyntheticTask, tokenizer, schedule: str,
                      seeds: list[int]):
    """One rollout through collect_groups; (row, groups)."""
    for seed in seeds:  # build the synthetic texts before the clock starts
        for turn in range(cfg.turns):
            task.text(seed, turn)
    rec = RecordingClient(client, cfg.stream_all)
    before = await _counters(client, cfg.engine)
    t0 = time.perf_counter()
    groups = await collect_groups(rec, task, tokenizer, seeds, cfg.group_size, _params(cfg),
                                  concurrency=cfg.concurrency or len(seeds) * cfg.group_size,
                                  schedule=schedule, max_seq_tokens=1 << 30)
    wall = time.perf_counter() - t0
    after = await _counters(client, cfg.engine)
    stats = rollout_stats(groups)
    row = _timing_row(wall, rec.records, [t.prompt_len for g in groups for t in g.trajectories])
    row.update(mode="toolkit", requests=rec.calls, failed=stats["failed"], hit_rate_server=hit_rate(before, after))
    return row, groups


async def run_raw(client, cfg: BenchConfig, groups, schedule: str) -> dict:
    """Replay a toolkit run's token payloads with plain httpx under the same schedule."""
    plans = raw_plans(groups)
    before = await _counters(client, cfg.engine)
    wall, samples = await replay_raw(cfg.engine, client.base_url, client.served_model, plans,
                                     _params(cfg), schedule, cfg.stream_all, headers=client.auth_headers)
    after = await _counters(client, cfg.engine)
    row = _timing_row(wall, samples, [len(p.prompt) for members in plans for p in members])
    requests = sum(1 + len(p.env_segments) for members in plans for p in members)
    if schedule == "n":
        requests -= sum(len(members) - 1 for members in plans)
    row.update(mode="raw", requests=requests, failed=0, hit_rate_server=hit_rate(before, after))
    return row


async def measure_reload(client, model_path: str, run_dir: str, prompt_ids: list[int],
                         repeats: int = 3, rank: int = 16) -> dict:
    """Median seconds to save a PEFT adapter, load it into the server, and serve it a request."""
    # Imported here: importing artsg_nb.bench must not import transformers or PEFT before a
    # trainer imports Unsloth (bench.step's artsg_nb leg).
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                             target_modules=list(TARGET_MODULES)))
    tag, parts, previous = f"bench-{os.getpid()}-{int(time.time())}", [], None
    for i in range(repeats):
        name, path = f"{tag}-{i}", Path(run_dir).resolve() / "bench-adapters" / f"{tag}-{i}"
        t0 = time.perf_counter()
        model.save_pretrained(str(path))
        save_s = time.perf_counter() - t0
        load_s = await client.load_adapter(name, str(path))
        t0 = time.perf_counter()
        await client.generate(prompt_ids, SamplingParams(max_new_tokens=1), adapter=name)
        parts.append((save_s, load_s, time.perf_counter() - t0))
        if previous:
            await client.unload_adapter(previous)
        previous = name
    await client.unload_adapter(previous)
    save, load, first = (statistics.median(p[k] for p in parts) for k in range(3))
    return {"reload_save_s": save, "reload_load_s": load, "reload_first_s": first,
            "reload_s": save + load + first}


# ---------------------------------------------------------------------------- driver

async def bench_server(client, cfg: BenchConfig, radix: bool, model_path: str) -> list[dict]:
    """Every schedule (and raw replay) against one running server; one row per run."""
    from transformers import AutoTokenizer  # lazy, as in measure_reload

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    task = SyntheticTask(tokenizer, cfg.prompt_tokens, cfg.turns, cfg.env_tokens, cfg.new_tokens)
    meta = {"date": datetime.now().isoformat(timespec="seconds"), "hardware": hardware_name(cfg.engine),
            "engine": cfg.engine, "engine_version": await engine_version(client), "model": model_path,
            "radix": "on" if radix else "off", "groups": cfg.groups, "group_size": cfg.group_size,
            "turns": cfg.turns, "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens,
            "stream_all": cfg.stream_all, "flags": cfg.flags, "workload": cfg.workload}
    fresh = iter(range(cfg.seed * 1_000_000, (cfg.seed + 1) * 1_000_000, cfg.groups))  # new prompts per run
    for _ in range(cfg.warmup):
        await _flush(client)
        await run_toolkit(client, cfg, task, tokenizer, cfg.schedules[0], _seeds(next(fresh), cfg.groups))
    reload = {}
    if cfg.reload:
        prompt = tokenizer.encode(task.text(-1, 0), add_special_tokens=False)
        try:
            reload = await measure_reload(client, model_path, cfg.run_dir, prompt, cfg.reload_repeats)
        except Exception as e:  # noqa: BLE001 - a server without LoRA still benchmarks the rest
            log.warning("adapter reload not measured: %s", e)
    rows = []
    for repeat in range(cfg.repeats):
        for schedule in cfg.schedules:
            flushed = await _flush(client)
            row, groups = await run_toolkit(client, cfg, task, tokenizer, schedule, _seeds(next(fresh), cfg.groups))
            theory = theoretical_hit_rate(groups)
            rows.append({**meta, **reload, **row, "schedule": schedule, "repeat": repeat,
                         "flushed": flushed, "hit_rate_theoretical": theory})
            if cfg.raw and schedule in RAW_SCHEDULES:
                flushed = await _flush(client)
                raw = await run_raw(client, cfg, groups, schedule)
                rows.append({**meta, **reload, **raw, "schedule": schedule, "repeat": repeat,
                             "flushed": flushed, "hit_rate_theoretical": theory})
            log.info("%s %s: %.2f s", cfg.engine, schedule, row["wall_s"])
    return rows


def _seeds(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def run_bench(cfg: BenchConfig) -> pd.DataFrame:
    """Start the server per radix setting (or use cfg.server_url), run every schedule, save CSV."""

    bad = [s for s in cfg.schedules if s not in SCHEDULES]
    if bad:
        raise ValueError(f"unknown schedule(s) {bad}; choose from {', '.join(SCHEDULES)}")
    model = cfg.model_path or default_model(cfg.engine)
    rows = []
    for radix in cfg.radix:
        if cfg.server_url:
            client = make_client(cfg.engine, cfg.server_url, model)
            rows += run_sync(_with_client(client, cfg, radix, model))
            continue
        server_cfg = ServerConfig(engine=cfg.engine, model_path=model, run_dir=cfg.run_dir,
                                  disable_radix_cache=not radix, extra_args=cfg.extra_args)
        with start_server(server_cfg) as server:
            rows += run_sync(_with_client(server.client(), cfg, radix, model))
    df = results_frame(rows)
    log.info("wrote %s", save_results(df, cfg.out, cfg.engine))
    return df


async def _with_client(client, cfg: BenchConfig, radix: bool, model: str) -> list[dict]:
    try:
        return await bench_server(client, cfg, radix, model)
    finally:
        await client.aclose()


# ---------------------------------------------------------------------------- per engine

def engine_availability(plan) -> pd.DataFrame:
    """Which engines can run here: the CPU engine without a GPU; SGLang and vLLM with one, when
    their server environment is found (envs.find_server_env). One row per engine considered."""

    rows = []
    for engine in (["cpu"] if plan.mode == "cpu" else ["sglang", "vllm"]):
        try:
            env = find_server_env(engine)
            rows.append({"engine": engine, "available": True, "version": env.version, "where": env.source or env.python})
        except ServerEnvNotFoundError as e:
            rows.append({"engine": engine, "available": False, "version": None, "where": str(e).splitlines()[0]})
    return pd.DataFrame(rows, columns=["engine", "available", "version", "where"])


def bench_engines(cfg: BenchConfig, engines: Sequence[str]) -> pd.DataFrame:
    """run_bench(cfg) once per engine; each CSV goes to `<cfg.run_dir>/bench-<engine>.csv`.

    Server flags: cfg.extra_args, else $ARTSG_SGLANG_ARGS / $ARTSG_VLLM_ARGS (envs.server_args)."""
    frames = [pd.DataFrame(columns=COLUMNS)]  # no engine: an empty table, not an error
    for engine in engines:
        out = Path(cfg.run_dir) / f"bench-{engine}.csv"
        frames.append(run_bench(replace(cfg, engine=engine, out=str(out))))
    return pd.concat(frames, ignore_index=True)
