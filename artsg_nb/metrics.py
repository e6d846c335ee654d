"""Prefix-cache hit rates from an engine's Prometheus /metrics text.

What it does: parse the text with prometheus_client's parser, sum every sample over its label
values, and read the token counters the hit rate comes from:

* SGLang (and the CPU engine): Σ sglang:cached_tokens_total (over *all* labels, every
  cache_source included) / Σ sglang:prompt_tokens_total.
* vLLM: Σ vllm:prefix_cache_hits_total / Σ vllm:prefix_cache_queries_total (the old
  vllm:gpu_prefix_cache_* names are accepted too).

`hit_rate(before, after)` is the rate over a window (two scrapes); `HitRateTracker` keeps
timestamped scrapes for the dashboard's trend and the per-step numbers.

The counter names are each engine's (engines.get(name).prompt_counters / cached_counters).

What it does not do: scrape (EngineClient.metrics_text does) or use the `sglang:cache_hit_rate` gauge:
that gauge covers only the most recent prefill batch, so it is never a cumulative or windowed
rate. Counters are the only sound source.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from . import engines

class MetricsError(ValueError):
    """The /metrics text holds none of the engine's metrics."""


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name → value summed over all label values.

    The sum is what a counter or a gauge total means; for histogram `_bucket` samples it is not
    meaningful (read `_sum` and `_count` instead).
    """
    totals: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
    return dict(totals)


@dataclass(frozen=True)
class CacheCounters:
    """Cumulative prompt-token counters since the server started."""

    prompt_tokens: float
    """Prompt tokens of finished requests (vLLM: tokens looked up in the prefix cache)."""
    cached_tokens: float
    """Of those, tokens served from the prefix cache."""


def cache_counters(text: str, engine: str) -> CacheCounters:
    """Read the hit-rate counters of `engine` ("sglang", "cpu" or "vllm") from /metrics text."""
    spec = engines.get(engine)
    values = parse_metrics(text)
    if not any(name.startswith(spec.metric_prefix) for name in values):
        raise MetricsError(
            f"no {spec.metric_prefix}* metric in the /metrics text: is this a {engine} server, and was it "
            "started with metrics on (SGLang: --enable-metrics; vLLM: without --disable-log-stats)?")
    # A labelled counter appears only after its first increment, so absent means 0 so far. Names
    # are *sample* names: the parser strips `_total` from a counter's family name, not its samples'.
    return CacheCounters(prompt_tokens=_first(values, spec.prompt_counters),
                         cached_tokens=_first(values, spec.cached_counters))


def _first(values: dict[str, float], names: tuple[str, ...]) -> float:
    return next((values[n] for n in names if n in values), 0.0)


def hit_rate(before: CacheCounters, after: CacheCounters) -> float | None:
    """Cached / prompt tokens between two scrapes; None when no prompt token was processed.

    If the counters went down the server restarted, and `after` alone is the window.
    """
    if after.prompt_tokens < before.prompt_tokens:
        before = CacheCounters(0.0, 0.0)
    prompt = after.prompt_tokens - before.prompt_tokens
    if prompt <= 0:
        return None
    return (after.cached_tokens - before.cached_tokens) / prompt


def cumulative_hit_rate(counters: CacheCounters) -> float | None:
    """Cached / prompt tokens since the server started; None before any prompt."""
    return hit_rate(CacheCounters(0.0, 0.0), counters)


@dataclass
class HitRateTracker:
    """Timestamped counter scrapes, for the live hit rate and its trend.

    `add_sample(await client.metrics_text())` after each scrape; `last_window()` is the rate
    between the last two scrapes, `trend(n)` the last n window rates, `cumulative()` the rate
    since the server started.
    """

    engine: str
    """"sglang", "cpu" or "vllm": which counters to read."""
    max_samples: int = 240
    """Scrapes kept (the oldest are dropped)."""

    def __post_init__(self) -> None:
        self.samples: deque[tuple[float, CacheCounters]] = deque(maxlen=self.max_samples)

    def add_sample(self, text: str, t: float | None = None) -> float | None:
        """Record a /metrics scrape taken at `t` (default now); the window rate it closes."""
        return self.add_counters(cache_counters(text, self.engine), t)

    def add_counters(self, counters: CacheCounters, t: float | None = None) -> float | None:
        self.samples.append((time.time() if t is None else t, counters))
        return self.last_window()

    def cumulative(self) -> float | None:
        return cumulative_hit_rate(self.samples[-1][1]) if self.samples else None

    def last_window(self) -> float | None:
        if len(self.samples) < 2:
            return None
        return hit_rate(self.samples[-2][1], self.samples[-1][1])

    def trend(self, n: int | None = None) -> list[float | None]:
        """Window rates between consecutive scrapes, oldest first, at most the last `n`."""
        pairs = list(zip(list(self.samples)[:-1], list(self.samples)[1:]))
        rates = [hit_rate(a[1], b[1]) for a, b in pairs]
        return rates if n is None else rates[-n:]

    def windows(self, n: int | None = None) -> list[tuple[float, float | None]]:
        """Like trend, paired with each window's end time."""
        ends = [t for t, _ in self.samples][1:]
        pairs = list(zip(ends, self.trend()))
        return pairs if n is None else pairs[-n:]
