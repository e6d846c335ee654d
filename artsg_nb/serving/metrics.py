"""Prefix-cache hit rates: measured from an engine's Prometheus /metrics text, per turn of a
rollout batch, and the theoretical maximum of a batch.

What it does: parse the text with prometheus_client's parser, sum every sample over its label
values, and read the token counters the hit rate comes from:

* SGLang (and the CPU engine): Σ sglang:cached_tokens_total (over *all* labels, every
  cache_source included) / Σ sglang:prompt_tokens_total.
* vLLM: Σ vllm:prefix_cache_hits_total / Σ vllm:prefix_cache_queries_total (the old
  vllm:gpu_prefix_cache_* names are accepted too).

`hit_rate(before, after)` is the rate over a window (two scrapes); `HitRateTracker` keeps
timestamped scrapes for the dashboard's trend. A step's own `hit_rate` is no scrape: it is the
counts the server sent with each answer (trajectory.rollout_stats).

The counter names are each engine's (engines.get(name).prompt_counters / cached_counters).

One definition of a step's hit rate, on every engine, schedule and fleet: the share of the step's
prompt tokens the server served from its prefix cache, from the step's own sampling requests (the
`cached_tokens` each answer reports over the prompt tokens it processed; warm-up requests that
only cache a prompt are not samples and are not counted). Beside it, `reachable_hit_rate(groups)`:

* `rate`, what the submission path the step took can reach: each group's prompt is computed once
  and read by every copy sent after it (a warm-up request, a leader, the engine's own prefill
  copy for native n); copies prefilled together on purpose read nothing (0, and the path says
  so); a later turn reads its own episode's history. Engines recompute a prompt's last token, so
  a copy reads at most its prompt less one token.
* `shared`, apart from it: what the cache could also serve across groups (the chat template, a
  system prompt or few-shot prefix that different prompts begin with), which depends on the
  order in which the server happens to see them. A measured rate lies within
  [rate, rate + shared] up to the engine's noise; where `exact` is False (every request sent at
  once) `rate` is only the most it could reach.

Across steps nothing is shared: the cache is keyed by the adapter, a new one every step.

`theoretical_hit_rate(groups)` is the older within-batch bound (every copy after the first of an
identical prompt, whatever the path); `turn_hit_rates(groups)` tabulates the server's per-turn
prompt and cached token counts next to it (the table notebook 02 shows).

What it does not do: scrape (EngineClient.metrics_text does) or use the `sglang:cache_hit_rate` gauge:
that gauge covers only the most recent prefill batch, so it is never a cumulative or windowed
rate. Counters are the only sound source.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Iterable, Sequence

import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

from .. import engines

class MetricsError(ValueError):
    """The /metrics text holds none of the engine's metrics."""


def parse_metrics(text: str, names: Iterable[str] | None = None) -> dict[str, float]:
    """Sample name → value summed over all label values; with `names`, only those samples.

    The sum is what a counter or a gauge total means; for histogram `_bucket` samples it is not
    meaningful (read `_sum` and `_count` instead). `names` picks the sample lines out before the
    parser sees them: a GPU server's whole text (SGLang's: ~50 KiB, histograms per stage) takes
    the parser 5-15 ms, and the hit rate needs two of its lines.
    """
    if names is not None:
        text = _sample_lines(text, frozenset(names))
    totals: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
    return dict(totals)


def _sample_lines(text: str, names: frozenset[str]) -> str:
    """The sample lines of `text` whose sample name is in `names` (without their # HELP / # TYPE
    lines, so each parses as an untyped family of that sample's own name: the same name and value)."""
    lines = (line.lstrip() for line in text.splitlines())
    keep = [line for line in lines if line and not line.startswith("#") and _SAMPLE_NAME.match(line).group(0) in names]
    return "\n".join(keep) + "\n"


_SAMPLE_NAME = re.compile(r"[^{\s]*")


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
    if not any(line.lstrip().startswith(spec.metric_prefix) for line in text.splitlines()):
        raise MetricsError(
            f"no {spec.metric_prefix}* metric in the /metrics text: is this a {engine} server, and was it "
            "started with metrics on (SGLang: --enable-metrics; vLLM: without --disable-log-stats)?")
    # A labelled counter appears only after its first increment, so absent means 0 so far. Names
    # are *sample* names: the parser strips `_total` from a counter's family name, not its samples'.
    values = parse_metrics(text, spec.prompt_counters + spec.cached_counters)
    return CacheCounters(prompt_tokens=_first(values, spec.prompt_counters),
                         cached_tokens=_first(values, spec.cached_counters))


KV_POOL_GAUGE = "sglang:max_total_num_tokens"
"""SGLang's gauge of the tokens its KV cache holds (the CPU engine and vLLM do not export it)."""


