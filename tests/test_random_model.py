"""The benchmark model builder (artsg_nb.models.random_model): a directory transformers loads and runs,
the real shapes' sizes, shards with their index, the tokenizer and chat template of the source, and
errors that say what to do. Built on CPU at the hidden `test` shape (seconds); the real shapes are only
sized here (on the meta device), their build is a GPU job (tools/gpu/validate.sh)."""
import json
import subprocess
import sys

import pytest
import torch

from artsg_nb.models import random_model as rm
from artsg_nb.models.tiny import SHIPPED_DIR

SOURCE = SHIPPED_DIR  # any model directory with a chat tokenizer; the shipped tiny one is always here


@pytest.fixture(scope="module", params=["llama", "qwen"])
def built(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("random") / request.param
    return rm.build_random_model(out, "test", request.param, seed=3, tokenizer=SOURCE), request.param


def test_builds_a_model_transformers_loads_and_runs(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, family = built
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen": "Qwen2ForCausalLM"}[family]
    assert next(model.parameters()).dtype == torch.bfloat16
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()
    assert model.config.vocab_size >= len(tokenizer) and model.config.vocab_size % rm.VOCAB_MULTIPLE == 0
    assert model.config.eos_token_id == tokenizer.eos_token_id == 2
    # norms are ones and matrices random with the seed's spread, not transformers' init
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    assert abs(model.model.layers[0].mlp.up_proj.weight.float().std().item() - rm.INIT_STD) < 0.003


def test_directory_says_it_is_a_benchmark_model_and_loads_in_older_readers(built):
    out, family = built
    assert "Rewards mean nothing" in (out / "README.md").read_text()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == rm.FAMILY[family]["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    source_cfg = json.loads((SOURCE / "tokenizer_config.json").read_text())
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == source_cfg["chat_template"]
    assert json.loads((out / "generation_config.json").read_text())["top_k"] == cfg["vocab_size"]


def test_weights_are_sharded_with_an_index_and_seeded(tmp_path):
    config = rm.model_config("test", "llama", 256, None, 2, 0)
    shapes = rm.parameter_shapes(config)
    assert "lm_head.weight" in shapes  # untied at this shape
    rm.write_weights(tmp_path, shapes, seed=5, device=torch.device("cpu"), shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and set(index["weight_map"]) == set(shapes)
    assert index["metadata"]["total_size"] == 2 * rm.count_params(shapes)
    from safetensors.torch import load_file

    first = load_file(str(tmp_path / files[0]))
    (tmp_path / "again").mkdir()
    rm.write_weights(tmp_path / "again", shapes, seed=5, device=torch.device("cpu"), shard_bytes=100_000)
    again = load_file(str(tmp_path / "again" / files[0]))
    assert all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.parametrize("family,shape,billions", [
    ("llama", "1.5b", 1.56), ("llama", "7b", 6.88), ("llama", "14b", 13.72),
    ("qwen", "1.5b", 1.39), ("qwen", "7b", 6.88), ("qwen", "14b", 13.72)])
def test_real_shapes_have_real_sizes(family, shape, billions):
    shapes = rm.parameter_shapes(rm.model_config(shape, family, 49152, 1, 2, 0))
    assert rm.count_params(shapes) / 1e9 == pytest.approx(billions, abs=0.01)


def test_rebuild_is_a_no_op_and_a_foreign_directory_is_refused(tmp_path):
    out = rm.build_random_model(tmp_path / "m", "test", tokenizer=SOURCE)
    stamp = (out / "config.json").stat().st_mtime_ns
    assert rm.build_random_model(out, "test", tokenizer=SOURCE) == out
    assert (out / "config.json").stat().st_mtime_ns == stamp
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="notes.txt"):
        rm.build_random_model(tmp_path / "mine", "test", tokenizer=SOURCE)


def test_bad_input_says_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="known: 1.5b, 7b, 14b"):
        rm.build_random_model(tmp_path / "x", "3b", tokenizer=SOURCE)
    monkeypatch.setenv("ARTSG_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError, match="python -m artsg_nb.models smollm2-135m-instruct.*--tokenizer"):
        rm.build_random_model(tmp_path / "x", "7b")
    with pytest.raises(FileNotFoundError, match="no tokenizer_config.json"):
        rm.build_random_model(tmp_path / "x", "7b", tokenizer=tmp_path)


def test_command_line_help_names_it_a_benchmark_model():
    proc = subprocess.run([sys.executable, "-m", "artsg_nb.models", "random", "--help"],
                          capture_output=True, text=True, check=True)
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    assert "BENCHMARK model" in text and "rewards mean nothing" in text
    assert "--shape {1.5b,7b,14b}" in text  # the CPU tests' shape is hidden
