"""Step benchmark: N GRPO steps of one job through artsg_nb and through TRL's GRPOTrainer.

    python -m artsg_nb.bench.step --engine sglang --model-path /path/SmolLM2-135M-Instruct \\
        --max-new-tokens 8 256 --steps 10 --frameworks artsg_nb trl

The job is the same on both sides: the addition task's prompts (chat-templated: artsg_nb renders
them itself, TRL gets them as conversations), its reward (as a TRL reward function), LoRA r/alpha
on the 7 projections, `groups` prompts x `group_size` samples per step (TRL: num_generations=G,
per-device batch = groups x G, one generation batch per optimizer step), the learning rate
(constant, AdamW), temperature 1.0, the loss (dapo, ε 0.2 / 0.28, scale_rewards "group"), beta 0,
no gradient checkpointing. TRL generates with plain `model.generate` (use_vllm=False) and is
timed per step by a TrainerCallback (on_step_begin/end); its rollout time is its `_generate`.
artsg_nb is timed around `await GRPORun.step()` (rollout_s / train_s / reload_s from the row).

Each leg (framework x max_new_tokens) runs in its own process (`--leg`): Unsloth patches
transformers on import, and a GPU is given back cleanly when a process ends. The first `warmup`
steps are left out of the medians. Results: one row per leg, written to
`benchmarks/results/<date>-step-<hardware>.csv` with exactly `COLUMNS`; the CLI prints the table
and the artsg_nb / TRL ratios per job.

What it does not do: plot (plots.plot_step_benchmark) or compare engines' raw speed (bench.run).
"""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Literal, Sequence

import pandas as pd
import torch
import tyro
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig as TRLConfig
from trl import GRPOTrainer
from trl.trainer import utils as trl_utils

from ..grpo import GRPOConfig
from ..run_config import RunConfig
from ..session import GRPORun
from ..tasks import AdditionEnv, addition_reward
from ..tiny_model import default_model_dir
from ..trainer import LORA_TARGETS
from .results import step_ratios
from .run import hardware_name

log = logging.getLogger(__name__)

COLUMNS = ["framework", "engine", "model", "max_new_tokens", "steps", "step_s_median", "rollout_s_median",
           "train_s_median", "reload_s_median", "tokens_per_step", "reward_first", "reward_last", "hardware",
           "date"]
"""The step benchmark's CSV columns, in order (plots.plot_step_benchmark reads them by name)."""
FRAMEWORKS = ("artsg_nb", "trl")


@dataclass
class StepBenchConfig:
    """One step benchmark: which frameworks, which job, how many steps."""

    frameworks: tuple[Literal["artsg_nb", "trl"], ...] = FRAMEWORKS
    """"artsg_nb" and/or "trl"."""
    engine: Literal["cpu", "sglang", "vllm"] = "cpu"
    """artsg_nb's server: "sglang", "vllm" or "cpu" (TRL generates in-process either way)."""
    model_path: str | None = None
    """Base model directory; None: the offline tiny model."""
    max_new_tokens: tuple[int, ...] = (8, 256)
    """One job per completion budget."""
    steps: int = 10
    """GRPO steps per leg, warm-up included."""
    warmup: int = 1
    """Leading steps left out of the medians (first-call compilation, caches); 0 keeps all."""
    groups: int = 16
    """Prompts per step."""
    group_size: int = 8
    """G, samples per prompt (TRL num_generations)."""
    learning_rate: float = 2e-4
    """Constant AdamW learning rate."""
    lora_rank: int = 16
    """LoRA r."""
    lora_alpha: int = 32
    """LoRA alpha."""
    seed: int = 0
    """Seeds prompts, sampling and LoRA initialisation."""
    schedule: str | None = None
    """artsg_nb's rollout schedule; None: RunConfig's default."""
    verify_adapter: bool = False
    """artsg_nb's served-adapter probe after each reload (a check, not part of GRPO: off)."""
    api_key: str | None = None
    """Sent to artsg_nb's server."""
    isolate: bool = True
    """Each leg in its own process (Unsloth patches transformers; GPU memory is given back).
    False runs them here, one after the other (fine on CPU: the tests do)."""
    run_dir: str = "runs/bench-step"
    """Scratch directory for run directories and TRL output."""
    out: str | None = None
    """CSV path; None: benchmarks/results/<date>-step-<hardware>.csv."""
    results_dir: str = "benchmarks/results"
    """Where the default CSV goes."""
    extra: tyro.conf.Suppress[dict] = field(default_factory=dict)
    """Not measured; kept for callers that want to tag a run."""


