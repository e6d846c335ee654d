"""Will a model fit one GPU shared by the server and the trainer? A rough estimate from config.json.

What it does: `ModelMemory.from_dir(path)` reads a model directory (config.json and the size of its
weight files; nothing is loaded) into the bytes that matter on a GPU: one copy of the base weights,
KV cache per token, what the trainer keeps per token for the backward, and the LoRA's weights,
gradients and AdamW states. `colocated_fit(model, gpu)` says what a colocated run (gpus.plan_gpus,
"colocated": the server takes `server_share` of the GPU, the trainer the rest) needs with and
without releasing the server's memory around training (RunConfig.release_memory), and
`ColocatedFit.error(...)` words the error a run raises before starting anything when it does not fit.

The arithmetic, per GPU of `total` bytes (W: one copy of the weights; two live there, the server's and
the trainer's):
  - the server's share holds W + KV_HEADROOM_TOKENS of KV cache (fewer tokens only queue requests);
  - without release, the trainer holds W + LoRA + activations of one smallest micro-batch
    (rl.trainer.GPU_MICRO_BATCH_TOKENS[0] tokens, per token as rl.trainer.auto_micro_batch_tokens
    counts them) in what the server's share leaves, less gpus.LAUNCH_RESERVE_MIB (CUDA graphs,
    contexts);
  - with release (KV cache and CUDA graphs given back while the trainer runs), the trainer may use
    all but the server's W and RELEASED_RESERVE_GIB; releasing "weights" too leaves it all but that.

What it does not do: measure anything, read the GPU (gpus.list_gpus does), or account for
quantised or MoE checkpoints beyond the size of their files. It errs large: an activation estimate
that is a third above what a Llama layer keeps.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .gpus import COLOCATED_MEM_FRACTION, LAUNCH_RESERVE_MIB, GpuInfo

GIB = 2**30
KV_HEADROOM_TOKENS = 16384
"""KV cache the server needs beside its weights: a step of 16 x 8 samples of ~128 tokens at once."""
MIN_MICRO_BATCH_TOKENS = 2048
"""The trainer's smallest micro-batch (rl.trainer.GPU_MICRO_BATCH_TOKENS[0]): out of memory below it, a step fails."""
RELEASED_RESERVE_GIB = 4.0
"""What stays in use while the server's memory is released, beyond the weights and the trainer's
estimate: CUDA contexts, what the released server keeps beside its weights, the allocators' slack.
Measured at 14B on an H100 (299b538, benchmarks/results/20261207-h100-scale-14b-299b538.md): the
update ran out of memory with 3.0 GiB of that in use (the server 1.55 GiB beyond its 25.6 GiB of
weights, the trainer's context 0.7 GiB and 0.75 GiB reserved but unallocated) before its
micro-batch peaked; 2.0 had called that run a fit by 0.4 GiB."""
LORA_TARGETS = 7  # q, k, v, o, gate, up, down (rl.trainer.LORA_TARGETS)
ADAMW_BYTES_PER_PARAM = 16  # fp32 weight, gradient and two moments


class ModelTooLargeError(RuntimeError):
    """A model does not fit the GPU(s) as planned; the message names the memory needed and what to change."""