def kv_pool_tokens(text: str) -> int | None:
    """Tokens the server's KV cache holds, from /metrics text; None where it is not exported."""
    values = parse_metrics(text, (KV_POOL_GAUGE,))
    return int(values[KV_POOL_GAUGE]) if values.get(KV_POOL_GAUGE) else None


def progress_tokens(text: str, engine: str) -> float | None:
    """Tokens the engine has processed so far, counted as it works (EngineSpec.progress_counters),
    from /metrics text; None when the engine exposes no such counter."""
    names = engines.get(engine).progress_counters
    values = parse_metrics(text, names)
    present = [values[name] for name in names if name in values]
    return sum(present) if present else None  # absent (--disable-log-stats, an old engine): unknown, not 0


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

    kv_tokens: int | None = None
    """The server's KV cache size in tokens, from the last scrape that had it (kv_pool_tokens)."""

    def add_sample(self, text: str, t: float | None = None) -> float | None:
        """Record a /metrics scrape taken at `t` (default now); the window rate it closes."""
        self.kv_tokens = kv_pool_tokens(text) or self.kv_tokens
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


# ---------------------------------------------------------------------------- a batch's hit rates

TURN_COLUMNS = ["turn", "episodes", "prompt_tokens", "cached_tokens", "computed_tokens", "hit_rate",
                "theoretical"]
"""Columns of `turn_hit_rates` (bench.compare_schedules adds "schedule" and "rollout_s")."""


def theoretical_hit_rate(groups: Sequence, by_turn: bool = False) -> float | None | dict[int, float]:
    """Cached / prompt tokens of a batch if the prefix cache reused everything reusable in it.

    Definition, over the trajectories without an error (failed ones are left out): the prompt of
    model turn k is `token_ids[:start_k]` (`Trajectory.model_segments`). At turn 1 an opening
    prompt is reusable in full when an identical one came earlier in the batch (every copy but
    the first, across groups too: identical prompts share one cache entry); at turn k > 1 the
    episode's own history up to the end of reply k-1 is reusable. An upper bound up to one token
    per request (engines recompute the last prompt token to get its logits); a radix cache can
    beat it where different prompts share a prefix (a system prompt, the chat template) or
    episodes' replies coincide: it counts the reuse GRPO's groups and multi-turn histories make
    certain, which a schedule can reach, not every coincidence.

    Returns the rate over all turns (None when there is no prompt token), or with `by_turn` a
    dict turn (1, 2, ...) → that turn's rate.
    """
    prompt: dict[int, int] = {}
    reusable: dict[int, int] = {}
    seen: set[tuple[int, ...]] = set()
    for traj in (t for g in groups for t in g.trajectories if t.error is None):
        segments = traj.model_segments()
        for turn, (start, _) in enumerate(segments, start=1):
            if turn == 1:
                opening = tuple(traj.token_ids[:start])
                reused = start if opening in seen else 0
                seen.add(opening)
            else:
                reused = segments[turn - 2][1]
            prompt[turn] = prompt.get(turn, 0) + start
            reusable[turn] = reusable.get(turn, 0) + reused
    if by_turn:
        return {turn: reusable[turn] / prompt[turn] for turn in prompt if prompt[turn]}
    total = sum(prompt.values())
    return sum(reusable.values()) / total if total else None


@dataclass(frozen=True)
class ReachableHitRate:
    """What a step's submission path lets the prefix cache serve (see the module docstring)."""

    rate: float | None
    """Reusable / prompt tokens of the step's requests, by how each was submitted; None: no prompt."""
    path: str
    """How the turn-1 copies went ("warm-up first", "prefilled together", "leader first", "in order",
    "engine n", "unordered"), "+ own history" where later turns read their episode's history."""
    shared: float
    """The share of prompt tokens the cache could serve on top of `rate`, across groups."""
    exact: bool
    """False where `rate` is only an upper bound (requests sent all at once)."""

    kv_short: tuple[int, int] | None = None
    """(tokens the step's sequences hold at once, tokens the server's KV cache holds) where the
    first is larger: the server runs them in waves and evicts prompts before every copy reads
    them, so `rate` is only an upper bound (`exact` False)."""


def reachable_text(rate: float | None, path: str | None, shared: float | None = None) -> str:
    """" of 0.88 reachable + 0.05 shared (warm-up first)": what a step's submission path can reach,
    written beside its hit rate by the step line (history.History.format_row) and the dashboard
    (view/widgets/render.py), the one wording of both; "" without a rate (None or NaN). The share
    across groups is named from 0.01."""
    if not _number(rate):
        return ""
    across = f" + {shared:.2f} shared" if _number(shared) and shared >= 0.01 else ""
    return f" of {rate:.2f} reachable{across}" + (f" ({path})" if path else "")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value))


