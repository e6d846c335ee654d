"""Profile GRPO steps end to end: every round trip to the server, the kernel's own work, the gaps.

usage: python3 tools/gpu/step_profile.py [--engine sglang|cpu|auto] [--model-path DIR] [--steps 4]
           [--groups-per-step 4] [--group-size 4] [--max-new-tokens N] [--task NAME]
           [--run-dir D] [--out JSON]

For issue 26 item 1 ("profile one step end to end and remove what is not decoding or training").
Runs one `GRPORun` on RunConfig defaults (only the flags above change them) for `--steps` steps
in one event loop and records, per step:

  requests   every HTTP request the kernel sent (method, path, what a POST /generate was: rollout,
             warm-up, score; start and end offsets, time to the response headers, body bytes
             sent and received, how many samples it asked for), from a timing transport the
             client sends through (its public seam, EngineClient.wrap_transport); the health
             watchdog's polls are recorded apart (task "watchdog"), they overlap the step
  spans      from the run's own phase clock (`run.clock`, artsg_nb/run/clock.py, its public seam)
             the step's phases as it timed them: train_step (its "train" phase), save, rewards
             (writing the rollouts), history, prune (synchronous), and rollouts, publish, version
             (save + publish + the served-adapter check), verify; and, timed by wrappers on this
             run's trainer and tokenizer objects (their public methods), trainer_score (the adapter
             check's trainer side) and tokenizer (chat template / encode / decode)
  trainer    inside train_step (issue 26: its time swung 0.03-2.08 s step to step on the H200): the
             batch (sequences x padded width, real tokens), the (rows, length) of each micro-batch
             the model saw and whether one is new to the run, seconds per 1k padded tokens,
             make_batch / backward / optimizer_step seconds, Python's garbage collections on its
             thread during it (gc.callbacks), and the change over it of the CUDA caching
             allocator's device mallocs, frees and retries and of torch.compile's graphs; the
             summary sets the steps that met a new shape beside those that did not
  stalls     event-loop stalls over 20 ms (a task sleeping 10 ms that woke late), and how much
             of them no known synchronous span explains
  update     the trainer's own split of the update's seconds (Trainer.last_update: GPU, this
             thread's CPU, gc, kernel compiles, checkpoint wait, other threads) and its reading
  phases     rollout_s, train_s, reload_s of the step's history row; verify_s (the clock's verify
             phase: the served-adapter check after the reload) and other_s (the rest of the wall time)

and splits the step's wall time into exclusive parts, each instant counted once: a rollout
/generate in flight ("decoding"), else another request in flight (by endpoint), else a
synchronous kernel span, else a kernel gap (Python, event loop, bookkeeping) named by the phase it
falls in. It prints a compact timeline and table per step and a summary over the steps after the
first (step 1 also publishes policy-step-0 and asks /server_info): round trips per step by endpoint
and their seconds, the share of the step that is server time vs kernel time, and the top 5 costs
that are neither decoding nor training. Everything goes to --out as JSON (replaced whole after
each step, so a run cut short keeps what it measured and never a half-written file).

  server     what the server's own /metrics say moved over the step (read before and after it, outside
             its wall time): per histogram (time to first token, end-to-end latency, queue time, each
             request stage of SGLang's `per_stage_req_latency_seconds`, ...) the observations and their
             mean, and the counters of forward passes by kind (CUDA graph or not, GPU busy seconds by
             forward mode), to say how much of a rollout the server spends queueing, prefilling,
             decoding or in its HTTP front end

What it does not do: trace inside the server's processes (its /metrics are the only view),
change what a step does (the wrappers only time; the run is the one a notebook runs), or profile
the vLLM dialect's routes by kind (its requests are counted by path only). A request's time
includes any moment the kernel was busy while its answer waited (the stalls say how much). The
client is instrumented at each step's start: after a server restart within a step (the row's
`restarts`) the rest of that step's requests go unseen. RunConfig.pipeline stays off (default).
Nothing of the run is patched: the step's phases come from its clock, the requests from its
client's transport seam; the wrappers sit on public methods of this run's trainer and tokenizer
only (the parts inside train_step wait for a trainer-side clock to replace them).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's artsg_nb first
from artsg_nb import GRPORun, RunConfig  # noqa: E402
from artsg_nb.files import write_atomic  # noqa: E402
from artsg_nb.run.config import resolve_schedule  # noqa: E402

ROLLOUT = "POST /generate rollout"
TRAIN = "train_step"
STALL_TICK_S, STALL_MIN_S = 0.010, 0.020
TRAINER_PARTS = ("make_batch", "backward", "optimizer_step")  # nested in train_step
CLOCK_SYNC = ("save", "rewards", "history", "prune")  # the run's clock's synchronous phases
SYNC_SPANS = ("train_step", "trainer_score", "tokenizer", *CLOCK_SYNC)
PHASES = {"publish": 3.0, "rollouts": 3.1, "version": 3.2}  # the clock's async phases, innermost first


@dataclass
class Request:
    """One HTTP request as the transport saw it (perf_counter seconds)."""

    method: str
    path: str
    t0: float
    task: str
    req_bytes: int
    body: bytes | None = None  # /generate bodies, classified after the step (then dropped)
    t_headers: float | None = None
    t1: float | None = None
    status: int | None = None
    resp_bytes: int = 0
    kind: str = ""
    samples: int = 0

    @property
    def label(self) -> str:
        return f"{self.method} {self.path}" + (f" {self.kind}" if self.kind else "")


@dataclass
class Recorder:
    """What one step did; `take()` hands it over and starts the next step's record."""

    requests: list[Request] = field(default_factory=list)
    spans: list[dict] = field(default_factory=list)
    stalls: list[tuple[float, float]] = field(default_factory=list)
    train_records: list[dict] = field(default_factory=list)  # one per train_step (instrument_trainer)
    depth: int = 0  # synchronous spans open now (a nested one is its parent's time)
    shapes_seen: set[tuple[int, int]] = field(default_factory=set)  # micro-batch (rows, length) of the run so far
    clients: set[int] = field(default_factory=set)  # the clients instrumented (id), each once
    training_thread: int | None = None  # the thread inside train_step now (gc is recorded there only)

    def take(self) -> tuple[list[Request], list[dict], list[tuple[float, float]], list[dict]]:
        out = (self.requests, self.spans, self.stalls, self.train_records)
        self.requests, self.spans, self.stalls, self.train_records = [], [], [], []
        return out


