"""The offline tiny model: the shipped build is the recorded one, by the current recipe; it loads
and generates in transformers; chat template and tokenizer facts, deterministic builds, the
build-directory lifecycle, a LoRA step that leaves the base untouched, and the 0.5b shape (on the
meta device: no weights)."""
import hashlib
import json

import pytest
import torch

from artsg_nb.tasks import registry as tasks
from artsg_nb.models import tiny as tiny_model
from artsg_nb.models.tiny import CHAT_EOS, build_tiny_model, encode_transcript

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_shipped_build_is_the_recorded_one_by_the_current_recipe():
    """Every machine tests the same weights: the committed files are the ones their sha256 list
    records, the config is the tiny size's, and the recipe is this tiny_model.py and tasks.py."""
    listed = {name: digest for digest, name in
              (line.split("  ", 1) for line in tiny_model.SHIPPED_SUMS.read_text().splitlines())}
    assert tiny_model.file_sums(tiny_model.SHIPPED_DIR) == listed, \
        f"{tiny_model.SHIPPED_DIR} differs from {tiny_model.SHIPPED_SUMS.name}; restore it with git checkout"
    cfg = json.loads((tiny_model.SHIPPED_DIR / "config.json").read_text())
    expected = tiny_model.model_config("tiny").to_diff_dict()
    expected.pop("transformers_version")  # which transformers wrote it does not change the model
    assert {k: cfg.get(k) for k in expected} == expected
    marker = tiny_model._marker("tiny", 0, tiny_model.DEFAULT_PRETRAIN_STEPS["tiny"])
    assert tiny_model.shipped_marker() == marker, (
        "tiny_model.py or tasks.py changed since the shipped tiny model was built: rebuild it with "
        "`python -m artsg_nb.models tiny --ship` and commit artsg_nb/models/shipped/")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_files_and_config(tiny_model_dir, model):
    for name in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", ".complete"]:
        assert (tiny_model_dir / name).is_file(), name
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM" and cfg.torch_dtype == torch.float32
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size) == (64, 2, 4, 2, 16, 2048)
    assert sum(p.numel() for p in model.parameters()) < 300_000
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["top_k"] == cfg.vocab_size  # no hidden top-k=50


def test_special_tokens(tiny_tokenizer):
    ids = tiny_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [0, 1, 2]
    assert tiny_tokenizer.eos_token == CHAT_EOS and tiny_tokenizer.eos_token_id == 2
    assert tiny_tokenizer.pad_token == "<|endoftext|>" and tiny_tokenizer.pad_token_id == 0
    assert len(tiny_tokenizer) == 2048


def test_chat_template(tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not tiny_tokenizer.apply_chat_template(messages, tokenize=False).endswith("assistant\n")
    ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == tiny_tokenizer.encode(text, add_special_tokens=False)
    assert ids[-3:] == [1, tiny_tokenizer.convert_tokens_to_ids("assistant"), tiny_tokenizer.encode("\n")[0]]
    batch = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert list(batch["input_ids"]) == ids  # transformers 5: a BatchEncoding unless return_dict=False


def test_encoding_round_trips_task_text(tiny_tokenizer):
    texts = ["", " x ", "a\n\n b\t", "héllo wörld 🙂", "price   fig", "12345678901234567890"]
    for conv in tasks.pretraining_corpus(20, seed=3):
        texts += [m["content"] for m in conv]
    for text in texts:
        assert tiny_tokenizer.decode(tiny_tokenizer.encode(text, add_special_tokens=False)) == text
    assert tiny_tokenizer.tokenize("12 + 345") == ["1", "2", "Ġ+", "Ġ", "3", "4", "5"]  # digits one by one


def test_encode_transcript_agrees_with_chat_template(tiny_tokenizer):
    conv = tasks.pretraining_corpus(2, seed=0, mix=["price_lookup"], noise=0.0)[0]
    ids, mask = encode_transcript(tiny_tokenizer, conv)
    assert ids == tiny_tokenizer.apply_chat_template(conv, tokenize=True, return_dict=False)
    produced = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    replies = [m["content"] for m in conv if m["role"] == "assistant"]
    assert produced == "".join(r + CHAT_EOS for r in replies)


def test_generates_the_sum_bare_or_in_the_teachers_sentence(model, tiny_tokenizer):
    # Pretraining teaches the sums and, from the noisy teacher, the habit GRPO is meant to remove:
    # "The sum is 7." instead of "7" (tasks._addition_teacher).
    right = 0
    for seed in range(20):
        env = tasks.AdditionEnv(seed)
        ids = tiny_tokenizer.apply_chat_template(env.reset(), add_generation_prompt=True, return_dict=False)
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        reply = tiny_tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        bare = reply.removeprefix("The sum is").removesuffix(".")
        assert tasks.parse_int_reply(bare) is not None, f"pretraining should teach the formats, got {reply!r}"
        right += tasks.parse_int_reply(bare) == env.answer
    assert right >= 10, "pretraining should teach most sums (greedy)"


def test_lora_step_changes_only_adapter_weights(tiny_model_dir, tiny_tokenizer):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0.0))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in frozen)
    assert len(lora) == 2 * len(LORA_TARGETS) * 2  # A and B, 7 modules, 2 layers
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.tensor([tiny_tokenizer.encode("What is 2 + 3? 5")])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], w) for n, w in frozen.items()), "base weights must stay bit-identical"
    assert any(not torch.equal(after[n], w) for n, w in lora.items()), "LoRA weights must move"


