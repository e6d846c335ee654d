"""Per-token logprobs of a causal LM at a temperature, with or without the (B, L, vocab) logits.

What it does: `token_logprobs(model, input_ids, attention_mask, temperature, wanted)` returns the
(B, L-1) logprobs of tokens 1..L-1, computed only where `wanted` is set (0 elsewhere). With a
fused kernel (`fused_kernel()`: TRL's `ChunkedLogProbFunction`, the Triton kernel TRL's own
GRPOTrainer scores with) it runs the model's backbone for hidden states and projects only the
wanted positions through the LM head in tiles, so neither the logits of the prompt tokens nor a
(B, L, vocab) float32 copy are ever made: on SmolLM2 (49k vocab) that copy is ~0.4 MB a token,
most of a micro-batch's memory and time. Without one (no Triton: CPU) the model's own forward gives
the logits and `selective_log_softmax` takes the wanted ones, as before. `TorchLogProb` is a
plain-torch function with the kernel's `apply` signature: the CPU tests run the fused code path
through it, and the TRL leg of the step benchmark installs it where TRL has no kernel.

What it does not do: decide which path a trainer uses (trainer.py checks the fused one against
the logits on its first call and keeps the logits if they disagree) or compute the loss (grpo.py).
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

FUSED_VOCAB_TILE = 32768
"""Vocabulary columns per projection tile of the fused kernel (TRL's own default)."""
SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""The attention kernels the trainer's forward may use: not cuDNN's. Given the padding mask of a
batch, PyTorch 2.11 tries cuDNN's attention first on an H100, and cuDNN builds an execution plan
for every (batch, length) shape it has not seen: an update whose micro-batch had a new shape took
2.2-2.8 s where the others took 0.03-0.05 s (1.0 s on the forward's thread, 1.2 s on the
backward's; the GPU smoke, H100, 2026-12-07; the same cause as modelscope/FunASR#3704). The
memory-efficient kernel takes the mask with no per-shape cost."""


def fused_kernel():
    """TRL's fused `ChunkedLogProbFunction`, or None where it does not import (no Triton, no CUDA)."""
    if not torch.cuda.is_available():
        return None
    try:
        from trl.kernels import ChunkedLogProbFunction
    except ImportError:
        return None
    return ChunkedLogProbFunction


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                   wanted: torch.Tensor | None = None, kernel=None) -> torch.Tensor:
    """(B, L-1) logprobs of input_ids[:, 1:] under `model` at `temperature`, where `wanted` (B, L-1;
    None: every real token) is set, 0 elsewhere. `kernel`: a function with `ChunkedLogProbFunction`'s
    `apply` (the fused path), or None for the logits path."""
    if wanted is None:
        wanted = (attention_mask[:, 1:] * attention_mask[:, :-1]).bool()
    if kernel is None or not fusable(model):
        return _from_logits(model, input_ids, attention_mask, temperature, wanted.bool())
    return _fused(model, input_ids, attention_mask, temperature, wanted.bool(), kernel)


def fusable(model) -> bool:
    """Whether the fused path reproduces `model`'s logits: its LM head is a plain Linear (no
    adapter on it) of a decoder whose backbone `transformers` exposes as `base_model`."""
    hf = _hf_model(model)
    head = hf.get_output_embeddings()
    return type(head) is torch.nn.Linear and getattr(hf, "base_model", None) is not None and hf.base_model is not hf


def attention_backends():
    """The trainer's forward passes run inside this: attention by SDPA_BACKENDS only (its backward
    uses the kernel its forward chose)."""
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    return sdpa_kernel(list(SDPA_BACKENDS))


def _from_logits(model, input_ids, attention_mask, temperature, wanted) -> torch.Tensor:
    from trl.trainer.utils import selective_log_softmax
    with attention_backends():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    lp = selective_log_softmax(logits.float() / temperature, input_ids[:, 1:])
    return torch.where(wanted, lp, torch.zeros_like(lp))


def _fused(model, input_ids, attention_mask, temperature, wanted, kernel) -> torch.Tensor:
    hf = _hf_model(model)
    with attention_backends():
        hidden = hf.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    head = hf.get_output_embeddings()
    softcap, scale = _logit_transform(hf.config)
    picked = kernel.apply(hidden[:, :-1][wanted], head.weight, head.bias, input_ids[:, 1:][wanted], temperature,
                          FUSED_VOCAB_TILE, softcap, scale, ("log_probs",))[0]
    # masked_scatter keeps the result connected to the model when nothing is wanted (a zero gradient)
    return hidden.new_zeros(wanted.shape, dtype=torch.float32).masked_scatter(wanted, picked.float())


def _hf_model(model):
    """The transformers model under a PEFT wrapper (the LoRA layers are inside it), or `model`."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def text_config(config):
    """The language model's part of a model config (a vision-language config nests it), or `config`."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _logit_transform(config) -> tuple[float | None, float]:
    """(final_logit_softcapping, logit_scale) of a model config, by TRL 1.15's rules
    (trl.trainer.utils.add_fused_lm_head); a rule it lacks shows in Trainer.check_fused."""
    text = text_config(config)
    scale = getattr(text, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        scale = getattr(text, name, None) if scale is None else scale
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scale = text.logits_scaling if getattr(text, "model_type", "") == "hyperclovax" else 1 / text.logits_scaling
    return getattr(text, "final_logit_softcapping", None), 1.0 if scale is None else float(scale)


class TorchLogProb:
    """Plain-torch stand-in for TRL's fused `ChunkedLogProbFunction` (a Triton kernel) with the
    same `apply` signature and results: the fused code path on a CPU (tests), and TRL's scoring
    where TRL could not import its kernel (the step benchmark's TRL leg on CPU)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=()):
        logits = hidden.float() @ weight.float().t()
        if bias is not None:
            logits = logits + bias.float()
        logits = logits * logit_scale
        if final_logit_softcapping is not None:
            logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
        logits = logits / temperature
        lsm = torch.log_softmax(logits, dim=-1)
        logprobs = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        outputs = outputs or ()
        p = lsm.exp()
        entropy = -(p * lsm).sum(-1) if "entropy" in outputs else None
        sq = torch.logsumexp(2 * lsm, dim=-1) if "log_sum_sq_probs" in outputs else None
        mean = logits.mean(-1) if "mean_logits" in outputs else None
        top1 = (logits.argmax(-1) == targets) if "is_top1" in outputs else None
        return logprobs, entropy, sq, mean, top1
