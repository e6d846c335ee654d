"""Build small Qwen2 models offline, deterministically, in Hugging Face format.

What it does: trains a byte-level BPE tokenizer (the `tokenizers` library) on text this package
generates — task transcripts from `tasks/registry.py` plus generic synthetic prose, numbers and code — and
writes a Qwen2ForCausalLM with seeded random weights next to it: config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json (PreTrainedTokenizerFast with a ChatML
chat template, eos `<|im_end|>`, pad `<|endoftext|>`). Two sizes:

- `tiny` (CI, CPU): hidden 64, 2 layers, 4 heads of dim 16, 2 KV heads, MLP 128, tied embeddings,
  fp32, 0.2 M params.
- `0.5b` (GPU benchmarks): Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads of dim 64, 2 KV
  heads, MLP 4864, tied embeddings, rope θ 1e6, 32768 positions), bf16, random weights written
  straight from a seeded generator (no model materialised). Vocab is our tokenizer's 2048 tokens
  (a multiple of 64, so no padding rows), not Qwen's 151936: ~0.36 B params.

Every size and seed shares one tokenizer (trained from a fixed seed), so token ids are the same
everywhere: `<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2.

Pretraining (`pretrain_steps > 0`): supervised, on CPU (AdamW, one thread, loss on the model's
own tokens only), on transcripts of the package's tasks played by scripted teachers
(`tasks.pretraining_corpus`): first clean and without system prompts (skills), then with the
real prompts and a teacher that makes one systematic mistake half the time (see PRETRAIN_PHASES):
it answers the sum in a sentence, which the checker scores 0, or guesses a price without looking
it up. The model learns the skills and the mistake, so GRPO starts from moderate rewards and can
raise them by unlearning the mistake, a decision at the reply's first token.

Default: DEFAULT_PRETRAIN_STEPS["tiny"] = 800 steps of 16 transcripts, ~23 s on one core of the
2-core dev box (~29 s for the whole build). Measured there at temperature 1, seed 0: `addition`
reward ~0.3-0.4 and `price_lookup` ~0.5 (half the replies skip the lookup; after a lookup the
price is right ~90% of the time). `python -m artsg_nb.train` with 8x8 samples per step, lr 3e-3,
rank-16 LoRA took them to ~0.85-0.9 within 10 steps. Near-miss mistakes (an earlier recipe)
barely moved in 20 steps: each question needs its own correction, and the tiny model learns
that slowly. Fewer pretraining steps are not safe: the skills appear suddenly somewhere after
~300-600 clean steps, and a random model scores ~0 on both tasks (all-zero groups give GRPO
nothing to learn from). `0.5b` defaults to 0: random weights, for measuring serving speed on a GPU.

The default build (tiny, seed 0, 800 pretraining steps) is shipped with the package, in
`shipped/tiny-s0-p800/` (~0.95 MB) next to a sha256sum list of its files: the weights a build
produces depend on the CPU (the float arithmetic of pretraining differs between CPUs), so a model
built on each machine would make tests, the demo and the notebooks sample differently from one
machine to the next. `default_model_dir()` returns the shipped copy; other sizes, seeds and step
counts are built into the cache. After an edit to this file or tasks/registry.py (the recipe),
`python -m artsg_nb.models tiny --ship` rebuilds it; tests/test_tiny_model.py fails until then.

A build goes to a temporary sibling directory, `.complete` is written last and the directory is
renamed into place, so a crashed build is never mistaken for a finished one. `.complete` records
size, seed, steps and a hash of this file and tasks/registry.py: a directory with the same record is
returned as is, one with another record (an older recipe, another size) is rebuilt.

What it does not do: download anything, or produce a model that is good at anything but the
package's own tasks.

    python -m artsg_nb.models tiny OUT_DIR [--size tiny|0.5b] [--seed 0] [--pretrain-steps N]
    python -m artsg_nb.models tiny --ship      # rebuild the shipped default and its sha256 list
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:  # transformers is imported where used: see trainer.py (Unsloth patches it first on a GPU)
    from transformers import PreTrainedTokenizerFast, Qwen2Config

from ..tasks import registry as tasks
from .build import build_into, is_complete

log = logging.getLogger(__name__)

CHAT_EOS = "<|im_end|>"
CHAT_BOS = "<|im_start|>"
PAD = "<|endoftext|>"
SPECIAL_TOKENS = [PAD, CHAT_BOS, CHAT_EOS]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
VOCAB_SIZE = 2048
TOKENIZER_SEED = 0
# Qwen2's pre-tokenizer split: digits one by one, so numbers are spelled digit by digit.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
DEFAULT_PRETRAIN_STEPS = {"tiny": 800, "0.5b": 0}
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=1e6,
                 dtype="float32"),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=32768, rope_theta=1e6,
                 dtype="bfloat16"),
}
_OUR_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", ".complete"}


# ---- tokenizer -------------------------------------------------------------------------------
_WORDS = """the a an of to in and or is are was be it that this for on with as at by from not no
yes you we they he she i my your our their model number answer reply guess turn game agent tool
call result value list count sum add plus minus times what which when where why how one two three
four five six seven eight nine ten first last next more less higher lower correct wrong left right
up down start end step score reward policy train sample prompt token text data file line code run
test server cache prefix batch group loss rate time good bad new old big small keep find give make
take go see say use try read write open close please thanks hello world question user assistant
system example because then than so if else while return true false none print input output""".split()


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(1, 3)))


def _synthetic_text(n_lines: int, rng: random.Random) -> list[str]:
    """Generic prose (real and made-up words), arithmetic, lists and code."""
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) if rng.random() < 0.7 else _pseudo_word(rng) for _ in range(rng.randint(4, 14))]
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","]))
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"{a} {rng.choice('+-*/=<>')} {b} = {a + b}; ({words[0]}) [{a}, {b}]")
        elif kind == 2:
            lines.append(f'def {words[0]}_{words[1]}(x): return {{"{words[2]}": x + {rng.randint(0, 99)}}}')
        else:
            lines.append("- " + ", ".join(words) + "\n")
    return lines


def _tokenizer_corpus() -> list[str]:
    rng = random.Random(TOKENIZER_SEED)
    task_text = [f"{m['role']}\n{m['content']}" for conv in tasks.pretraining_corpus(400, TOKENIZER_SEED)
                 for m in conv]
    return task_text + _synthetic_text(20_000, rng)


def train_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with VOCAB_SIZE tokens, as a transformers PreTrainedTokenizerFast."""
    from transformers import PreTrainedTokenizerFast


    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, f"BPE stopped at {tok.get_vocab_size()} tokens: corpus too small"
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=CHAT_EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE, model_max_length=32768,
                                   clean_up_tokenization_spaces=False)


