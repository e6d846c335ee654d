"""The TRL legs of the step benchmark (bench/step.py): `cfg.steps` steps of TRL's GRPOTrainer on the job,
generating through vLLM colocated in the trainer's process (TRL's fast path, framework "trl_vllm") or
through plain `model.generate` (framework "trl").

What it does: builds TRL's GRPOConfig for the same job as artsg_nb's RunConfig (see step.py's
docstring), times the trainer's construction (vLLM's start included), each optimizer step and its
generation (a step minus its generation is its train time, the first of them the first update's;
the fast path's weight sync into vLLM, inside its generation, is its reload), and returns one
result row. The fast path runs as it ran in issue 48: `use_vllm=True, vllm_mode="colocate"`,
vllm_gpu_memory_utilization 0.35 (0.4 from ~2 B params), no sleep mode; vLLM's external launcher
reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (`single_process_env`), and the
offline bundle's vLLM samples without FlashInfer (VLLM_USE_FLASHINFER_SAMPLER=0).

What it does not do: run artsg_nb (step.py), or get imported by the artsg_nb leg's process: it
imports transformers, PEFT and TRL at module level, which must come after Unsloth there.
"""
from __future__ import annotations

import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig as TRLConfig
from trl import GRPOTrainer
from trl.trainer import utils as trl_utils

from ..models.tiny import default_model_dir
from ..rl.logprobs import TorchLogProb
from ..rl.trainer import LORA_TARGETS
from .step_job import StepBenchConfig, job_prompts, leg_result, task_reward_func, trl_vllm_memory


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (generation included: GRPOTrainer generates inside the
    step), and the per-step reward and token count TRL logs."""

    def __init__(self):
        self.step_s, self.rewards, self.num_tokens = [], [], []
        self._t0 = None

    def on_step_begin(self, args, state, control, **kwargs):
        _sync()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        self.step_s.append(time.perf_counter() - self._t0)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards.append(float(logs["reward"]))
            self.num_tokens.append(float(logs.get("num_tokens", float("nan"))))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def trl_config(cfg: StepBenchConfig, max_new: int, output_dir: str, vllm_memory: float | None = None) -> TRLConfig:
    """TRL's GRPOConfig for the same job as artsg_nb's RunConfig (see the module docstring); with
    `vllm_memory` (vLLM's share of the GPU) TRL's fast path, vLLM colocated, else plain generate."""
    cuda = torch.cuda.is_available()
    fast = {} if vllm_memory is None else dict(vllm_mode="colocate", vllm_gpu_memory_utilization=vllm_memory,
                                               vllm_enable_sleep_mode=False)
    return TRLConfig(
        output_dir=output_dir, max_steps=cfg.steps, per_device_train_batch_size=cfg.groups * cfg.group_size,
        num_generations=cfg.group_size, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=max_new, temperature=1.0, learning_rate=cfg.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        loss_type="dapo", scale_rewards="group", epsilon=0.2, epsilon_high=0.28, beta=0.0, use_vllm=vllm_memory is not None,
        gradient_checkpointing=False, bf16=cuda, use_cpu=not cuda, logging_steps=1, report_to="none",
        save_strategy="no", seed=cfg.seed, log_completions=False, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.bfloat16 if cuda else torch.float32}, **fast)


def scoring_without_triton() -> None:
    """TRL scores through its Triton kernel; without a GPU that cannot run, whether Triton is
    installed (a fresh CPU machine gets it with torch) or not: there TRL scores with TorchLogProb,
    the same function in plain torch."""
    if trl_utils._ChunkedLogProbFunction is None or not torch.cuda.is_available():
        trl_utils._ChunkedLogProbFunction = TorchLogProb


def single_process_env() -> dict[str, str]:
    """What vLLM's external launcher needs in a single-process run, for the variables not set yet:
    rank 0 of 1 and a free local rendezvous port; and no FlashInfer sampler (not in the bundle)."""
    wanted = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
              "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            wanted["MASTER_PORT"] = str(s.getsockname()[1])
    return {k: v for k, v in wanted.items() if k not in os.environ}


class Timed:
    """Wraps a callable; the seconds of each call (CUDA synchronised on both sides) in `seconds`,
    and in `inner` the seconds each call spent in the calls of `within` (a Timed it calls)."""

    def __init__(self, fn, within: "Timed | None" = None):
        self.fn, self.within, self.seconds, self.inner = fn, within, [], []

    def __call__(self, *a, **k):
        _sync()
        t0, before = time.perf_counter(), len(self.within.seconds) if self.within else 0
        result = self.fn(*a, **k)
        _sync()
        self.seconds.append(time.perf_counter() - t0)
        self.inner.append(sum(self.within.seconds[before:]) if self.within else 0.0)
        return result


def trl_leg(cfg: StepBenchConfig, max_new: int, vllm: bool = False) -> dict:
    """`cfg.steps` GRPOTrainer steps of the job, through vLLM colocated (`vllm`) or plain generate;
    one result row (start_s: from here to the trainer built, model loaded, LoRA applied and, on the
    fast path, vLLM started)."""
    with environment(single_process_env() if vllm else {}):
        return _trl_leg(cfg, max_new, vllm)


@contextmanager
def environment(values: dict[str, str]):
    """os.environ with `values` set, as it was afterwards (a leg run in the benchmark's own process)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _trl_leg(cfg: StepBenchConfig, max_new: int, vllm: bool) -> dict:
    t_start = time.perf_counter()
    scoring_without_triton()
    model = cfg.model_path or str(default_model_dir())
    data = Dataset.from_list(job_prompts(cfg, cfg.groups * max(cfg.steps, 1)))
    out = Path(cfg.run_dir) / f"trl{'-vllm' if vllm else ''}-{max_new}"
    shutil.rmtree(out, ignore_errors=True)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")
    timer = StepTimer()
    args = trl_config(cfg, max_new, str(out), trl_vllm_memory(cfg, model) if vllm else None)
    trainer = GRPOTrainer(model=model, reward_funcs=[task_reward_func(cfg.task)], args=args, train_dataset=data,
                          peft_config=lora, callbacks=[timer])
    start_s = time.perf_counter() - t_start
    sync = None
    if vllm:  # the weight sync into vLLM runs inside _generate (not on the first step): TRL's reload
        sync = trainer.vllm_generation.sync_weights = Timed(trainer.vllm_generation.sync_weights)
    generate = trainer._generate = Timed(trainer._generate, within=sync)
    trainer.train()
    return trl_row(cfg, max_new, timer, generate.seconds, generate.inner, start_s, vllm)


def trl_row(cfg: StepBenchConfig, max_new: int, timer: StepTimer, gen_s: list[float], sync_s: list[float],
            start_s: float, vllm: bool) -> dict:
    """The leg's result row from its timings, one generation a step: rollout = generation - the
    weight sync inside it, train = step - generation."""
    tokens = [b - a for a, b in zip([0.0] + timer.num_tokens, timer.num_tokens)]
    n = len(timer.step_s)
    train_s = [s - g for s, g in zip(timer.step_s, gen_s)]
    rollout_s = [g - r for g, r in zip(gen_s[:n], sync_s)]
    framework, engine = ("trl_vllm", "vllm-colocate") if vllm else ("trl", "transformers")
    return leg_result(cfg, framework, engine, max_new, timer.step_s, rollout_s, train_s, sync_s[:n], tokens,
                      timer.rewards, start_s=start_s)