def test_build_is_deterministic_per_seed(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=1, pretrain_steps=10)
    b = build_tiny_model(tmp_path / "b", seed=1, pretrain_steps=10)
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert _sha256(a / name) == _sha256(b / name), name
    c = build_tiny_model(tmp_path / "c", seed=2, pretrain_steps=10)
    assert _sha256(a / "model.safetensors") != _sha256(c / "model.safetensors")
    assert _sha256(a / "tokenizer.json") == _sha256(c / "tokenizer.json")  # one tokenizer for all


@pytest.fixture
def fake_writes(monkeypatch):
    """Replace the real (slow) model writing; records each call."""
    calls = []

    def write(tmp, size, seed, steps):
        calls.append((size, seed, steps))
        (tmp / "config.json").write_text("{}")

    monkeypatch.setattr(tiny_model, "_write_model", write)
    return calls


def test_rebuild_of_a_complete_dir_is_a_no_op(tmp_path, fake_writes):
    out = build_tiny_model(tmp_path / "m")
    assert (out / ".complete").is_file() and fake_writes == [("tiny", 0, 0)]
    assert build_tiny_model(tmp_path / "m") == out and len(fake_writes) == 1
    build_tiny_model(tmp_path / "m", seed=3)  # another seed: rebuilt in place
    assert fake_writes[-1] == ("tiny", 3, 0)
    assert [p.name for p in tmp_path.iterdir()] == ["m"], "no temporary directories left behind"


def test_partial_dir_is_rebuilt_but_foreign_files_are_kept(tmp_path, fake_writes):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "model.safetensors").write_text("half a file")
    build_tiny_model(partial)
    assert (partial / ".complete").is_file() and not (partial / "model.safetensors").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="notes.txt"):
        build_tiny_model(mine)
    assert (mine / "notes.txt").read_text() == "keep me"


def test_default_model_dir_is_the_shipped_build_and_others_use_the_cache(tmp_path, monkeypatch, fake_writes):
    monkeypatch.setenv("ARTSG_CACHE", str(tmp_path))
    assert tiny_model.default_model_dir() == tiny_model.SHIPPED_DIR and fake_writes == []
    assert tiny_model.default_model_dir("0.5b") == tmp_path / "models" / "0.5b-s0-p0"
    assert tiny_model.default_model_dir(pretrain_steps=5, seed=2) == tmp_path / "models" / "tiny-s2-p5"


def test_unknown_size_fails_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="known sizes"):
        build_tiny_model(tmp_path / "x", size="7b")
    assert not (tmp_path / "x").exists()


def test_0_5b_has_qwen2_5_shape():
    from transformers import Qwen2ForCausalLM

    cfg = tiny_model.model_config("0.5b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == (896, 24, 14, 2, 64, 4864, 32768)
    assert cfg.tie_word_embeddings and cfg.rope_parameters["rope_theta"] == 1e6
    assert cfg.dtype in (torch.bfloat16, "bfloat16")
    assert cfg.vocab_size % 64 == 0
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Qwen2ForCausalLM(cfg).parameters())
    assert 350e6 < n_params < 370e6  # Qwen2.5-0.5B's 494 M less its 151,936-token embedding


@pytest.mark.slow
def test_0_5b_build_writes_bf16_weights(tmp_path):
    from safetensors import safe_open

    out = build_tiny_model(tmp_path / "big", size="0.5b")
    with safe_open(out / "model.safetensors", framework="pt") as f:
        emb = f.get_slice("model.embed_tokens.weight")
        assert emb.get_shape() == [2048, 896] and emb.get_dtype() == "BF16"
        assert "lm_head.weight" not in f.keys()  # tied, as in Qwen's checkpoint
        assert len(f.keys()) == 1 + 24 * 12 + 1


def test_the_recipe_follows_the_corpus_the_weights_are_trained_on_not_the_task_api(monkeypatch):
    """An edit to the Task API (tasks/registry.py) used to change the recipe and fail a fresh
    clone's CI; only tiny.py and the training text count now."""
    from artsg_nb.models import tiny

    before = tiny._marker("tiny", 0, 800)["recipe"]
    monkeypatch.setattr(tiny.tasks, "pretraining_corpus",
                        lambda n, seed, mix=None, noise=0.0: [[{"role": "user", "content": "other text"}]] * n)
    tiny.corpus_digest.cache_clear()
    try:
        assert tiny._marker("tiny", 0, 800)["recipe"] != before
    finally:
        tiny.corpus_digest.cache_clear()