# ---- model config and weights ----------------------------------------------------------------
def model_config(size: str, vocab_size: int = VOCAB_SIZE) -> Qwen2Config:
    """The Qwen2Config of a size (token ids as written by `train_tokenizer`)."""
    from transformers import Qwen2Config


    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known sizes: {', '.join(SIZES)}")
    pad, eos = SPECIAL_TOKENS.index(PAD), SPECIAL_TOKENS.index(CHAT_EOS)
    return Qwen2Config(vocab_size=vocab_size, tie_word_embeddings=True, rms_norm_eps=1e-6,
                       bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
                       architectures=["Qwen2ForCausalLM"], **SIZES[size])


def random_weights(config: Qwen2Config, seed: int) -> dict[str, torch.Tensor]:
    """Seeded N(0, initializer_range) matrices, unit norms, zero biases, in config.dtype.

    Shapes come from a model on the meta device, so nothing is materialised twice; tied
    lm_head weights are left out, as in Qwen's own checkpoints."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Qwen2ForCausalLM(config).named_parameters()}
    dtype = getattr(torch, str(config.dtype).removeprefix("torch."))
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=dtype)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, config.initializer_range, generator=gen)
        weights[name] = t
    return weights


# ---- pretraining -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """One stage of pretraining."""

    share: float
    """Fraction of the pretraining steps."""
    noise: float
    """Teacher's mistake rate (`tasks.pretraining_corpus`)."""
    system_prompt: bool
    """Keep system prompts; without them transcripts are ~10x shorter and skills appear sooner."""
    mix: tuple[str, ...] | None = None
    """Task names taken in turn (None: every task)."""


# Skills first, on clean transcripts without system prompts (~30 tokens): there a 2-layer model
# learns to add and to copy an item and a price within a few hundred steps; behind a 200-token
# system prompt it barely learns them at all (hence price_lookup's short one). Then the real
# prompts and a teacher that errs half the time: the skills carry over, and the sampled policy
# picks up the teacher's one mistake, which GRPO removes.
PRETRAIN_TASKS = ("addition", "price_lookup")  # guess_number is beyond the tiny model (see tasks/registry.py)
PRETRAIN_PHASES = (Phase(share=0.6, noise=0.0, system_prompt=False, mix=PRETRAIN_TASKS),
                   Phase(share=0.4, noise=0.5, system_prompt=True, mix=PRETRAIN_TASKS))