# ---------------------------------------------------------------------------- the two frameworks
def _prompts(cfg: StepBenchConfig, n: int) -> list[AdditionEnv]:
    return [AdditionEnv(cfg.seed * 1_000_003 + i) for i in range(n)]


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _leg_result(cfg: StepBenchConfig, framework: str, engine: str, max_new: int, step_s, rollout_s, train_s,
                reload_s, tokens, rewards) -> dict:
    keep = slice(cfg.warmup if len(step_s) > cfg.warmup else 0, None)
    return {"framework": framework, "engine": engine, "model": Path(cfg.model_path or default_model_dir()).name,
            "max_new_tokens": max_new, "steps": len(step_s), "step_s_median": _median(step_s[keep]),
            "rollout_s_median": _median(rollout_s[keep]), "train_s_median": _median(train_s[keep]),
            "reload_s_median": _median(reload_s[keep]), "tokens_per_step": _median(tokens[keep]),
            "reward_first": rewards[0] if rewards else float("nan"),
            "reward_last": rewards[-1] if rewards else float("nan"),
            "hardware": hardware_name(engine if framework == "artsg_nb" else ("gpu" if torch.cuda.is_available() else "cpu")),
            "date": datetime.now().strftime("%Y-%m-%d")}


async def artsg_leg(cfg: StepBenchConfig, max_new: int) -> dict:
    """`cfg.steps` GRPORun steps of the job; one result row."""
    run_dir = Path(cfg.run_dir) / f"artsg_nb-{cfg.engine}-{max_new}"
    shutil.rmtree(run_dir, ignore_errors=True)
    rc = RunConfig(task="addition", engine=cfg.engine, model_path=cfg.model_path, run_dir=str(run_dir),
                   group_size=cfg.group_size, groups_per_step=cfg.groups, max_new_tokens=max_new,
                   temperature=1.0, learning_rate=cfg.learning_rate, lora_rank=cfg.lora_rank,
                   lora_alpha=cfg.lora_alpha, seed=cfg.seed, verify_adapter=cfg.verify_adapter,
                   grpo=GRPOConfig(loss_type="dapo", beta=0.0, max_completion_length=max_new),
                   api_key=cfg.api_key, verbose=False)
    if cfg.schedule:
        rc = replace(rc, schedule=cfg.schedule)
    run = GRPORun(rc).start()
    step_s, rows = [], []
    try:
        for _ in range(cfg.steps):
            t0 = time.perf_counter()
            rows.append(await run.step())
            step_s.append(time.perf_counter() - t0)
    finally:
        run.stop()
    col = lambda k: [float(r[k]) if r.get(k) is not None else float("nan") for r in rows]  # noqa: E731
    skipped = sum(bool(r.get("update_skipped")) for r in rows)
    if skipped:  # TRL computes a zero gradient for such a step; the train medians are not the same work
        log.warning("artsg_nb skipped the update on %d of %d steps (max_new_tokens=%d): every group's rewards "
                    "were equal, so no gradient. Its train/reload medians are not comparable with TRL's; try "
                    "more groups, a larger group_size or more tokens until the job has a reward signal",
                    skipped, len(rows), max_new)
    return _leg_result(cfg, "artsg_nb", cfg.engine, max_new, step_s, col("rollout_s"), col("train_s"),
                       col("reload_s"), col("tokens"), col("reward_mean"))


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


def addition_reward_func(completions, answer, **kwargs) -> list[float]:
    """The addition task's reward as a TRL reward function (conversational completions)."""
    return [addition_reward(c[-1]["content"] if isinstance(c, list) else c, int(a))
            for c, a in zip(completions, answer)]


