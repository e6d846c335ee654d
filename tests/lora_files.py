"""LoRA adapter directories for tests, as PEFT saves them (no test lives here; like
sglang_fixtures.py, importable from every test folder because tests/ is on sys.path)."""
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir, out, rank=8, seed=1) -> str:
    """A LoRA adapter on all 7 projections with non-zero B, so its outputs differ from the base model's."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_PROJECTIONS, lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(out, safe_serialization=True)
    return str(out)
