"""The CPU engine's scheduler thread: request queue, continuous batching, radix prefix reuse.

Design: one thread owns the model, every KV tensor and the radix cache; nothing else touches
them, so two forward passes never run at once. HTTP handlers put `Request`s and `Command`s on a
queue and are called back (`Request.on_event` of request.py, `Command.future`). Each round of the loop:

1. pull new requests and commands from the inbox;
2. run the commands whose condition holds (flush, adapter load, adapter unload once no queued
   or running request uses that adapter);
3. admit waiting requests first-come first-served into the running batch, within
   --max-running-requests, a budget of computed prefill tokens (--max-prefill-tokens) and
   --max-loras-per-batch distinct adapters (the base model counts as one, as on SGLang);
4. prefill each admitted request on its own: take the longest cached prefix of its prompt in
   its adapter's namespace, run the model over the uncached rest only, up to the last prompt
   token, and insert that KV into the tree. Requests admitted together are prefilled in order,
   so the G samples of a group (n=G, or G concurrent requests) find the first one's prompt KV
   and need no forward pass of their own. Like SGLang, at most len(prompt)-1 tokens are
   reused: the last prompt token is always computed, here by the next decode step;
5. one batched decode step for all running requests (batch.py): each row feeds its
   next token (the last prompt token, then its last output) and samples one. Rows may use
   different adapters (PEFT mixed-adapter batch) and have different lengths (KV left-padded,
   masked, explicit positions);
6. finished requests insert prompt+output KV into the tree (the next turn of a conversation
   hits), release their cache lock and call back.

What it deliberately does not do: chunked prefill, preemption/retraction, paged KV, overlap
scheduling, speculative decoding, priorities. One prefill at a time, not batched: on CPU a
prefill is compute-bound, so batching prefills buys little, while prefilling in order is what
lets a group's samples share one prompt's KV.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .batch import DecodeBatch, LayerKV, stack_kv
from .metrics import EngineMetrics
from .model import ModelRunner
from .radix_cache import RadixCache
from .request import Request
from .sampling import sample_tokens

log = logging.getLogger(__name__)

STOP_WINDOW_TOKENS = 32  # stop strings are searched in the decoded last tokens only


@dataclass(eq=False)
class Command:
    """Work for the scheduler thread between rounds; `future` gets run()'s result or error."""

    run: Callable[[], Any]
    ready: Callable[[], bool] = lambda: True
    future: Future = field(default_factory=Future)


@dataclass
class SchedulerConfig:
    """Limits of the scheduler (the CLI flags of the same names)."""

    max_running_requests: int = 64
    """Requests decoded together at most."""
    max_prefill_tokens: int = 16384
    """Prompt tokens computed per round (cache hits do not count; one request always fits)."""
    max_loras_per_batch: int = 8
    """Distinct adapters in the running batch, the base model included (SGLang's meaning)."""
    cache_budget_tokens: int = 65536
    """Tokens the radix cache may hold; least recently used unpinned leaves go first."""
    disable_radix_cache: bool = False
    """Prefill every prompt in full and cache nothing."""
    random_seed: int | None = None
    """Seed of the shared sampling generator (requests without sampling_seed)."""


