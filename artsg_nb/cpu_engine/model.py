"""The CPU engine's model: a transformers causal LM with PEFT LoRA adapters loaded by id.

What it does: loads the base model (float32, CPU) and its tokenizer; checks an adapter directory
against the server's LoRA limits before anything is loaded (safetensors only, rank, target
modules, no DoRA, no added tokens); loads and deletes adapters under their load id; runs one
forward pass over a batch whose rows may each use a different adapter (PEFT's mixed-adapter
batches, `adapter_names=[...]`, "__base__" for the base model), continuing from a KV cache.

What it deliberately does not do: schedule, sample or cache anything (scheduler.py
does), quantise, use CUDA, shard weights, or merge adapters into the base weights. Every method
that touches the model must be called from the one scheduler thread.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

log = logging.getLogger(__name__)

ALL_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS_FILE = "adapter_model.safetensors"
_LORA_A = re.compile(r"\.lora_(?:embedding_)?A(?:\.|$)")
_LORA_B = re.compile(r"\.lora_B(?:\.|$)")


ATTN_IMPLEMENTATION = "artsg_cpu_sdpa"


def cpu_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention without its K/V repeat when a mask is given.

    transformers only lets torch's sdpa handle grouped-query attention when there is no mask
    (a CUDA kernel limit); otherwise it copies K and V once per head group, per layer, per step.
    On CPU, torch takes GQA and a mask together, and a decode batch of left-padded rows always
    has a mask: this made such a step ~3x faster. query: (B, heads, q, d); key/value: (B, kv_heads, k, d).
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = q_len > 1 and attention_mask is None and (is_causal if is_causal is not None
                                                       else getattr(module, "is_causal", True))
    if causal and kv_len > q_len:  # as transformers does: is_causal aligns upper-left
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, cpu_sdpa_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


class AdapterError(ValueError):
    """An adapter directory the server refuses to load; the message says why and what to do."""


@dataclass(frozen=True)
class AdapterInfo:
    """What `check_adapter_dir` read from an adapter directory."""

    path: str
    rank: int
    target_modules: tuple[str, ...]


def check_adapter_dir(path: str, max_rank: int, allowed_modules: tuple[str, ...]) -> AdapterInfo:
    """Validate a PEFT LoRA directory against the server's limits; raise AdapterError if not."""
    root = Path(path)
    if not root.is_dir():
        raise AdapterError(f"LoRA adapter path {path} is not a directory (does it exist?)")
    config_file = root / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"{path} has no adapter_config.json; save the adapter with PEFT's save_pretrained")
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        has_pickle = (root / "adapter_model.bin").is_file()
        raise AdapterError(
            f"{path} has no {WEIGHTS_FILE}" + (" (only a pickle adapter_model.bin)" if has_pickle else "")
            + "; the CPU engine loads safetensors only: save with save_pretrained(safe_serialization=True)")
    try:
        config = json.loads(config_file.read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"{config_file} is not valid JSON ({e}); save the adapter again with "
                           "PEFT's save_pretrained") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path} is a {config.get('peft_type')} adapter; only LoRA is supported")
    if config.get("use_dora"):
        raise AdapterError(f"{path} is a DoRA adapter (use_dora=true); DoRA is not supported")
    if config.get("modules_to_save") or config.get("trainable_token_indices") or (root / "added_tokens.json").exists():
        raise AdapterError(f"{path} trains extra modules or added tokens (modules_to_save / "
                           "trainable_token_indices / added_tokens.json); only plain LoRA weights are supported")
    _check_every_weights_file(root, weights)
    rank, modules = _lora_shapes(weights)
    if not modules:
        raise AdapterError(f"{path}/{WEIGHTS_FILE} holds no lora_A/lora_B weights")
    if rank > max_rank:
        raise AdapterError(f"LoRA rank {rank} of {path} exceeds --max-lora-rank {max_rank}; "
                           "restart the server with a larger --max-lora-rank or train a smaller rank")
    extra = sorted(set(modules) - set(allowed_modules))
    if extra:
        raise AdapterError(f"{path} targets modules {extra} that are not in --lora-target-modules "
                           f"{list(allowed_modules)}; restart the server with them (or 'all')")
    return AdapterInfo(path=str(path), rank=rank, target_modules=tuple(sorted(modules)))