# ---- HTTP: a timing wrapper around each pool's transport ---------------------------------------
class _CountedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, req: Request):
        self.inner, self.req = inner, req

    async def __aiter__(self):
        async for chunk in self.inner:
            self.req.resp_bytes += len(chunk)
            yield chunk
        self.req.t1 = time.perf_counter()

    async def aclose(self) -> None:
        if self.req.t1 is None:
            self.req.t1 = time.perf_counter()
        await self.inner.aclose()


class TimedTransport(httpx.AsyncBaseTransport):
    """Records each request into the Recorder; the request and response pass through unchanged."""

    def __init__(self, inner: httpx.AsyncBaseTransport, rec: Recorder):
        self.inner, self.rec = inner, rec

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        task = asyncio.current_task()
        who = "watchdog" if task and "HealthWatchdog" in getattr(task.get_coro(), "__qualname__", "") else "step"
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = b""
        req = Request(request.method, request.url.path, time.perf_counter(), who, len(body),
                      body=body if request.url.path == "/generate" else None)
        self.rec.requests.append(req)
        try:
            resp = await self.inner.handle_async_request(request)
        except BaseException:
            req.t1, req.status = time.perf_counter(), -1
            raise
        req.t_headers, req.status = time.perf_counter(), resp.status_code
        resp.stream = _CountedStream(resp.stream, req)
        return resp

    async def aclose(self) -> None:
        await self.inner.aclose()


async def instrument_client(client, rec: Recorder) -> None:
    """Time every request of `client` (admin calls and SSE included) through its public seam,
    EngineClient.wrap_transport: each pool it makes from now on sends through a TimedTransport.
    Once per client: a restarted server comes with a new one."""
    if id(client) in rec.clients:
        return
    rec.clients.add(id(client))
    await client.wrap_transport(lambda inner: TimedTransport(inner, rec))


def classify(req: Request) -> None:
    """A POST /generate (SGLang's native API, also the CPU engine's) by its body: `score` (the
    served-adapter check, logprob_start_len), `warm-up` (no new tokens: the balanced n's prefill),
    else `rollout`, with the samples it asks for (n, or the batch's length)."""
    body, req.body = req.body, None
    if body is None:
        return
    try:
        payload = json.loads(body)
    except ValueError:
        return
    params = payload.get("sampling_params") or {}
    first = (params[0] if params else {}) if isinstance(params, list) else params
    ids = payload.get("input_ids") or []
    if "logprob_start_len" in payload:
        req.kind = "score"
    elif first.get("max_new_tokens") == 0:
        req.kind = "warm-up"
    else:
        req.kind = "rollout"
        req.samples = len(ids) if ids and isinstance(ids[0], list) else int(first.get("n", 1))


