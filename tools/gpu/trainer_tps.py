"""Trainer tokens/s on this GPU with and without Unsloth, each backend in its own process.

usage: python3 tools/gpu/trainer_tps.py --model DIR [--out JSON] [--backends peft,unsloth]

A synthetic GRPO batch (groups x samples of prompt + completion tokens, random ids, rewards with
variance) goes through `Trainer.train_step`: one warm-up step, then timed steps. Unsloth patches
transformers globally when imported, so each backend runs in a fresh interpreter.
"""
import argparse
import json
import subprocess
import sys
import time
from types import SimpleNamespace


def synthetic_groups(vocab: int, groups: int, samples: int, prompt: int, completion: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(groups):
        p = torch.randint(10, vocab, (prompt,), generator=g).tolist()
        trajs = []
        for j in range(samples):
            c = torch.randint(10, vocab, (completion,), generator=g).tolist()
            trajs.append(SimpleNamespace(token_ids=p + c, completion_mask=[0] * prompt + [1] * completion,
                                         logprobs=[0.0] * prompt + [-5.0] * completion, reward=float(j % 3),
                                         error=None))
        out.append(SimpleNamespace(trajectories=trajs))
    return out


def measure(model: str, backend: str, steps: int, groups: int, samples: int, prompt: int, completion: int) -> dict:
    from artsg_nb.rl.trainer import Trainer, TrainerConfig

    t0 = time.perf_counter()
    tr = Trainer(TrainerConfig(model_path=model, use_unsloth=(backend == "unsloth"), device="cuda",
                               micro_batch_tokens=16384, gradient_checkpointing=True))
    load_s = time.perf_counter() - t0
    vocab = tr.model.get_input_embeddings().weight.shape[0]
    batch = synthetic_groups(vocab, groups, samples, prompt, completion)
    import torch

    tr.train_step(batch)  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        m = tr.train_step(batch)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    return {"backend": tr.backend, "load_s": load_s, "step_s": dt, "tokens_per_step": m["tokens"],
            "tokens_per_s": m["tokens"] / dt, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "loss": m["loss"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out")
    ap.add_argument("--backends", default="peft,unsloth")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shape", default="8,8,512,256", help="groups,samples,prompt,completion")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    shape = [int(x) for x in a.shape.split(",")]
    if a.one:
        print(json.dumps(measure(a.model, a.one, a.steps, *shape)))
        return 0
    results = []
    for backend in a.backends.split(","):
        proc = subprocess.run([sys.executable, __file__, "--model", a.model, "--one", backend, "--steps",
                               str(a.steps), "--shape", a.shape], capture_output=True, text=True)
        line = (proc.stdout.strip().splitlines() or [""])[-1]
        try:
            results.append(json.loads(line))
        except json.JSONDecodeError:
            results.append({"backend": backend, "error": (proc.stderr or proc.stdout)[-2000:]})
        print(json.dumps(results[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"shape": dict(zip(["groups", "samples", "prompt", "completion"], shape)),
                       "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