class Scheduler:
    """Runs requests on a ModelRunner from one background thread; see the module docstring."""

    def __init__(self, runner: ModelRunner, config: SchedulerConfig, metrics: EngineMetrics):
        self.runner = runner
        self.config = config
        self.metrics = metrics
        self.cache = None if config.disable_radix_cache else RadixCache(config.cache_budget_tokens)
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: list[Request] = []
        self.commands: list[Command] = []
        self.batch = DecodeBatch(runner)
        self.generator = torch.Generator()
        self.generator.manual_seed(config.random_seed if config.random_seed is not None else time.time_ns())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-engine-scheduler", daemon=True)

    # ---- called from other threads -------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.inbox.put(req)

    def call(self, run: Callable[[], Any], ready: Callable[[], bool] | None = None) -> Future:
        """Run `run` on the scheduler thread, once `ready()` holds; returns its Future."""
        command = Command(run=run, ready=ready or (lambda: True))
        self.inbox.put(command)
        return command.future

    def busy(self) -> bool:
        """Requests queued or running (scheduler thread; approximate from elsewhere)."""
        return bool(self.waiting or self.batch.reqs or not self.inbox.empty())

    def uses_adapter(self, adapter_id: str) -> bool:
        return any(r.adapter_id == adapter_id for r in self.waiting + self.batch.reqs)

    def flush_cache(self) -> bool:
        """Empty the radix cache if nothing is queued or running (scheduler thread)."""
        if self.busy():
            return False
        if self.cache is not None:
            self.cache.reset()
        return True

    # ---- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
            except Exception as e:  # a bug, not a bad request: fail what is running, keep serving
                log.exception("scheduler round failed")
                self._fail(self.batch.reqs, e)
                self.batch = DecodeBatch(self.runner)

    def _round(self) -> None:
        self._pull(block=not (self.waiting or self.batch.reqs or self.commands))
        self._run_commands()
        self._admit_and_prefill()
        if self.batch.reqs:
            self._decode_step()
        self._set_gauges()

    def _pull(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            (self.commands if isinstance(item, Command) else self.waiting).append(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _run_commands(self) -> None:
        for command in list(self.commands):
            if not command.ready():
                continue
            self.commands.remove(command)
            try:
                command.future.set_result(command.run())
            except Exception as e:
                command.future.set_exception(e)

    def _admit_and_prefill(self) -> None:
        """Move waiting requests into the batch, first come first served, prefilling each.

        The prefill budget counts the tokens actually computed, so cache hits are almost free.
        A request whose adapter would exceed --max-loras-per-batch waits (later ones may pass).
        """
        adapters = {r.adapter_id for r in self.batch.reqs}
        budget = self.config.max_prefill_tokens
        joined: list[tuple[Request, LayerKV]] = []
        cached = prompt = 0
        for req in list(self.waiting):
            if req.aborted:
                self.waiting.remove(req)
                self._finish(req, None, {"type": "abort", "message": "client disconnected"})
                continue
            if budget <= 0 or len(self.batch.reqs) + len(joined) >= self.config.max_running_requests:
                break
            if req.adapter_id not in adapters and len(adapters) >= self.config.max_loras_per_batch:
                continue
            self.waiting.remove(req)
            adapters.add(req.adapter_id)
            try:
                layers = self._prefill(req)
            except Exception as e:
                log.exception("prefill of request %s failed", req.rid)
                self._fail([req], e)
                continue
            budget -= len(req.input_ids) - 1 - req.cached_tokens
            cached += req.cached_tokens
            prompt += len(req.input_ids)
            self.metrics.on_round("prefill_compute", len(req.input_ids) - req.cached_tokens)  # per request:
            self.metrics.on_round("prefill_cache", req.cached_tokens)  # a long round still shows progress
            if req.finish_reason is None:
                joined.append((req, layers))
            else:
                self._finish(req, None, req.finish_reason)
        if joined:
            self.batch.add(joined)
        if prompt:
            self.metrics.cache_hit_rate.set(cached / prompt)  # SGLang's gauge: the last round only

    def _prefill(self, req: Request) -> LayerKV:
        """Build the KV of every prompt token but the last; return it, one tensor pair per layer.

        The last prompt token is fed by the next decode step, batched with the other rows, which
        yields the first output token. So a group's samples that hit the cache for the whole
        prompt cost no forward pass of their own here: they only copy the cached KV.
        """
        ids = req.input_ids
        n = len(ids) - 1  # tokens whose KV the prefill provides
        req.dispatch_ts = time.time()
        if req.params.sampling_seed is not None:
            req.generator = torch.Generator().manual_seed(req.params.sampling_seed + req.sample_index)
        start = min(req.logprob_start_len, n + 1) if req.return_logprob else -1
        first_logit = max(start - 1, 0) if 0 <= start <= n else None  # first prompt position scored
        limit = n if first_logit is None else min(n, first_logit)
        prefix_len, prefix_kv, node = 0, None, None
        if self.cache is not None and limit > 0:
            match = self.cache.match_prefix(req.namespace, ids[:limit])
            prefix_len, prefix_kv, node = match.length, match.kv(), match.last_node
        if prefix_len < n:
            cache = self.runner.make_cache(prefix_kv)
            keep = n - first_logit if first_logit is not None else 1
            logits = self.runner.forward(torch.tensor([ids[prefix_len:n]]), torch.arange(prefix_len, n)[None],
                                         cache, None, [req.adapter_id], logits_to_keep=keep)[0]
            layers = [(layer.keys, layer.values) for layer in cache.layers]
            if first_logit is not None:
                self._score_prompt(req, logits, start, first_logit)
            if self.cache is not None:
                node = self.cache.insert(req.namespace, ids[:n], stack_kv(layers))
        else:
            layers = self.runner.split_kv(prefix_kv)
            if start == 0:
                self._score_prompt(req, None, start, 0)
        if self.cache is not None:
            self.cache.lock(node)
            req.cache_node = node
        req.cached_tokens = prefix_len
        req.kv_len = n
        if req.params.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
        return layers

    def _score_prompt(self, req: Request, logits: torch.Tensor | None, start: int, first_logit: int) -> None:
        """input_token_logprobs of positions start..len-1; logits[j] is position first_logit + j.

        Scaled by the request's temperature, like the output logprobs.
        """
        temperature = 1.0 if req.params.greedy else req.params.temperature
        logprobs = None if logits is None else torch.log_softmax(logits / temperature, dim=-1)
        for i in range(start, len(req.input_ids)):
            if i == 0:
                req.input_logprobs.append(None)
                req.input_top_logprobs.append(None)
                continue
            row = logprobs[i - 1 - first_logit]
            req.input_logprobs.append(float(row[req.input_ids[i]]))
            req.input_top_logprobs.append(_top(row, req.top_logprobs_num))

    # ---- decode --------------------------------------------------------------------------
    def _decode_step(self) -> None:
        aborted = [r for r in self.batch.reqs if r.aborted]
        if aborted:
            self.batch.remove(aborted)
            for req in aborted:
                self._finish(req, None, {"type": "abort", "message": "client disconnected"})
        if not self.batch.reqs:
            return
        reqs = list(self.batch.reqs)
        started = time.perf_counter()
        # Each row feeds the token after its KV: the last prompt token, then its last output.
        logits = self.batch.forward([r.output_ids[-1] if r.output_ids else r.input_ids[-1] for r in reqs])
        self._sample_and_append(reqs, logits)
        self.metrics.on_round("decode", len(reqs))
        self.metrics.gen_throughput.set(len(reqs) / max(time.perf_counter() - started, 1e-9))
        done = [r for r in reqs if r.finish_reason is not None]
        if done:
            kvs = self.batch.remove(done)
            for req in done:
                self._finish(req, kvs[req], req.finish_reason)

    def _sample_and_append(self, reqs: list[Request], logits: torch.Tensor) -> None:
        try:
            tokens, logprobs = sample_tokens(logits, [r.params for r in reqs],
                                             [r.generator or self.generator for r in reqs],
                                             [self._banned(r) for r in reqs])
        except Exception:  # one request's sampling failed: sample each alone, fail only that one
            log.exception("batched sampling failed; sampling the %d requests one by one", len(reqs))
            tokens, logprobs = self._sample_alone(reqs, logits)
        now = time.time()
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            if token is None:
                continue  # failed in _sample_alone: finished as an abort with its error
            req.output_ids.append(token)
            if req.return_logprob:
                req.output_logprobs.append(float(logprobs[i, token]))
                if req.top_logprobs_num > 0:
                    req.output_top_logprobs.append(_top(logprobs[i], req.top_logprobs_num))
            if req.first_token_ts is None:
                req.first_token_ts = now
            req.finish_reason = self._finish_reason(req, token)
            if req.stream and req.finish_reason is None:
                req.notify(False)

    def _sample_alone(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list, torch.Tensor]:
        tokens, rows = [], []
        for i, req in enumerate(reqs):
            try:
                (token,), row = sample_tokens(logits[i:i + 1], [req.params], [req.generator or self.generator],
                                              [self._banned(req)])
            except Exception as e:
                req.error = f"{type(e).__name__}: {e}"
                req.finish_reason = {"type": "abort", "message": req.error}
                token, row = None, torch.zeros_like(logits[i:i + 1])
            tokens.append(token)
            rows.append(row)
        return tokens, torch.cat(rows)

    def _banned(self, req: Request) -> frozenset[int]:
        p = req.params
        if len(req.output_ids) >= p.min_new_tokens:
            return frozenset()
        return p.stop_token_ids | (frozenset() if p.ignore_eos else self.runner.eos_ids)

    def _finish_reason(self, req: Request, token: int) -> dict | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.runner.eos_ids):
            return {"type": "stop", "matched": token}
        if p.stop:
            tail = self.runner.decode(req.output_ids[-STOP_WINDOW_TOKENS:], p.skip_special_tokens)
            for s in p.stop:
                if s and s in tail:
                    return {"type": "stop", "matched": s}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(req.input_ids) + len(req.output_ids) >= self.runner.context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    # ---- finishing -----------------------------------------------------------------------
    def _finish(self, req: Request, kv: torch.Tensor | None, reason: dict) -> None:
        """Cache the sequence's KV (when given), release the request's lock, call back."""
        req.finish_reason = reason
        if self.cache is not None:
            if kv is not None:
                tokens = (req.input_ids + req.output_ids)[:req.kv_len]
                self.cache.insert(req.namespace, tokens, kv)
            self.cache.unlock(req.cache_node)
        req.cache_node = None
        req.finished_ts = time.time()
        if req.error is None and reason.get("type") != "abort":
            ttft = None if req.first_token_ts is None else req.first_token_ts - req.received_ts
            self.metrics.on_finish(len(req.input_ids), len(req.output_ids), req.cached_tokens,
                                   ttft, req.finished_ts - req.received_ts)
        req.notify(True)

    def _fail(self, reqs: list[Request], error: Exception) -> None:
        for req in list(reqs):
            req.error = f"{type(error).__name__}: {error}"
            self._finish(req, None, {"type": "abort", "message": req.error})

    def _set_gauges(self) -> None:
        self.metrics.num_running_reqs.set(len(self.batch.reqs))
        self.metrics.num_queue_reqs.set(len(self.waiting))
        used = sum(r.kv_len for r in self.batch.reqs) + (self.cache.total_tokens if self.cache else 0)
        self.metrics.token_usage.set(used / max(self.config.cache_budget_tokens, 1))


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
    return [(float(v), int(i)) for v, i in zip(values, ids)]
