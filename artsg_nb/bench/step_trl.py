"""The TRL leg of the step benchmark (bench/step.py): `cfg.steps` steps of TRL's GRPOTrainer on the job.

What it does: builds TRL's GRPOConfig for the same job as artsg_nb's RunConfig (see step.py's
docstring), times the trainer's construction, each optimizer step and its generation (a step
minus its generation is its train time, the first of them the first update's), and returns one
result row.

What it does not do: run artsg_nb (step.py), or get imported by the artsg_nb leg's process: it
imports transformers, PEFT and TRL at module level, which must come after Unsloth there.
"""
from __future__ import annotations

import shutil
import time
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
from .step_job import StepBenchConfig, job_prompts, leg_result, task_reward_func


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


def trl_config(cfg: StepBenchConfig, max_new: int, output_dir: str) -> TRLConfig:
    """TRL's GRPOConfig for the same job as artsg_nb's RunConfig (see the module docstring)."""
    cuda = torch.cuda.is_available()
    return TRLConfig(
        output_dir=output_dir, max_steps=cfg.steps, per_device_train_batch_size=cfg.groups * cfg.group_size,
        num_generations=cfg.group_size, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=max_new, temperature=1.0, learning_rate=cfg.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        loss_type="dapo", scale_rewards="group", epsilon=0.2, epsilon_high=0.28, beta=0.0, use_vllm=False,
        gradient_checkpointing=False, bf16=cuda, use_cpu=not cuda, logging_steps=1, report_to="none",
        save_strategy="no", seed=cfg.seed, log_completions=False, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.bfloat16 if cuda else torch.float32})


def scoring_without_triton() -> None:
    """TRL scores through its Triton kernel; without a GPU that cannot run, whether Triton is
    installed (a fresh CPU machine gets it with torch) or not: there TRL scores with TorchLogProb,
    the same function in plain torch."""
    if trl_utils._ChunkedLogProbFunction is None or not torch.cuda.is_available():
        trl_utils._ChunkedLogProbFunction = TorchLogProb


def trl_leg(cfg: StepBenchConfig, max_new: int) -> dict:
    """`cfg.steps` GRPOTrainer steps of the job; one result row (start_s: from here to the trainer
    built, model loaded and LoRA applied)."""
    t_start = time.perf_counter()
    scoring_without_triton()
    data = Dataset.from_list(job_prompts(cfg, cfg.groups * max(cfg.steps, 1)))
    out = Path(cfg.run_dir) / f"trl-{max_new}"
    shutil.rmtree(out, ignore_errors=True)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")
    timer = StepTimer()
    trainer = GRPOTrainer(model=cfg.model_path or str(default_model_dir()), reward_funcs=[task_reward_func(cfg.task)],
                          args=trl_config(cfg, max_new, str(out)), train_dataset=data, peft_config=lora,
                          callbacks=[timer])
    start_s = time.perf_counter() - t_start
    gen_s: list[float] = []
    generate = trainer._generate

    def timed_generate(*a, **k):
        _sync()
        t0 = time.perf_counter()
        result = generate(*a, **k)
        _sync()
        gen_s.append(time.perf_counter() - t0)
        return result

    trainer._generate = timed_generate
    trainer.train()
    tokens = [b - a for a, b in zip([0.0] + timer.num_tokens, timer.num_tokens)]
    n = len(timer.step_s)
    train_s = [s - g for s, g in zip(timer.step_s, gen_s)]
    return leg_result(cfg, "trl", "transformers", max_new, timer.step_s, gen_s[:n], train_s, [0.0] * n, tokens,
                       timer.rewards, start_s=start_s)
