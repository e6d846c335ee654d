"""The running batch of the CPU engine: rows of different lengths decoded in one forward pass.

What it does: keeps the KV of every running request as one left-padded tensor per layer plus
a padding mask, so one forward pass decodes all rows (each with its own position ids and
adapter); joins prefilled requests, drops finished ones (trimming columns that became padding
in every row) and hands back a finished row's KV for the radix cache.

What it deliberately does not do: paged or preallocated KV (DynamicCache concatenates each
step), preemption, or any scheduling decision (scheduler.py makes them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .model import ModelRunner
from .request import Request

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, heads, tokens, head_dim) k and v


class DecodeBatch:
    """The running requests and their KV, left-padded to one length T.

    keys/values: per layer (B, heads, T, head_dim); mask: (B, T), 0 on each row's left padding.
    Row i's real tokens are the last `reqs[i].kv_len` positions.
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.reqs: list[Request] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long)

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def add(self, items: list[tuple[Request, LayerKV]]) -> None:
        """Join prefilled requests (their KV, one row each) to the batch."""
        length = max([self.length] + [req.kv_len for req, _ in items])
        rows = [(self.keys, self.values, self.mask)] if self.reqs else []
        for req, layers in items:
            rows.append(([k for k, _ in layers], [v for _, v in layers],
                         torch.ones(1, req.kv_len, dtype=torch.long)))
            self.reqs.append(req)
        n_layers = len(rows[0][0])
        self.keys = [torch.cat([_left_pad(r[0][i], length) for r in rows]) for i in range(n_layers)]
        self.values = [torch.cat([_left_pad(r[1][i], length) for r in rows]) for i in range(n_layers)]
        self.mask = torch.cat([F.pad(r[2], (length - r[2].shape[1], 0)) for r in rows])

    def forward(self, tokens: list[int]) -> torch.Tensor:
        """One decode step: feed one token per row; returns (B, V) logits."""
        batch = len(self.reqs)
        mask = torch.cat([self.mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
        cache = DynamicCache(ddp_cache_data=list(zip(self.keys, self.values)))
        positions = torch.tensor([[r.kv_len] for r in self.reqs])
        logits = self.runner.forward(torch.tensor(tokens)[:, None], positions, cache,
                                     None if bool(mask.all()) else mask,
                                     [r.adapter_id for r in self.reqs])[:, -1]
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]
        self.mask = mask
        for req in self.reqs:
            req.kv_len += 1
        return logits

    def remove(self, done: list[Request]) -> dict[Request, torch.Tensor]:
        """Drop rows; return each dropped row's KV as (layers, 2, heads, kv_len, head_dim)."""
        done_set = set(done)
        out = {}
        for i, req in enumerate(self.reqs):
            if req in done_set:
                pad = self.length - req.kv_len
                out[req] = torch.stack([torch.stack([k[i, :, pad:], v[i, :, pad:]])
                                        for k, v in zip(self.keys, self.values)])
        keep = [i for i, r in enumerate(self.reqs) if r not in done_set]
        self.reqs = [self.reqs[i] for i in keep]
        if not self.reqs:
            self.keys, self.values, self.mask = [], [], torch.zeros(0, 0, dtype=torch.long)
            return out
        trim = self.length - max(r.kv_len for r in self.reqs)  # columns that are padding in every row
        index = torch.tensor(keep)
        self.keys = [k[index, :, trim:] for k in self.keys]
        self.values = [v[index, :, trim:] for v in self.values]
        self.mask = self.mask[index, trim:]
        return out


def stack_kv(layers: LayerKV) -> torch.Tensor:
    """Per-layer (1, heads, n, head_dim) k, v → one (layers, 2, heads, n, head_dim) tensor."""
    return torch.stack([torch.stack([k[0], v[0]]) for k, v in layers])


def _left_pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad (B, heads, n, head_dim) with zeros to `length` tokens."""
    return F.pad(x, (0, 0, length - x.shape[2], 0))