PRETRAIN_BATCH = 16
PRETRAIN_LR = 3e-3


def encode_transcript(tokenizer, messages: tasks.Messages, cache: dict | None = None) -> tuple[list[int], list[int]]:
    """Token ids of a chat transcript and a mask that is 1 on the tokens the model produces.

    Each assistant turn is encoded as the rollout sees it: the prompt up to
    `<|im_start|>assistant\\n`, then the reply and `<|im_end|>` (mask 1), then `\\n`. `cache`
    (text -> ids) saves re-encoding the pieces transcripts share."""
    cache = {} if cache is None else cache
    ids, mask = [], []

    def add(text: str, m: int) -> None:
        if text not in cache:
            cache[text] = tokenizer.encode(text, add_special_tokens=False)
        ids.extend(cache[text])
        mask.extend([m] * len(cache[text]))

    for msg in messages:
        if msg["role"] == "assistant":
            add(f"{CHAT_BOS}assistant\n", 0)
            add(f"{msg['content']}{CHAT_EOS}", 1)
            add("\n", 0)
        else:
            add(f"{CHAT_BOS}{msg['role']}\n{msg['content']}{CHAT_EOS}\n", 0)
    return ids, mask


def _batches(examples: list[tuple[list[int], list[int]]], keys: list, batch_size: int, rng: random.Random):
    """Padded (input_ids, labels) batches in random order; labels are -100 where there is no loss.

    A batch holds examples of one key (one system prompt, or none): no short transcript padded to a
    long prompt, and a shared prefix to compute once. Within a key rows are random, never sorted by
    length: batches of one answer length or one choice would swing the policy from batch to batch."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    chunks = []
    for key in sorted(groups, key=str):
        rng.shuffle(groups[key])
        chunks += [groups[key][i:i + batch_size] for i in range(0, len(groups[key]), batch_size)]
    rng.shuffle(chunks)
    for chunk in chunks:
        yield _pad([examples[i] for i in chunk])


def _pad(rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(seq) for seq, _ in rows)
    ids = torch.full((len(rows), width), SPECIAL_TOKENS.index(PAD), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for row, (seq, mask) in enumerate(rows):
        ids[row, :len(seq)] = torch.tensor(seq)
        labels[row, :len(seq)] = torch.tensor([t if m else -100 for t, m in zip(seq, mask)])
    return ids, labels


def _common_prefix_len(ids: torch.Tensor) -> int:
    same = (ids == ids[:1]).all(dim=0).long()  # (T,) 1 where every row has row 0's token
    return int(same.cumprod(0).sum())


def _hidden_states(model, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, H) last hidden states. A prefix shared by every row (a task's system
    prompt) is computed once and its KV cache repeated, ~3x faster than B copies."""
    shared = min(_common_prefix_len(ids), ids.shape[1] - 1)
    if shared < 16 or ids.shape[0] == 1:
        return model.model(input_ids=ids).last_hidden_state
    prefix = model.model(input_ids=ids[:1, :shared], use_cache=True)
    prefix.past_key_values.batch_repeat_interleave(ids.shape[0])
    rest = model.model(input_ids=ids[:, shared:], past_key_values=prefix.past_key_values, use_cache=True)
    return torch.cat([prefix.last_hidden_state.expand(ids.shape[0], -1, -1), rest.last_hidden_state], dim=1)


def _assistant_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on labelled positions only: the LM head runs on those few rows
    instead of all B·T (on a ~300-token transcript with a 2-token answer that is most of the cost)."""
    hidden = _hidden_states(model, ids)  # (B, T, H)
    target = labels[:, 1:]  # (B, T-1): token t+1 is predicted from position t
    keep = target != -100
    logits = model.lm_head(hidden[:, :-1][keep])  # (N, V)
    return torch.nn.functional.cross_entropy(logits.float(), target[keep])


def pretrain(model, tokenizer, steps: int, seed: int, phases: tuple[Phase, ...] = PRETRAIN_PHASES,
             batch_size: int = PRETRAIN_BATCH, lr: float = PRETRAIN_LR) -> list[float]:
    """`steps` AdamW steps on fresh task transcripts, phase after phase. Returns the losses.

    Runs on one thread: ops this small are faster that way, and a rerun on the same machine gives
    the same weights (another CPU may not: its float kernels round differently, which is why the
    default build is shipped). Nothing in it draws from torch's RNG (no dropout)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batches = [b for i, phase in enumerate(phases) for b in _phase_batches(tokenizer, phase, steps, seed * 100 + i,
                                                                             batch_size)]
        return _train(model, batches, lr)
    finally:
        torch.set_num_threads(threads)