# ---- kernel spans: wrappers on this run's objects ----------------------------------------------
def sync_span(rec: Recorder, name: str, fn):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        rec.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            rec.depth -= 1
            rec.spans.append({"name": name, "t0": t0, "t1": time.perf_counter(), "nested": rec.depth > 0})
    return timed


@contextlib.contextmanager
def instrument_run(run: GRPORun, rec: Recorder):
    """Time this run's trainer and tokenizer by instance attributes (looked up at call time), and
    record collections on the training thread until exit."""
    trainer, tok = run.trainer, run.trainer.tokenizer  # train_step's span is the clock's "train" phase
    trainer.score_tokens = sync_span(rec, "trainer_score", trainer.score_tokens)
    instrument_trainer(trainer, rec)
    for attr in ("apply_chat_template", "encode", "decode"):
        try:  # best effort: a tokenizer class that refuses instance attributes is left untimed
            setattr(tok, attr, sync_span(rec, "tokenizer", getattr(tok, attr)))
        except (AttributeError, TypeError) as e:
            print(f"note: tokenizer.{attr} not timed ({e})", flush=True)
    on_gc = _gc_recorder(rec)
    gc.callbacks.append(on_gc)
    try:
        yield
    finally:
        gc.callbacks.remove(on_gc)


CLOCK_NAMES = {"train": TRAIN}
"""The clock's phases named as this profile names them: its "train" phase is exactly train_step."""


def clock_spans(run: GRPORun, t0: float) -> list[dict]:
    """The phases the run's clock timed since t0 (its scale is perf_counter's), as spans."""
    return [{"name": CLOCK_NAMES.get(s.name, s.name), "t0": s.t0, "t1": s.t1, "nested": False}
            for s in run.clock.since(t0)]


# ---- inside train_step ---------------------------------------------------------------------------
def one_off_counters() -> dict[str, int]:
    """Counters whose change over a train_step names a one-off cost: the CUDA caching allocator's
    device mallocs, frees and retries (a retry frees the cache and synchronises the GPU), and the
    graphs torch.compile made (a new shape can recompile). Empty where neither is in use."""
    import torch
    out: dict[str, int] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        for key, name in (("num_device_alloc", "cuda_mallocs"), ("num_device_free", "cuda_frees"),
                          ("num_alloc_retries", "alloc_retries")):
            out[name] = int(stats.get(key, 0))
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is not None:
        out["compiled_graphs"] = int(dynamo.counters["stats"]["unique_graphs"])
    return out