class TorchLogProb:
    """Plain-torch stand-in for TRL's fused `ChunkedLogProbFunction` (a Triton kernel) with the
    same `apply` signature and results, so GRPOTrainer runs where Triton does not (CPU here).
    Installed only when TRL could not import its kernel; on a GPU TRL runs its own."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=()):
        logits = hidden.float() @ weight.float().t()
        if bias is not None:
            logits = logits + bias.float()
        logits = logits * logit_scale
        if final_logit_softcapping is not None:
            logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
        logits = logits / temperature
        lsm = torch.log_softmax(logits, dim=-1)
        logprobs = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        outputs = outputs or ()
        p = lsm.exp()
        entropy = -(p * lsm).sum(-1) if "entropy" in outputs else None
        sq = torch.logsumexp(2 * lsm, dim=-1) if "log_sum_sq_probs" in outputs else None
        mean = logits.mean(-1) if "mean_logits" in outputs else None
        top1 = (logits.argmax(-1) == targets) if "is_top1" in outputs else None
        return logprobs, entropy, sq, mean, top1


def trl_leg(cfg: StepBenchConfig, max_new: int) -> dict:
    """`cfg.steps` GRPOTrainer steps of the job; one result row."""
    if trl_utils._ChunkedLogProbFunction is None:  # no Triton (CPU): TRL's fused scoring cannot run
        trl_utils._ChunkedLogProbFunction = TorchLogProb
    envs = _prompts(cfg, cfg.groups * max(cfg.steps, 1))
    data = Dataset.from_list([{"prompt": e.reset(), "answer": e.answer} for e in envs])
    out = Path(cfg.run_dir) / f"trl-{max_new}"
    shutil.rmtree(out, ignore_errors=True)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")
    timer = StepTimer()
    trainer = GRPOTrainer(model=cfg.model_path or str(default_model_dir()), reward_funcs=[addition_reward_func],
                          args=trl_config(cfg, max_new, str(out)), train_dataset=data, peft_config=lora,
                          callbacks=[timer])
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
    return _leg_result(cfg, "trl", "transformers", max_new, timer.step_s, gen_s[:n], train_s, [0.0] * n, tokens,
                       timer.rewards)


# ---------------------------------------------------------------------------- orchestration
def run_leg(cfg: StepBenchConfig, framework: str, max_new: int) -> dict:
    """One leg in this process."""
    if framework == "artsg_nb":
        return asyncio.run(artsg_leg(cfg, max_new))
    if framework == "trl":
        return trl_leg(cfg, max_new)
    raise ValueError(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")


def _leg_in_subprocess(cfg: StepBenchConfig, framework: str, max_new: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, out_path = Path(tmp) / "cfg.json", Path(tmp) / "row.json"
        cfg_path.write_text(json.dumps(asdict(cfg)))
        cmd = [sys.executable, "-m", "artsg_nb.bench.step", "--leg", f"{framework}:{max_new}",
               str(cfg_path), str(out_path)]
        proc = subprocess.run(cmd)
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"step benchmark leg {framework} max_new_tokens={max_new} failed with exit code "
                               f"{proc.returncode}; its output is above. Try: run it alone with "
                               f"`{' '.join(cmd[:5])}` after fixing the cause.")
        return json.loads(out_path.read_text())


def run_step_bench(cfg: StepBenchConfig) -> pd.DataFrame:
    """Every framework x max_new_tokens leg, each in its own process; the frame, saved to CSV."""
    leg = _leg_in_subprocess if cfg.isolate else run_leg
    rows = [leg(cfg, fw, m) for m in cfg.max_new_tokens for fw in cfg.frameworks]
    df = pd.DataFrame(rows).reindex(columns=COLUMNS)
    path = Path(cfg.out) if cfg.out else default_path(df, cfg.results_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    log.info("wrote %s", path)
    return df


def default_path(df: pd.DataFrame, results_dir: str) -> Path:
    """benchmarks/results/<date>-step-<hardware>.csv (hardware of the artsg_nb rows when present)."""
    hw_rows = df[df["framework"] == "artsg_nb"] if (df["framework"] == "artsg_nb").any() else df
    hw = str(hw_rows["hardware"].iloc[0]) if len(df) else "unknown"
    slug = "-".join(hw.lower().replace("x", " x").split()).replace("--", "-")
    return Path(results_dir) / f"{datetime.now():%Y%m%d}-step-{slug}.csv"


def parse_args(argv: Sequence[str]) -> StepBenchConfig:
    """The flags, generated from StepBenchConfig (tyro): `--frameworks artsg_nb trl`,
    `--max-new-tokens 8 256`, `--model-path DIR`, `--learning-rate`, ... (`--help` lists them)."""
    return tyro.cli(StepBenchConfig, args=list(argv), prog="python -m artsg_nb.bench.step",
                    description=__doc__.split("\n")[0])


def _leg_main(argv: Sequence[str]) -> None:
    """A leg's child process: `--leg FRAMEWORK:MAX_NEW CONFIG_JSON OUT_JSON` (_leg_in_subprocess)."""
    leg, cfg_path, out_path = argv
    cfg = StepBenchConfig(**json.loads(Path(cfg_path).read_text()))
    cfg = replace(cfg, frameworks=tuple(cfg.frameworks), max_new_tokens=tuple(cfg.max_new_tokens))
    framework, max_new = leg.split(":")
    Path(out_path).write_text(json.dumps(run_leg(cfg, framework, int(max_new))))


def main(argv: Sequence[str] | None = None) -> pd.DataFrame | None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--leg"]:  # a child process: one leg, its row as JSON
        _leg_main(argv[1:])
        return None
    df = run_step_bench(parse_args(argv))
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(df.to_string(index=False))
        r = step_ratios(df)
        if not r.empty:
            print("\nartsg_nb vs TRL (speedup_vs_trl = TRL step / artsg_nb step):")
            print(r.to_string())
    return df


if __name__ == "__main__":
    main()