def _phase_batches(tokenizer, phase: Phase, steps: int, seed: int, batch_size: int) -> list:
    n = round(steps * phase.share)
    corpus = tasks.pretraining_corpus(n * batch_size, seed, phase.mix, phase.noise)
    if not phase.system_prompt:
        corpus = [[m for m in conv if m["role"] != "system"] for conv in corpus]
    cache: dict = {}
    examples = [encode_transcript(tokenizer, conv, cache) for conv in corpus]
    keys = [conv[0]["content"] if conv[0]["role"] == "system" else None for conv in corpus]
    return list(_batches(examples, keys, batch_size, random.Random(seed)))


def _train(model, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> list[float]:
    """One AdamW run with linear warm-up and cosine decay; the padding (on the right) has no loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    steps, warmup = len(batches), max(1, len(batches) // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / steps))))
    model.train()
    losses = []
    for ids, labels in batches:
        loss = _assistant_loss(model, ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def _pretrained_weights(config, weights: dict, tokenizer, steps: int, seed: int) -> dict[str, torch.Tensor]:
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    t0 = time.perf_counter()
    losses = pretrain(model, tokenizer, steps, seed)
    log.info("pretrained %d steps in %.1f s, loss %.3f -> %.3f", steps, time.perf_counter() - t0,
             losses[0], sum(losses[-10:]) / len(losses[-10:]))
    return {name: p.detach().contiguous() for name, p in model.named_parameters()}


# ---- build -----------------------------------------------------------------------------------
def _marker(size: str, seed: int, pretrain_steps: int) -> dict:
    """What a build depends on, written to `.complete`; a directory with another marker is rebuilt.
    `recipe` hashes what the weights depend on: this file and the text the tokenizer and the
    pretraining are fed (`corpus_digest`), not the rest of tasks/registry.py, so an edit to the Task
    API leaves every build valid, and an edit to an example task's envs or teachers rebuilds cached
    models (~25 s)."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + corpus_digest(seed, pretrain_steps).encode())
    return {"size": size, "seed": seed, "pretrain_steps": pretrain_steps, "recipe": digest.hexdigest()[:16]}


@functools.lru_cache(maxsize=8)
def corpus_digest(seed: int, pretrain_steps: int) -> str:
    """sha256 of every conversation a build of (`seed`, `pretrain_steps`) trains its tokenizer and
    weights on (`_tokenizer_corpus`, each PRETRAIN_PHASES phase's `tasks.pretraining_corpus`, as
    `_phase_batches` draws them)."""
    h = hashlib.sha256(json.dumps(_tokenizer_corpus()).encode())
    for i, phase in enumerate(PRETRAIN_PHASES):
        n = round(pretrain_steps * phase.share) * PRETRAIN_BATCH
        h.update(json.dumps([phase.system_prompt, tasks.pretraining_corpus(n, seed * 100 + i, phase.mix, phase.noise)],
                            sort_keys=True).encode())
    return h.hexdigest()


def is_tiny_build(out_dir) -> bool:
    """Whether `out_dir` holds a finished build of this module (any size or recipe), not another
    model that also keeps a `.complete` marker (artsg_nb.models.pretrained writes one too)."""
    try:
        return {"size", "pretrain_steps"} <= set(json.loads((Path(out_dir) / ".complete").read_text()))
    except (OSError, ValueError, TypeError):
        return False


def _write_model(tmp: Path, size: str, seed: int, pretrain_steps: int) -> None:
    from transformers import GenerationConfig

    tokenizer = train_tokenizer()
    config = model_config(size, len(tokenizer))
    weights = random_weights(config, seed)
    if pretrain_steps > 0:
        weights = _pretrained_weights(config, weights, tokenizer, pretrain_steps, seed)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    # Plain sampling by default. top_k = vocab size, not 0: transformers would otherwise apply
    # top_k=50, and SGLang (which reads these defaults) rejects top_k=0.
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id, do_sample=True, temperature=1.0, top_p=1.0,
                     top_k=config.vocab_size).save_pretrained(tmp)
    _save_tokenizer(tokenizer, tmp)