_FIRST_TURN_PATHS = {"warm-up first": "warm-up first", "prefilled together": "prefilled together",
                     "leader": "leader first", "after leader": "leader first", "engine n": "engine n",
                     "unordered": "unordered", "own prompt": None, "first copy": "in order",
                     "after first copy": "in order"}


def reachable_hit_rate(groups: Sequence, kv_tokens: int | None = None, in_flight: int | None = None) -> ReachableHitRate:
    """The hit rate the step's submission path can reach, from the `reusable_tokens` each request
    recorded (rollout.groups), the path's name, and the cross-group share beside it. With the
    server's KV cache size `kv_tokens`, a step whose sequences need more than it at once is marked
    `kv_short` (path ", KV short"): the path's rate is then only an upper bound. What a step needs
    at once counts each group's prompt once (the radix cache holds it once) and its completions,
    over at most the `in_flight` largest groups (RunConfig.concurrency)."""
    prompt = reusable = shared = 0
    paths: dict[str, int] = {}
    exact, later_turns = True, False
    openings: list[tuple[int, ...]] = []  # turn-1 prompts of earlier groups, for the shared share
    for group in groups:
        group_openings = []
        for traj in group.trajectories:
            for turn, stats in enumerate(traj.turn_stats, start=1):
                if "reusable_tokens" not in stats:
                    continue
                prompt += stats["prompt_tokens"]
                reusable += stats["reusable_tokens"]
                exact &= bool(stats.get("exact", True))
                if turn > 1:
                    later_turns = True
                    continue
                path = _FIRST_TURN_PATHS.get(stats["submission"], stats["submission"])
                if path is not None:
                    paths[path] = paths.get(path, 0) + 1
                opening = tuple(traj.token_ids[:traj.prompt_len])
                group_openings.append(opening)
                beyond = _longest_common_prefix(opening, openings) - stats["reusable_tokens"]
                if stats["submission"] == "prefilled together" and opening in group_openings[:-1]:
                    beyond = len(opening)  # a copy that missed its group's batch reads the first's prompt
                shared += min(max(beyond, 0), max(stats["prompt_tokens"] - 1, 0) - stats["reusable_tokens"])
        openings += list(dict.fromkeys(group_openings))
    path = ", ".join(sorted(paths, key=paths.get, reverse=True)) or "no shared prompts"
    path += " + own history" if later_turns else ""
    need = _kv_need(groups, in_flight)
    kv_short = (need, kv_tokens) if kv_tokens and need > kv_tokens else None
    return ReachableHitRate(rate=reusable / prompt if prompt else None, path=path + (", KV short" if kv_short else ""),
                            shared=shared / prompt if prompt else 0.0, exact=exact and not kv_short,
                            kv_short=kv_short)


def _kv_need(groups: Sequence, in_flight: int | None) -> int:
    """Tokens of KV the step's largest `in_flight` groups hold at once: each group's prompt once,
    and every member's tokens after it."""
    per_group = sorted((max((t.prompt_len for t in g.trajectories), default=0)
                        + sum(max(len(t.token_ids) - t.prompt_len, 0) for t in g.trajectories)
                        for g in groups), reverse=True)
    return sum(per_group[:in_flight] if in_flight else per_group)


def _longest_common_prefix(ids: tuple[int, ...], others: list[tuple[int, ...]]) -> int:
    best = 0
    for other in others:
        n = 0
        for a, b in zip(ids, other):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


def turn_hit_rates(groups: Sequence) -> pd.DataFrame:
    """Prompt / cached tokens per model turn (`Trajectory.turn_stats`, as the server reported
    them), summed over every episode that played that turn, failed ones included; with the hit
    rate and `theoretical_hit_rate(groups, by_turn=True)`. Columns: TURN_COLUMNS."""
    rows: dict[int, dict] = {}
    for traj in (t for g in groups for t in g.trajectories):
        for turn, stats in enumerate(traj.turn_stats, start=1):
            row = rows.setdefault(turn, {"turn": turn, "episodes": 0, "prompt_tokens": 0, "cached_tokens": 0})
            row["episodes"] += 1
            row["prompt_tokens"] += stats["prompt_tokens"]
            row["cached_tokens"] += stats["cached_tokens"]
    table = pd.DataFrame(sorted(rows.values(), key=lambda r: r["turn"]),
                         columns=["turn", "episodes", "prompt_tokens", "cached_tokens"])
    table["computed_tokens"] = table["prompt_tokens"] - table["cached_tokens"]
    table["hit_rate"] = table["cached_tokens"] / table["prompt_tokens"].where(table["prompt_tokens"] > 0)
    theory = theoretical_hit_rate(groups, by_turn=True)
    table["theoretical"] = [theory.get(turn, float("nan")) for turn in table["turn"]]
    return table[TURN_COLUMNS]