def _gc_recorder(rec: Recorder):
    """A gc.callbacks entry recording each collection made on the thread inside train_step while
    it runs, as a span "gc" with its generation and what it collected. Marked nested: it is the
    time of whatever it interrupted, never a part of the step of its own."""
    started: dict[int, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        if rec.training_thread != threading.get_ident():
            return
        if phase == "start":
            started[info["generation"]] = time.perf_counter()
        elif info["generation"] in started:
            rec.spans.append({"name": "gc", "t0": started.pop(info["generation"]), "t1": time.perf_counter(),
                              "nested": True, "generation": info["generation"], "collected": info["collected"]})
    return on_gc


def instrument_trainer(trainer, rec: Recorder) -> None:
    """Time train_step's parts as nested spans and keep one record per train_step (rec.train_records):
    its batch, the (rows, length) of each micro-batch the model saw (each cut to its own longest
    sequence: the shapes an allocator or a compiled graph meets), and the one-off counters'
    change over it. Instance attributes, which train_step looks up; a trainer of ranks
    (RankedTrainer, rank 0's `local` doing the work) is looked into through its local trainer."""
    worker = getattr(trainer, "local", trainer)
    for name in TRAINER_PARTS:
        setattr(worker, name, sync_span(rec, name, getattr(worker, name)))
    make_batch, micro_batches, train_step = worker.make_batch, worker.micro_batches, trainer.train_step

    def make_batch_recorded(groups):
        batch = make_batch(groups)
        rec.train_records[-1].update(sequences=int(batch.input_ids.shape[0]), width=int(batch.input_ids.shape[1]),
                                     tokens=int(batch.attention_mask.sum()))
        return batch

    def micro_batches_recorded(batch, *args, **kwargs):
        for mb in micro_batches(batch, *args, **kwargs):
            rec.train_records[-1]["shapes"].append(tuple(int(n) for n in mb.input_ids.shape))
            yield mb

    def train_step_recorded(groups):
        record = {"sequences": 0, "width": 0, "tokens": 0, "shapes": []}
        rec.train_records.append(record)
        before, rec.training_thread = one_off_counters(), threading.get_ident()
        rec.depth += 1  # its parts are nested spans
        try:
            return train_step(groups)
        finally:
            rec.depth -= 1
            rec.training_thread = None
            after = one_off_counters()
            record["counters"] = {k: after[k] - before.get(k, 0) for k in after}
            record["new_shape"] = any(shape not in rec.shapes_seen for shape in record["shapes"])
            rec.shapes_seen.update(record["shapes"])

    worker.make_batch, worker.micro_batches = make_batch_recorded, micro_batches_recorded
    trainer.train_step = train_step_recorded


def update_timing(trainer) -> dict | None:
    """Where the step's update spent its seconds, as the trainer split them (its public
    `last_update`, rl/update_timing.py: GPU, this thread's CPU, gc, compiles, checkpoint wait,
    other threads), with its one-sentence reading; None where the trainer keeps none (ranks)."""
    timing = getattr(trainer, "last_update", None)
    return None if timing is None else {**asdict(timing), "why": timing.why()}


def trainer_detail(records: list[dict], spans: list[dict]) -> dict | None:
    """The step's train_step seen from inside: its batch and micro-batch shapes, seconds per 1k
    padded tokens (rows x length summed over the micro-batches: the work, so a long batch is not
    mistaken for a slow one), its parts, the collections within it, the one-off counters."""
    outer = [s for s in spans if s["name"] == TRAIN]
    if not records or not outer:
        return None
    t0, t1 = outer[0]["t0"], outer[0]["t1"]
    inside = [s for s in spans if t0 <= s["t0"] and s["t1"] <= t1]
    collections = [s for s in inside if s["name"] == "gc"]
    padded = sum(rows * length for rows, length in records[0]["shapes"])
    return {**records[0], "train_s": t1 - t0, "padded_tokens": padded,
            "s_per_1k_padded": (t1 - t0) / padded * 1e3 if padded else None,
            **{f"{n}_s": sum(s["t1"] - s["t0"] for s in inside if s["name"] == n) for n in TRAINER_PARTS},
            "gc": {"n": len(collections), "s": sum(s["t1"] - s["t0"] for s in collections),
                   "oldest_generation": max((s["generation"] for s in collections), default=None)}}


async def watch_loop(rec: Recorder) -> None:
    """Record event-loop stalls: a 10 ms sleep that ends more than STALL_MIN_S late."""
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(STALL_TICK_S)
        late = time.perf_counter() - t0 - STALL_TICK_S
        if late > STALL_MIN_S:
            rec.stalls.append((t0 + STALL_TICK_S, t0 + STALL_TICK_S + late))


# ---- analysis ------------------------------------------------------------------------------------
def covered_s(intervals, within=None) -> float:
    """Length of the union of (t0, t1) intervals, clipped to `within` when given."""
    lo, hi = within or (float("-inf"), float("inf"))
    total, end = 0.0, float("-inf")
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if a > end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def exclusive_parts(t0: float, t1: float, reqs: list[Request], spans: list[dict]) -> dict[str, float]:
    """The step's wall time split so each instant counts once (module docstring for the order)."""
    items = [(r.t0, r.t1, 0 if r.kind == "rollout" else 1, "server: " + r.label) for r in reqs]
    items += [(s["t0"], s["t1"], 2, ("train: " if s["name"] == TRAIN else "kernel: ") + s["name"])
              for s in spans if s["name"] in SYNC_SPANS and not s["nested"]]
    items += [(s["t0"], s["t1"], PHASES[s["name"]], f"kernel gaps in {s['name']}")
              for s in spans if s["name"] in PHASES]
    cuts = sorted({t0, t1, *(x for a, b, *_ in items for x in (a, b) if t0 < x < t1)})
    parts: dict[str, float] = defaultdict(float)
    for a, b in zip(cuts, cuts[1:]):
        live = [(prio, start, label) for start, end, prio, label in items if start <= a and end >= b]
        parts[min(live)[2] if live else "kernel gaps elsewhere (step bookkeeping)"] += b - a
    return dict(parts)


def collapsed_timeline(t0: float, reqs: list[Request], spans: list[dict]) -> list[dict]:
    """Requests and top-level synchronous spans in start order, runs of one label merged, each
    with the kernel-only gap before it (nothing of the step in flight)."""
    items = sorted([(r.t0, r.t1, r.label) for r in reqs] +
                   [(s["t0"], s["t1"], s["name"]) for s in spans if s["name"] in SYNC_SPANS and not s["nested"]])
    out, end = [], t0
    for a, b, label in items:
        gap = max(0.0, a - end)
        if out and out[-1]["what"] == label and gap < 1e-3:
            out[-1].update(n=out[-1]["n"] + 1, end_s=round(max(b - t0, out[-1]["end_s"]), 4))
        else:
            out.append({"what": label, "n": 1, "start_s": round(a - t0, 4), "end_s": round(b - t0, 4),
                        "gap_before_s": round(gap, 4)})
        end = max(end, b)
    return out


def analyse_step(step_no: int, t0: float, t1: float, row: dict, reqs, spans, stalls, train_records=()) -> dict:
    for r in reqs:
        classify(r)
        r.t1 = r.t1 if r.t1 is not None else t1
    mine = [r for r in reqs if r.task == "step"]
    wall = t1 - t0
    server = covered_s([(r.t0, r.t1) for r in mine], (t0, t1))
    endpoints: dict[str, dict] = {}
    for r in mine:
        e = endpoints.setdefault(r.label, {"n": 0, "s": 0.0, "req_bytes": 0, "resp_bytes": 0, "samples": 0})
        for key, value in (("n", 1), ("s", r.t1 - r.t0), ("req_bytes", r.req_bytes), ("resp_bytes", r.resp_bytes),
                           ("samples", r.samples)):
            e[key] += value
    sync = [(s["t0"], s["t1"]) for s in spans if s["name"] in SYNC_SPANS and not s["nested"]]
    stall_s = covered_s(stalls, (t0, t1))
    unexplained = stall_s - covered_s([(max(a, c), min(b, d)) for a, b in stalls for c, d in sync])
    verify = [s["t1"] - s["t0"] for s in spans if s["name"] == "verify"]
    phases = {k: row.get(k) for k in ("rollout_s", "train_s", "reload_s")}
    phases["verify_s"] = sum(verify) if verify else None
    phases["other_s"] = wall - sum(v or 0.0 for v in phases.values())
    return {
        "step": step_no, "wall_s": wall, "phases": phases, "server_s": server, "kernel_s": wall - server,
        "server_share": server / wall if wall else None, "endpoints": endpoints,
        "parts": exclusive_parts(t0, t1, mine, spans),
        "stalls": {"n": len(stalls), "s": stall_s, "unexplained_s": max(0.0, unexplained),
                   "max_s": max((b - a for a, b in stalls), default=0.0)},
        "watchdog_requests": sum(r.task == "watchdog" for r in reqs),
        "row": {k: row.get(k) for k in ("reward_mean", "update_skipped", "samples", "groups", "hit_rate",
                                          "completion_tokens", "restarts", "probe_mad")},
        "timeline": collapsed_timeline(t0, mine, spans),
        "trainer": trainer_detail(list(train_records), spans),
        "requests": [{"what": r.label, "task": r.task, "start_s": r.t0 - t0, "end_s": r.t1 - t0,
                      "headers_s": None if r.t_headers is None else r.t_headers - t0, "status": r.status,
                      "req_bytes": r.req_bytes, "resp_bytes": r.resp_bytes, "samples": r.samples} for r in reqs],
        "spans": [{**s, "t0": s["t0"] - t0, "t1": s["t1"] - t0} for s in spans],
    }


def summarise(steps: list[dict]) -> dict:
    """Means per step over the steps after the first (all steps when there is only one)."""
    steady = steps[1:] or steps
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0  # noqa: E731
    labels = sorted({k for s in steady for k in s["endpoints"]})
    per_ep = {k: {"n": mean([s["endpoints"].get(k, {}).get("n", 0) for s in steady]),
                  "s": mean([s["endpoints"].get(k, {}).get("s", 0.0) for s in steady])} for k in labels}
    parts = {k: mean([s["parts"].get(k, 0.0) for s in steady]) for k in {k for s in steady for k in s["parts"]}}
    work = ("server: " + ROLLOUT, "train: " + TRAIN)  # decoding and training; everything else is a cost
    costs = sorted(((v, k) for k, v in parts.items() if k not in work), reverse=True)
    wall = mean([s["wall_s"] for s in steady])
    return {"steps": [s["step"] for s in steady], "wall_s": wall, "server_s": mean([s["server_s"] for s in steady]),
            "kernel_s": mean([s["kernel_s"] for s in steady]),
            "decoding_s": parts.get("server: " + ROLLOUT, 0.0), "training_s": parts.get("train: " + TRAIN, 0.0),
            "round_trips": sum(v["n"] for v in per_ep.values()), "endpoints": per_ep, "parts": parts,
            "top_non_decoding": [{"what": k, "s": v, "share": v / wall if wall else None} for v, k in costs[:5]],
            "unexplained_stall_s": mean([s["stalls"]["unexplained_s"] for s in steady]),
            "server": server_means(steady),
            "training": training_summary(steady)}


def training_summary(steps: list[dict]) -> dict | None:
    """train_step per step with its shapes, and the steps that met a micro-batch shape new to the run
    beside those that met only shapes seen before, in seconds and in seconds per 1k padded tokens:
    a cost paid once per new shape (allocation, a recompile) shows as a gap in both; a batch that is
    merely longer shows in seconds only (issue 26's swings)."""
    rows = [s["trainer"] for s in steps if s.get("trainer")]
    if not rows:
        return None
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    counters: Counter[str] = Counter()
    for r in rows:
        counters.update(r.get("counters", {}))
    split = {}
    for label, new in (("new_shape", True), ("seen_shapes", False)):
        mine = [r for r in rows if r["new_shape"] is new]
        split[f"{label}_mean_s"] = mean([r["train_s"] for r in mine])
        split[f"{label}_s_per_1k_padded"] = mean([r["s_per_1k_padded"] for r in mine if r["s_per_1k_padded"]])
    return {"per_step": [{k: r[k] for k in ("train_s", "sequences", "width", "tokens", "shapes", "new_shape",
                                            "s_per_1k_padded")} for r in rows],
            **split, "gc_s": sum(r["gc"]["s"] for r in rows), "counters": dict(counters)}


# ---- the server's own view ---------------------------------------------------------------------------
SERVER_COUNTERS = ("forward_execution_seconds", "cuda_graph_passes", "num_requests", "generation_tokens",
                   "prompt_tokens", "cached_tokens")
"""Counters read besides every histogram (names as prometheus_client gives a counter family: no _total)."""


def server_series(text: str) -> dict[str, float]:
    """Histogram sums/counts and the SERVER_COUNTERS of a /metrics text, keyed "name{labels}:sum|count|total"
    (the labels that vary: stage, mode, category; the model name is left out)."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        short = fam.name.split(":", 1)[-1]
        for smp in fam.samples:
            kind = smp.name.rsplit("_", 1)[-1]  # sum, count, bucket; total for a counter
            wanted = kind in ("sum", "count") if fam.type == "histogram" else (
                fam.type == "counter" and short in SERVER_COUNTERS and kind == "total")
            if wanted:
                labels = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()) if k in ("stage", "mode", "category"))
                key = f"{short}{{{labels}}}:{kind}" if labels else f"{short}:{kind}"
                out[key] = out.get(key, 0.0) + smp.value
    return out


def server_delta(before: str, after: str) -> dict[str, dict]:
    """What moved between two /metrics texts: per histogram its observations, their sum and mean;
    per counter its increase."""
    a, b = server_series(before), server_series(after)
    moved: dict[str, dict] = {}
    for key, value in b.items():
        name, kind = key.rsplit(":", 1)
        d = value - a.get(key, 0.0)
        if d:
            moved.setdefault(name, {})["n" if kind == "count" else "s" if kind == "sum" else "total"] = d
    for v in moved.values():
        if v.get("n"):
            v["mean_s"] = v.get("s", 0.0) / v["n"]
    return dict(sorted(moved.items()))


def server_means(steps: list[dict]) -> dict[str, dict]:
    """Per step, the mean of each server series that moved (server_delta), over `steps`."""
    keys = sorted({k for s in steps for k in s.get("server", {})})
    out = {}
    for k in keys:
        rows = [s.get("server", {}).get(k, {}) for s in steps]
        out[k] = {f: statistics.fmean(r.get(f, 0.0) for r in rows) for f in ("n", "s", "total") if any(f in r for r in rows)}
        if out[k].get("n"):
            out[k]["mean_s"] = out[k].get("s", 0.0) / out[k]["n"]
    return out


def print_server(delta: dict[str, dict]) -> None:
    if not delta:
        return
    print(f"  {'server /metrics over the step':<60} {'n':>6} {'sum s':>8} {'mean ms':>8}")
    for k, v in delta.items():
        if "n" in v:
            print(f"  {k[:60]:<60} {v['n']:6.0f} {v.get('s', 0.0):8.3f} {1e3 * v.get('mean_s', 0.0):8.2f}")
        else:
            print(f"  {k[:60]:<60} {v['total']:>6.3g}")


# ---- printing ------------------------------------------------------------------------------------
def print_step(s: dict) -> None:
    p = s["phases"]
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"\nstep {s['step']} | wall {s['wall_s']:.3f} s | rollout {f(p['rollout_s'])} train {f(p['train_s'])} "
          f"reload {f(p['reload_s'])} verify {f(p['verify_s'])} other {f(p['other_s'])} | server {s['server_s']:.3f} s "
          f"({100 * (s['server_share'] or 0):.0f} %), kernel {s['kernel_s']:.3f} s | stalls {s['stalls']['n']} "
          f"({s['stalls']['unexplained_s']:.3f} s unexplained)")
    print(f"  {'start s':>8} {'end s':>7} {'gap s':>6}  n  what")
    for t in s["timeline"]:
        print(f"  {t['start_s']:8.3f} {t['end_s']:7.3f} {t['gap_before_s']:6.3f} {t['n']:>2}  {t['what']}")
    if s.get("trainer"):
        print("  " + trainer_line(s["trainer"]))
    if s.get("update_timing"):
        print(f"  update split (Trainer.last_update): {s['update_timing']['why']}")
    print(f"  {'endpoint':<34} {'n':>3} {'total s':>8} {'mean ms':>8} {'KiB out':>8} {'KiB in':>8}")
    for k, e in sorted(s["endpoints"].items(), key=lambda kv: -kv[1]["s"]):
        print(f"  {k:<34} {e['n']:>3} {e['s']:8.3f} {1e3 * e['s'] / e['n']:8.1f} {e['req_bytes'] / 1024:8.1f} "
              f"{e['resp_bytes'] / 1024:8.1f}")


def counters_text(counters: dict[str, int]) -> str:
    """The one-off counters that moved, as "name +n", or that none did."""
    return ", ".join(f"{k} +{v}" for k, v in counters.items() if v) or "no allocator/compile events"


def trainer_line(t: dict) -> str:
    counters = counters_text(t.get("counters", {}))
    gc_part = (f"gc {t['gc']['n']}x {t['gc']['s']:.3f} s (oldest gen {t['gc']['oldest_generation']})"
               if t["gc"]["n"] else "no gc")
    shapes = " ".join(f"{r}x{n}" for r, n in t["shapes"])
    per_1k = "-" if t["s_per_1k_padded"] is None else f"{t['s_per_1k_padded']:.4f}"
    return (f"train_step {t['train_s']:.3f} s: {t['sequences']} x {t['width']} ({t['tokens']} tokens), micro-batches "
            f"{shapes or '-'} ({'a shape new to the run' if t['new_shape'] else 'shapes seen before'}), "
            f"{per_1k} s per 1k padded | make_batch {t['make_batch_s']:.3f} backward {t['backward_s']:.3f} "
            f"optimizer {t['optimizer_step_s']:.3f} | {gc_part} | {counters}")


def print_summary(sm: dict) -> None:
    w = sm["wall_s"] or 1.0
    print(f"\nsummary over steps {sm['steps']} (means per step): wall {sm['wall_s']:.3f} s, "
          f"server {sm['server_s']:.3f} s ({100 * sm['server_s'] / w:.0f} %), "
          f"kernel {sm['kernel_s']:.3f} s ({100 * sm['kernel_s'] / w:.0f} %); "
          f"decoding {sm['decoding_s']:.3f} s, training {sm['training_s']:.3f} s, {sm['round_trips']:.1f} round trips")
    print(f"  {'round trips by endpoint':<34} {'n/step':>7} {'s/step':>8}")
    for k, e in sorted(sm["endpoints"].items(), key=lambda kv: -kv[1]["s"]):
        print(f"  {k:<34} {e['n']:7.1f} {e['s']:8.3f}")
    print(f"  {'wall time, each instant once':<44} {'s/step':>8} {'share':>6}")
    for k, v in sorted(sm["parts"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:<44} {v:8.3f} {100 * v / w:5.1f}%")
    print("  top 5 costs that are neither decoding nor training:")
    for i, c in enumerate(sm["top_non_decoding"], 1):
        print(f"    {i}. {c['what']}: {c['s']:.3f} s/step ({100 * (c['share'] or 0):.1f} %)")
    print_server(sm.get("server") or {})
    tr = sm.get("training")
    if tr:
        f = lambda v, unit="s": "-" if v is None else f"{v:.4f} {unit}"  # noqa: E731
        steps = ", ".join(f"{r['train_s']:.3f}{'*' if r['new_shape'] else ''}" for r in tr["per_step"])
        print(f"  training per step (* = met a micro-batch shape new to the run): {steps}")
        print(f"  training mean: new shape {f(tr['new_shape_mean_s'])} ({f(tr['new_shape_s_per_1k_padded'], 's/1k')}), "
              f"shapes seen before {f(tr['seen_shapes_mean_s'])} ({f(tr['seen_shapes_s_per_1k_padded'], 's/1k')}); "
              f"gc inside train_step {tr['gc_s']:.3f} s; {counters_text(tr['counters'])}")


# ---- the run -------------------------------------------------------------------------------------
async def profile(cfg: RunConfig, steps: int, out: Path | None) -> dict:
    rec = Recorder()
    run = GRPORun(cfg).start()
    record = {"config": {k: getattr(cfg, k) for k in ("engine", "model_path", "groups_per_step", "group_size",
                                                      "max_new_tokens", "schedule", "run_dir")},
              "steps": []}
    monitor = asyncio.create_task(watch_loop(rec))

    def save() -> None:
        if out:
            write_atomic(out, json.dumps(record, indent=1, default=str))
    try:
        record["schedule"] = resolve_schedule(cfg.schedule, run.task.max_turns)
        record["max_turns"] = run.task.max_turns
        with instrument_run(run, rec):
            for n in range(1, steps + 1):
                await instrument_client(run.client, rec)  # a restarted server comes with a new client
                before = await server_text(run)
                rec.take()
                t0 = time.perf_counter()
                row = await run.step()
                t1 = time.perf_counter()
                requests, spans, stalls, train_records = rec.take()
                s = analyse_step(n, t0, t1, row, requests, spans + clock_spans(run, t0), stalls, train_records)
                s["server"] = server_delta(before, await server_text(run))  # its request is dropped by take()
                s["update_timing"] = update_timing(run.trainer)
                print_step(s)
                print_server(s["server"])
                record["steps"].append(s)
                record["summary"] = summarise(record["steps"])
                save()
        problem = getattr(run.client, "native_n_problem", None)
        record["balanced_n"] = bool(problem and await problem())  # asked once already: no request
    finally:
        monitor.cancel()
        run.stop()
    print_summary(record["summary"])
    save()
    if out:
        print(f"\nwritten: {out}")
    return record


async def server_text(run) -> str:
    """The server's /metrics ("" when it has none, or they cannot be read)."""
    try:
        return await run.client.metrics_text()
    except Exception as e:  # noqa: BLE001 — a profile goes on without the server's view
        print(f"  (no server /metrics: {e})")
        return ""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="auto", help="auto (SGLang with a GPU, else the CPU engine), sglang, cpu, vllm")
    p.add_argument("--model-path", default=None, help="default: the shipped tiny model")
    p.add_argument("--task", default="addition", help="a registered task or module:ATTR")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's own limit")
    p.add_argument("--run-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--out", default=None, help="the JSON record")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="step-profile-"))
    if (run_dir / "history.jsonl").exists():
        print(f"error: {run_dir} holds a run already (history.jsonl); give a new --run-dir or remove it",
              file=sys.stderr)
        return 2
    cfg = RunConfig(task=a.task, engine=a.engine, model_path=a.model_path, run_dir=str(run_dir),
                    groups_per_step=a.groups_per_step, group_size=a.group_size, max_new_tokens=a.max_new_tokens)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # validate.sh's timeout: stop the server first
    print(f"step profile: {a.steps} steps of {a.groups_per_step} x {a.group_size}, engine {a.engine}, "
          f"run dir {run_dir}", flush=True)
    asyncio.run(profile(cfg, a.steps, Path(a.out) if a.out else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