@dataclass(frozen=True)
class ModelMemory:
    """A dense decoder's GPU memory, in bytes, as its directory describes it."""

    weights: int
    """One copy of the base weights (their files' size)."""
    kv_per_token: int
    """KV cache per token, bf16: 2 x layers x KV heads x head dim x 2."""
    activations_per_token: int
    """What the trainer keeps per token for the backward, bf16 (fused logprobs: no logits)."""
    lora: int
    """The LoRA's weights, gradients and AdamW states (fp32) at the run's rank."""

    @classmethod
    def from_dir(cls, path: str | Path, lora_rank: int = 16) -> "ModelMemory | None":
        """The estimate for a model directory; None when `path` is not one (a hub id, a name to build)."""
        path = Path(path)
        if not (path / "config.json").is_file():
            return None
        cfg = json.loads((path / "config.json").read_text())
        text = cfg.get("text_config") or cfg
        h, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads, head_dim = int(text.get("num_key_value_heads") or heads), int(text.get("head_dim") or h // heads)
        mlp = int(text.get("intermediate_size") or 4 * h)
        lora_in_out = (h + heads * head_dim) * 2 + (h + kv_heads * head_dim) * 2 + (h + mlp) * 3
        return cls(weights=_weights_bytes(path, text, h, layers, heads, kv_heads, head_dim, mlp),
                   kv_per_token=2 * layers * kv_heads * head_dim * 2,
                   activations_per_token=layers * (h * 10 + mlp * 6) * 2,
                   lora=lora_rank * lora_in_out * layers * ADAMW_BYTES_PER_PARAM)


def _weights_bytes(path: Path, text: dict, h, layers, heads, kv_heads, head_dim, mlp) -> int:
    """The checkpoint's own count (safetensors index), else its files' size, else bf16 from the shape."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if total:
            return int(total)
    files = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    if files:
        return files
    vocab = int(text.get("vocab_size") or 32000)
    per_layer = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 3 * h * mlp
    return 2 * (layers * per_layer + vocab * h * (1 if text.get("tie_word_embeddings") else 2))


@dataclass(frozen=True)
class ColocatedFit:
    """What one shared GPU must hold for a model, in GiB, and whether it does."""

    gpu_gib: float
    weights_gib: float
    server_gib: float
    """The server's share must hold this: weights + KV headroom."""
    server_share_gib: float
    trainer_gib: float
    """The trainer at its smallest micro-batch: weights + LoRA/AdamW + activations."""
    together_gib: float
    """The GPU memory the run needs without release."""
    released_gib: float
    """... with the server's KV cache and CUDA graphs released around training."""
    released_weights_gib: float
    """... with its weights released too (release_tags with "weights")."""

    @property
    def server_fits(self) -> bool:
        return self.server_gib <= self.server_share_gib

    def fits(self, release: bool, weights_released: bool = False) -> bool:
        need = (self.released_weights_gib if weights_released else self.released_gib) if release else self.together_gib
        return self.server_fits and need <= self.gpu_gib

    def describe(self) -> str:
        return (f"{self.gpu_gib:.1f} GiB GPU: server {self.server_gib:.1f} GiB (weights {self.weights_gib:.1f} + KV) in "
                f"its {self.server_share_gib:.1f} GiB share; trainer {self.trainer_gib:.1f} GiB (weights + LoRA/AdamW + "
                f"activations of {MIN_MICRO_BATCH_TOKENS} tokens); needed {self.together_gib:.1f} GiB with both resident, "
                f"{self.released_gib:.1f} GiB with release_memory, {self.released_weights_gib:.1f} GiB releasing weights too")

    def error(self, release: bool, weights_released: bool, model: str) -> ModelTooLargeError:
        """Why `model` does not fit as configured, and the setting to change."""
        if not self.server_fits:
            fix = ("a GPU with more memory, 2+ GPUs (the split plan gives the server a GPU of its own; server_tp "
                   "for a model one GPU cannot hold) or a smaller model")
        elif not release and self.fits(True):
            fix = "release_memory='if_needed' (the default) or True"
        elif not release and self.fits(True, True):
            fix = ("release_memory='if_needed' (the default: it releases the server's weights too here), or True "
                   "with release_tags=('kv_cache', 'cuda_graph', 'weights')")
        elif not weights_released and self.fits(True, True):
            fix = "release_memory=True with release_tags=('kv_cache', 'cuda_graph', 'weights')"
        else:
            fix = "2+ GPUs (split plan), a GPU with more memory, or a smaller model"
        return ModelTooLargeError(f"{model} does not fit one GPU shared by the server and the trainer: "
                                  f"{self.describe()}. Try: {fix}.")


def colocated_fit(model: ModelMemory, gpu: GpuInfo, server_share: float = COLOCATED_MEM_FRACTION,
                  micro_batch_tokens: int | None = None) -> ColocatedFit:
    """The estimate for `model` colocated on `gpu` (see the module docstring for the arithmetic)."""
    total = gpu.mem_total_mib * 2**20
    w = model.weights
    server = w + KV_HEADROOM_TOKENS * model.kv_per_token
    trainer = w + model.lora + model.activations_per_token * (micro_batch_tokens or MIN_MICRO_BATCH_TOKENS)
    share = server_share * total
    launch, released = LAUNCH_RESERVE_MIB * 2**20, RELEASED_RESERVE_GIB * GIB
    together = max(share, server) + trainer + launch
    rollout = max(share, server) + (w + model.lora) + launch  # with release: the trainer idle during rollouts
    return ColocatedFit(gpu_gib=total / GIB, weights_gib=w / GIB, server_gib=server / GIB, server_share_gib=share / GIB,
                        trainer_gib=trainer / GIB, together_gib=together / GIB,
                        released_gib=max(rollout, w + trainer + released) / GIB,
                        released_weights_gib=max(rollout, trainer + released) / GIB)


