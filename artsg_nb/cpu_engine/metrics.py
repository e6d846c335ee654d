"""Prometheus metrics of the CPU engine, under SGLang's names and labels.

What it does: keeps the counters, gauges and histograms the toolkit reads from SGLang's
/metrics in a private prometheus_client CollectorRegistry, with the same names and labels as a
real SGLang 0.5.14 server (see shared/fixtures/sglang-0.5.14/metrics.txt):
request counters carry {model_name, engine_type}; scheduler gauges add tp_rank/pp_rank/
moe_ep_rank like SGLang's scheduler collector. `sglang:cached_tokens_total{cache_source=
"device"}` only appears after the first cache hit, as on SGLang. `sglang:cache_hit_rate` is the
hit rate of the most recent prefill round only (SGLang's per-report gauge); cumulative hit rates
come from Σcached_tokens_total / Σprompt_tokens_total.

What it deliberately does not do: HTTP-level metrics, per-stage latency histograms, or any of
SGLang's GPU/speculative/disaggregation gauges.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineMetrics:
    """The engine's metrics; `render()` is the /metrics body."""

    def __init__(self, model_name: str):
        # SGLang's /metrics has no *_created series. This switch is process-wide, which is
        # fine: the engine is its own process.
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name, "engine_type": "unified"}
        self._sched_labels = {**self._labels, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        req = list(self._labels)
        sched = list(self._sched_labels)

        def counter(name, doc, extra=()):
            return Counter(name, doc, req + list(extra), registry=self.registry)

        def gauge(name, doc):
            return Gauge(name, doc, sched, registry=self.registry).labels(**self._sched_labels)

        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens.", ["cache_source"])
        self.num_requests = counter("sglang:num_requests", "Number of requests processed.")
        # Counted every scheduler round, not at finish: the watchdog's sign of progress.
        self.realtime_tokens = Counter("sglang:realtime_tokens", "Tokens processed, counted every round.",
                                       sched + ["mode"], registry=self.registry)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token.", req,
                              buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency.", req,
                             buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.num_running_reqs = gauge("sglang:num_running_reqs", "Number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "Number of queued requests.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "Prefix cache hit rate of the last prefill round.")
        self.token_usage = gauge("sglang:token_usage", "Used KV tokens / token budget.")
        self.gen_throughput = gauge("sglang:gen_throughput", "Generation throughput (token/s).")
        self.lora_slots_used = gauge("sglang:lora_pool_slots_used", "LoRA adapters resident.")
        self.lora_slots_total = gauge("sglang:lora_pool_slots_total", "LoRA slots (--max-loras-per-batch).")
        self.lora_utilization = gauge("sglang:lora_pool_utilization", "LoRA slots used / total.")

    def on_finish(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                  ttft_s: float | None, e2e_s: float) -> None:
        """Count one finished request (SGLang counts in the tokenizer manager, at finish)."""
        self.prompt_tokens.labels(**self._labels).inc(prompt_tokens)
        self.generation_tokens.labels(**self._labels).inc(completion_tokens)
        if cached_tokens > 0:
            self.cached_tokens.labels(**self._labels, cache_source="device").inc(cached_tokens)
        self.num_requests.labels(**self._labels).inc()
        if ttft_s is not None:
            self.ttft.labels(**self._labels).observe(ttft_s)
        self.e2e.labels(**self._labels).observe(e2e_s)

    def on_round(self, mode: str, tokens: int) -> None:
        """Tokens one scheduler round processed; `mode` "prefill_compute", "prefill_cache" or "decode"."""
        if tokens > 0:
            self.realtime_tokens.labels(**self._sched_labels, mode=mode).inc(tokens)

    def set_lora_slots(self, used: int, total: int) -> None:
        self.lora_slots_used.set(min(used, total))
        self.lora_slots_total.set(total)
        self.lora_utilization.set(min(used, total) / total if total else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
