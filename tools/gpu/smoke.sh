#!/usr/bin/env bash
# Quick checks on the GPU host that the installed sets work, after tools/gpu/install.sh:
#
#   bash tools/gpu/install.sh && bash tools/gpu/smoke.sh kernel unsloth sglang vllm
#
#   kernel   a generated notebook runs headless through nbclient (ipykernel, ipywidgets, await)
#            and trl / datasets import
#   unsloth  `import unsloth`; FastLanguageModel.from_pretrained on a random tiny Qwen2 written to
#            /tmp (16-bit), get_peft_model (r=8, all 7 projections, gradient checkpointing
#            "unsloth"), one optimizer step, adapter saved; then a 4-bit load (bitsandbytes cuda130)
#   sglang   the server side imports (sglang, sgl_kernel on sm90) with ARTSG_SERVER_PYTHONPATH
#   vllm     vllm and its compiled parts import with ARTSG_VLLM_PYTHONPATH
#
# Prints one PASS/FAIL line per check (and the tail of a failure); exit status is the number
# of failures. It starts no server (tests/ and the notebooks do that).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 99
ENV_FILE=${ARTSG_TMP:-/tmp}/artsg-env.sh
[[ -f $ENV_FILE ]] || { echo "no $ENV_FILE: run tools/gpu/install.sh first" >&2; exit 99; }
# shellcheck disable=SC1090
source "$ENV_FILE"
PY=${ARTSG_PYTHON:-python3}
W=${ARTSG_TMP:-/tmp}/artsg-smoke; mkdir -p "$W"
FAILS=0

check() {  # check NAME COMMAND...
  local name=$1; shift
  local t0 dt; t0=$(date +%s%N)
  if "$@" >"$W/$name.log" 2>&1; then
    dt=$(( ($(date +%s%N) - t0) / 1000000 ))
    printf 'PASS %-8s %4d.%03ds  %s\n' "$name" $((dt / 1000)) $((dt % 1000)) "$(tail -1 "$W/$name.log")"
  else
    dt=$(( ($(date +%s%N) - t0) / 1000000 ))
    printf 'FAIL %-8s %4d.%03ds  (log %s)\n' "$name" $((dt / 1000)) $((dt % 1000)) "$W/$name.log"
    tail -25 "$W/$name.log" | sed 's/^/    /'
    FAILS=$((FAILS + 1))
  fi
}

smoke_kernel() {
  "$PY" - "$W" <<'PY'
import sys, nbformat
from nbclient import NotebookClient
nb = nbformat.v4.new_notebook()
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nb.cells = [nbformat.v4.new_code_cell(c) for c in (
    "import sys, IPython, torch; print(sys.version.split()[0], IPython.__version__, torch.__version__, torch.cuda.is_available())",
    "import asyncio\nasync def f():\n    await asyncio.sleep(0.01)\n    return 42\nawait f()",
    "import ipywidgets as w; w.IntProgress(value=3, max=10)",
    "import trl, datasets, papermill; print('trl', trl.__version__, 'datasets', datasets.__version__)",
    "import matplotlib; matplotlib.use('agg'); import matplotlib.pyplot as plt; plt.plot([1, 2]); plt.show()",
)]
NotebookClient(nb, timeout=300, kernel_name="python3").execute()
nbformat.write(nb, f"{sys.argv[1]}/smoke.ipynb")
print(" | ".join("".join(o.get("text", "") for o in c.outputs).strip() for c in nb.cells if c.outputs))
PY
}

smoke_unsloth() {
  "$PY" - "$W" <<'PY'
import os, sys, time, json
W = sys.argv[1]
t0 = time.time()
import unsloth                      # must come before transformers/peft/trl
from unsloth import FastLanguageModel
import torch
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
print(f"import unsloth {unsloth.__version__} ({time.time() - t0:.1f}s), device {unsloth.DEVICE_TYPE}")

d = f"{W}/tiny-qwen2"
if not os.path.exists(f"{d}/.complete"):
    text = [f"{a} plus {b} is {a + b}." for a in range(60) for b in range(60)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=600, special_tokens=specials))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    cfg = Qwen2Config(vocab_size=640, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id,
                      bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    hf.save_pretrained(d)
    open(f"{d}/.complete", "w").close()

model, tokenizer = FastLanguageModel.from_pretrained(d, max_seq_length=256, dtype=torch.bfloat16,
                                                     load_in_4bit=False, local_files_only=True)
print("from_pretrained 16-bit:", type(model).__name__, next(model.parameters()).device)
model = FastLanguageModel.get_peft_model(
    model, r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    use_gradient_checkpointing="unsloth", random_state=0)
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
batch = tokenizer(["3 plus 4 is 7.", "10 plus 20 is 30."], return_tensors="pt", padding=True).to(model.device)
losses = []
for _ in range(3):
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward(); opt.step(); opt.zero_grad()
    losses.append(round(float(out.loss), 4))
model.save_pretrained(f"{W}/adapter")
cfg = json.load(open(f"{W}/adapter/adapter_config.json"))
print("losses", losses, "| adapter r", cfg["r"], sorted(cfg["target_modules"]))
del model; torch.cuda.empty_cache()

try:
    m4, _ = FastLanguageModel.from_pretrained(d, max_seq_length=256, load_in_4bit=True, local_files_only=True)
    import bitsandbytes as bnb
    n4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in m4.modules())
    print(f"4-bit load ok: {n4} Linear4bit, bitsandbytes {bnb.__version__}")
except Exception as e:
    print(f"4-bit load FAILED (16-bit LoRA unaffected): {type(e).__name__}: {e}")
print(f"unsloth smoke ok in {time.time() - t0:.1f}s; losses {losses}")
PY
}

smoke_sglang() {
  PYTHONPATH=$ARTSG_SERVER_PYTHONPATH "$PY" -c "
import torch, sglang, sgl_kernel, transformers
import sglang.srt.entrypoints.http_server
print('sglang', sglang.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__)"
}

smoke_vllm() {
  [[ ${ARTSG_VLLM_READY:-0} == 1 ]] || { echo "vLLM parts missing (need A, B and C)"; return 1; }
  PYTHONPATH=$ARTSG_VLLM_PYTHONPATH "$PY" -c "
import vllm, vllm.platforms.cuda, vllm.vllm_flash_attn   # part A's and part C's .so files
print('vllm', vllm.__version__)"
}

want=("$@"); [[ ${#want[@]} -eq 0 ]] && want=(kernel unsloth sglang vllm)
for s in "${want[@]}"; do
  case $s in
    kernel|unsloth|sglang|vllm) check "$s" "smoke_$s" ;;
    *) echo "unknown check $s (kernel unsloth sglang vllm)" >&2; FAILS=$((FAILS + 1)) ;;
  esac
done
exit $FAILS