def _check_every_weights_file(root: Path, weights: Path) -> None:
    """SGLang reads every *.safetensors file at the top of an adapter folder as weights
    (DefaultModelLoader's glob), so one that cannot be read there (half written, garbage) fails its
    load; the CPU engine refuses such a folder too, where SGLang's error would come."""
    for other in sorted(root.glob("*.safetensors")):
        if other == weights:
            continue
        try:
            with safe_open(str(other), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 — SafetensorError: a truncated or garbage file
            raise AdapterError(f"{other} is not a readable safetensors file ({type(e).__name__}: {e}); SGLang "
                               "reads every *.safetensors file of an adapter folder as weights: keep only the "
                               "adapter's there") from e


def _lora_shapes(weights: Path) -> tuple[int, set[str]]:
    """(largest rank, short names of the targeted modules) read from the safetensors header."""
    try:
        return _read_lora_shapes(weights)
    except AdapterError:
        raise
    except Exception as e:  # SafetensorError: a truncated or garbage file
        raise AdapterError(f"{weights} is not a readable safetensors file ({type(e).__name__}: {e}); "
                           "save the adapter again (save_pretrained(safe_serialization=True))") from e


def _read_lora_shapes(weights: Path) -> tuple[int, set[str]]:
    rank, modules = 0, set()
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            found = _LORA_A.search(key)
            if found:
                shape = f.get_slice(key).get_shape()  # lora_A: (r, in); lora_embedding_A: (r, vocab)
                rank = max(rank, shape[0])
                modules.add(key[:found.start()].rsplit(".", 1)[-1])
            elif ".lora_" not in key:
                raise AdapterError(f"{weights} holds a non-LoRA tensor {key} (e.g. resized embeddings); "
                                   "only plain LoRA weights are supported")
    return rank, modules


class ModelRunner:
    """Owns the model, its adapters and the tokenizer; runs forward passes (one thread only)."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._tokenizer_lock = threading.Lock()  # the HTTP threads and the scheduler both decode
        # Prompts are encoded by a tokenizer of their own: a long prompt tokenised in an HTTP
        # thread then never holds up the decoding that the scheduler and the responses do.
        self._encoder = AutoTokenizer.from_pretrained(model_path)
        self._encoder_lock = threading.Lock()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                          attn_implementation=ATTN_IMPLEMENTATION).eval()
        self.config = self.model.config
        self.peft: PeftModel | None = None  # created by the first adapter load
        self.context_len = int(getattr(self.config, "max_position_embeddings", 2048))
        # No token covers more characters than the longest vocabulary entry (byte-level BPE: one
        # vocabulary character per byte), so a text longer than context_len × this cannot fit and
        # is refused before it is tokenised (a 1e6-character prompt left ~125 MB resident).
        self.max_token_chars = max(len(t) for t in self._encoder.get_vocab())
        self.eos_ids = self._eos_ids()

    # ---- tokenizer -----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        with self._encoder_lock:
            return self._encoder.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id decoded on its own (what OpenAI-style logprobs show as `token`)."""
        with self._tokenizer_lock:
            return [self.tokenizer.decode([i]) for i in ids]

    def render_chat(self, messages: list[dict]) -> list[int]:
        with self._encoder_lock:
            text = self._encoder.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self._encoder.encode(text, add_special_tokens=False)

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            ids.update(source if isinstance(source, (list, tuple)) else [source])
        return frozenset(i for i in ids if i is not None)

    # ---- adapters ------------------------------------------------------------------------
    def check_adapter_shapes(self, path: str) -> None:
        """AdapterError naming the first LoRA tensor whose shape does not fit the module it
        adapts (lora_A: (r, in_features), lora_B: (out_features, r)) or whose module this model
        lacks: such an adapter would load, then fail every request that uses it."""
        weights = Path(path) / WEIGHTS_FILE
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():
                found = _LORA_A.search(key) or _LORA_B.search(key)
                if not found or "lora_embedding" in key:  # embeddings: checked by PEFT's own load
                    continue
                module_name = key[:found.start()].removeprefix("base_model.model.")
                try:
                    module = self.model.get_submodule(module_name)
                except AttributeError:
                    raise AdapterError(f"{weights}: tensor {key} adapts {module_name}, which this model "
                                       f"({self.model_path}) does not have; train the adapter on this base model") from None
                out_f, in_f = module.weight.shape[:2]
                shape = tuple(f.get_slice(key).get_shape())
                ok = shape[1] == in_f if "lora_A" in key else shape[0] == out_f
                if len(shape) != 2 or not ok:
                    want = f"(r, {in_f})" if "lora_A" in key else f"({out_f}, r)"
                    raise AdapterError(f"{weights}: tensor {key} has shape {list(shape)}, but {module_name} of "
                                       f"{self.model_path} needs {want}; the adapter was trained on another "
                                       "base model (or another size): train it on this one")

    def load_adapter(self, path: str, adapter_id: str) -> None:
        """Load a checked adapter directory under `adapter_id` (its load id)."""
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.model, path, adapter_name=adapter_id)
        else:
            self.peft.load_adapter(path, adapter_name=adapter_id)
            if self.peft.active_adapter not in self.peft.peft_config:
                self.peft.set_adapter(adapter_id)  # the previous active adapter was deleted
        self.peft.eval()

    def delete_adapter(self, adapter_id: str) -> None:
        if self.peft is not None and adapter_id in self.peft.peft_config:
            self.peft.delete_adapter(adapter_id)

    # ---- forward -------------------------------------------------------------------------
    def split_kv(self, kv: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(layers, 2, heads, n, head_dim) → per layer (1, heads, n, head_dim) k and v (n may be 0)."""
        if kv is None:
            c = self.config
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            empty = torch.zeros(1, c.num_key_value_heads, 0, head_dim)
            return [(empty, empty)] * c.num_hidden_layers
        return [(layer[0][None], layer[1][None]) for layer in kv]

    def make_cache(self, kv: torch.Tensor | None) -> DynamicCache:
        """A one-row DynamicCache holding a (layers, 2, heads, tokens, head_dim) KV tensor."""
        if kv is None:
            return DynamicCache(config=self.config)
        return DynamicCache(ddp_cache_data=self.split_kv(kv))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache,
                attention_mask: torch.Tensor | None, adapter_ids: list[str | None],
                logits_to_keep: int = 1) -> torch.Tensor:
        """Logits (B, logits_to_keep, V) of the last positions; `cache` grows by S tokens.

        input_ids, position_ids: (B, S); attention_mask: (B, past + S) with 0 on left padding,
        or None when no row is padded; adapter_ids: one load id (or None = base) per row.
        """
        kwargs = dict(input_ids=input_ids, position_ids=position_ids, past_key_values=cache,
                      attention_mask=attention_mask, use_cache=True, logits_to_keep=logits_to_keep)
        if self.peft is None or not self.peft.peft_config:
            assert all(a is None for a in adapter_ids), f"adapters {adapter_ids} are not loaded"
            return self.model(**kwargs).logits.float()
        # PEFT's mixed-adapter batch; cheaper than disable_adapter() even for an all-base batch.
        names = [a if a is not None else "__base__" for a in adapter_ids]
        return self.peft(**kwargs, adapter_names=names).logits.float()