def _save_tokenizer(tokenizer, out_dir: Path) -> None:
    """save_pretrained, then name the class and embed the chat template in tokenizer_config.json
    the way older transformers (and engines pinned to them) read it."""
    tokenizer.save_pretrained(out_dir)
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def _clear_partial(out_dir: Path) -> None:
    """Remove an unfinished or outdated build, refusing to delete anything this module did not write."""
    foreign = [p.name for p in out_dir.iterdir() if p.name not in _OUR_FILES]
    if foreign:
        raise FileExistsError(f"{out_dir} holds an unfinished or outdated build and other files "
                              f"({', '.join(sorted(foreign))}); pick an empty or new directory")
    shutil.rmtree(out_dir)


def build_tiny_model(out_dir, size: Literal["tiny", "0.5b"] = "tiny", seed: int = 0,
                     pretrain_steps: int = 0) -> Path:
    """Build the model into `out_dir` (a no-op when a complete build by this recipe is there)."""
    out_dir = Path(out_dir).expanduser().resolve()
    marker = _marker(size, seed, pretrain_steps)
    if is_complete(out_dir, marker):
        return out_dir
    model_config(size)  # fail on a bad size before any work
    if out_dir.exists():
        _clear_partial(out_dir)
    return build_into(out_dir, marker, lambda tmp: _write_model(tmp, size, seed, pretrain_steps), f"{size} model")


SHIPPED_DIR = Path(__file__).parent / "shipped" / "tiny-s0-p800"
SHIPPED_SUMS = SHIPPED_DIR.with_name(SHIPPED_DIR.name + ".sha256")  # `sha256sum -c` format, one line per file


def shipped_marker() -> dict:
    """The `.complete` record of the shipped build: its size, seed, steps and recipe."""
    return json.loads((SHIPPED_DIR / ".complete").read_text())


def file_sums(out_dir: Path) -> dict[str, str]:
    """sha256 of every file of a build, by name (`.complete` included)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(out_dir).iterdir()) if p.is_file()}


def ship() -> Path:
    """Rebuild the shipped default (a no-op when it is by the current recipe) and its sha256 list."""
    out = build_tiny_model(SHIPPED_DIR, "tiny", 0, DEFAULT_PRETRAIN_STEPS["tiny"])
    SHIPPED_SUMS.write_text("".join(f"{digest}  {name}\n" for name, digest in file_sums(out).items()))
    return out


def cache_root() -> Path:
    """$ARTSG_CACHE, else ~/.cache/artsg_nb."""
    return Path(os.environ.get("ARTSG_CACHE") or Path.home() / ".cache" / "artsg_nb").expanduser()


def default_model_dir(size: Literal["tiny", "0.5b"] = "tiny", pretrain_steps: int | None = None,
                      seed: int = 0) -> Path:
    """The shipped build (SHIPPED_DIR) when it is the one asked for, else the cached build
    <cache_root>/models/<size>-s<seed>-p<steps>, built on first use.

    `pretrain_steps=None` takes DEFAULT_PRETRAIN_STEPS[size]. The shipped build is returned even
    when the recipe has changed since it was built: the same weights everywhere matter more than a
    rebuild that differs per CPU (tests/test_tiny_model.py says when to run --ship)."""
    steps = DEFAULT_PRETRAIN_STEPS[size] if pretrain_steps is None else pretrain_steps
    wanted = _marker(size, seed, steps)
    if is_complete(SHIPPED_DIR) and {**shipped_marker(), "recipe": wanted["recipe"]} == wanted:
        return SHIPPED_DIR
    return build_tiny_model(cache_root() / "models" / f"{size}-s{seed}-p{steps}", size, seed, steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m artsg_nb.models tiny", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path, nargs="?", help="where to build (not with --ship)")
    p.add_argument("--ship", action="store_true", help=f"rebuild the shipped default in {SHIPPED_DIR}")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pretrain-steps", type=int, default=None,
                   help="supervised steps on task transcripts (default: %s)" % DEFAULT_PRETRAIN_STEPS)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.ship == (a.out_dir is not None):
        p.error("give OUT_DIR or --ship")
    if a.ship:
        print(ship())
        return 0
    steps = DEFAULT_PRETRAIN_STEPS[a.size] if a.pretrain_steps is None else a.pretrain_steps
    print(build_tiny_model(a.out_dir, a.size, a.seed, steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
