"""One sequence the CPU engine generates: its prompt, sampling, adapter and what came out.

What it does: `Request` is the unit of work every layer passes around. protocol.py builds them
from JSON (an n>1 request is n of these), the scheduler thread fills the output fields, locks
a radix node while the request runs and calls `on_event`; batch.py keeps its KV row. Its own
module so the scheduler and the batch both use it without importing each other.

What it deliberately does not do: any work (no methods beyond the namespace and the callback).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from .radix_cache import BASE_NAMESPACE, Node
from .sampling import RequestSampling


@dataclass(eq=False)
class Request:
    """One sequence to generate (an n>1 request is n of these). Fields after `on_event` are
    written by the scheduler thread; HTTP code reads them after the finished event."""

    input_ids: list[int]
    params: RequestSampling
    adapter_id: str | None = None  # the adapter's load id; None = base model
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output logprobs only; k: also the prompt from position k
    top_logprobs_num: int = 0
    stream: bool = False
    sample_index: int = 0  # j of n: the seed of sample j is sampling_seed + j
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    on_event: Callable[[Request, bool], None] | None = None  # (request, finished), scheduler thread
    aborted: bool = False  # set by the HTTP side when the client goes away
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: dict | None = None
    error: str | None = None
    received_ts: float = field(default_factory=time.time)
    dispatch_ts: float | None = None
    first_token_ts: float | None = None
    finished_ts: float | None = None
    kv_len: int = 0  # tokens whose KV exists: len(prompt) - 1 + len(output)
    cache_node: Node | None = None  # radix node locked while the request runs
    generator: torch.Generator | None = None

    @property
    def namespace(self) -> str:
        return self.adapter_id or BASE_NAMESPACE

    def notify(self, finished: bool) -> None:
        if self.on_event is not None:
            self.on_event(self, finished)
