"""Sampling for the CPU engine: SGLang's `sampling_params` contract and the token sampler.

What it does: validates a request's `sampling_params` the way SGLang 0.5.23 does (unknown keys
are an error, reported as HTTP 400 `{"error": "<message>"}`), and samples one token per row from
a batch of logits with per-row temperature, top-k, top-p, min-p and an optional per-request
seed. Returned logprobs follow SGLang: log_softmax(logits / temperature) of the sampled token,
taken after temperature and before top-k/top-p renormalisation; temperature 0 means greedy,
with the logprobs of log_softmax(logits).

What it deliberately does not do: penalties (repetition, frequency, presence), logit bias,
grammars (regex, json_schema, ebnf), beam search. Those keys are recognised and accepted only at
their neutral value; anything else is refused with a message naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SAMPLING_EPS = 1e-6  # SGLang: temperature below this is greedy
MAX_SEED = 2**63 - 1  # a torch.Generator seed; sample j of n uses sampling_seed + j

SUPPORTED_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "min_new_tokens", "n", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "sampling_seed",
}
# Keys SGLang knows that this engine accepts only at their neutral value.
NEUTRAL_VALUES = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "logit_bias": None, "custom_params": None, "beam_width": None, "watermark": None, "choice": None,
}


class RequestSamplingError(ValueError):
    """A `sampling_params` dict that breaks the contract (HTTP 400 `{"error": msg}`)."""


@dataclass(frozen=True)
class RequestSampling:
    """One request's sampling settings as the server reads its `sampling_params` JSON (SGLang names
    and defaults); the training side builds that JSON in artsg_nb/engines/sglang.py."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def parse_sampling_params(raw: dict | None) -> RequestSampling:
    """RequestSampling from a request's `sampling_params`; RequestSamplingError if invalid."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestSamplingError("sampling_params must be a JSON object")
    unknown = sorted(set(raw) - SUPPORTED_KEYS - set(NEUTRAL_VALUES))
    if unknown:
        raise RequestSamplingError(f"Unknown sampling_params key(s): {unknown}. "
                                  "The seed key is sampling_seed, not seed.")
    for key, neutral in NEUTRAL_VALUES.items():
        if key in raw and raw[key] not in (neutral, None):
            raise RequestSamplingError(f"sampling_params.{key}={raw[key]!r} is not supported by the CPU engine")
    stop = raw.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    try:
        params = RequestSampling(
            max_new_tokens=int(_get(raw, "max_new_tokens", 128)),
            temperature=float(_get(raw, "temperature", 1.0)),
            top_p=float(_get(raw, "top_p", 1.0)),
            top_k=int(_get(raw, "top_k", -1)),
            min_p=float(_get(raw, "min_p", 0.0)),
            min_new_tokens=int(_get(raw, "min_new_tokens", 0)),
            stop=stop,
            stop_token_ids=frozenset(int(t) for t in (raw.get("stop_token_ids") or ())),
            ignore_eos=bool(raw.get("ignore_eos", False)),
            n=int(_get(raw, "n", 1)),
            skip_special_tokens=bool(raw.get("skip_special_tokens", True)),
            spaces_between_special_tokens=bool(raw.get("spaces_between_special_tokens", True)),
            no_stop_trim=bool(raw.get("no_stop_trim", False)),
            sampling_seed=None if raw.get("sampling_seed") is None else int(raw["sampling_seed"]),
        )
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: int(Infinity)
        raise RequestSamplingError(f"invalid sampling_params: {e}") from e
    _check_ranges(params)
    return params


def _get(raw: dict, key: str, default):
    value = raw.get(key)
    return default if value is None else value


def _check_ranges(p: RequestSampling) -> None:
    problems = []
    for name in ("temperature", "top_p", "min_p"):  # NaN passes every comparison below
        if not math.isfinite(getattr(p, name)):
            problems.append(f"{name} must be a finite number, got {getattr(p, name)}")
    if p.sampling_seed is not None and not -MAX_SEED <= p.sampling_seed <= MAX_SEED - max(p.n - 1, 0):
        problems.append(f"sampling_seed must be in [{-MAX_SEED}, {MAX_SEED - max(p.n - 1, 0)}] (seed + n - 1 "
                        f"seeds the last sample), got {p.sampling_seed}")
    if p.max_new_tokens < 0:
        problems.append(f"max_new_tokens must be >= 0, got {p.max_new_tokens}")
    if p.temperature < 0:
        problems.append(f"temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k == 0 or p.top_k < -1:
        problems.append(f"top_k must be -1 (off) or >= 1, got {p.top_k}")
    if not 0 <= p.min_p <= 1:
        problems.append(f"min_p must be in [0, 1], got {p.min_p}")
    if p.n < 1:
        problems.append(f"n must be >= 1, got {p.n}")
    if not all(isinstance(s, str) for s in p.stop):
        problems.append("stop must be a string or a list of strings")
    if problems:
        raise RequestSamplingError("; ".join(problems))


def sample_tokens(logits: torch.Tensor, params: list[RequestSampling],
                  generators: list[torch.Generator | None],
                  banned: list[frozenset[int]]) -> tuple[list[int], torch.Tensor]:
    """Sample one token per row.

    logits: (B, V) raw logits; banned[i]: ids row i may not produce yet (min_new_tokens).
    Returns the sampled ids and the (B, V) logprobs they were scored with
    (log_softmax(logits / T), or log_softmax(logits) for greedy rows).
    """
    logits = logits.clone()
    for i, ids in enumerate(banned):
        if ids:
            logits[i, list(ids)] = float("-inf")
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=logits.dtype)
    logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)  # (B, V)
    tokens = []
    for i, p in enumerate(params):
        if p.greedy:
            tokens.append(int(torch.argmax(logprobs[i])))
        else:
            probs = _filtered_probs(logprobs[i].exp(), p)
            tokens.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    return tokens, logprobs


def _filtered_probs(probs: torch.Tensor, p: RequestSampling) -> torch.Tensor:
    """Apply top-k, top-p and min-p to one row of probabilities (renormalised by multinomial)."""
    if p.top_k > 0 and p.top_k < probs.numel():
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
        sorted_probs[mass_before > p.top_p * sorted_probs.sum()] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
    return probs
