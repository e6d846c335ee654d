"""The step benchmark's job, shared by its two legs: configuration, prompts, and the result row.

What it does: `StepBenchConfig` (the CLI's fields), `job_prompts` (TRL's dataset: the task's
episodes for seeds of its own; artsg_nb's run draws its seeds from the same task, so both train on
prompts of one distribution, not the same prompts), `task_reward_func` (the task's reward for TRL), `leg_result` (one CSV row with exactly `COLUMNS`, warm-up steps left out of
the medians, the first update's time kept beside them) and `source_commit` (the git commit the
benchmark runs from, for the row's `commit`).

What it does not do: run a leg (step.py runs artsg_nb's and orchestrates; step_trl.py runs TRL's).
"""
from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Literal

import torch
import tyro

from ..serving.memory_estimate import ModelMemory
from ..tasks.registry import get_task
from ..models.tiny import default_model_dir
from .floors import job_floors
from .run import hardware_name

COLUMNS = ["framework", "engine", "model", "max_new_tokens", "steps", "step_s_median", "rollout_s_median",
           "train_s_median", "reload_s_median", "tokens_per_step", "reward_first", "reward_last", "hardware",
           "date", "pipeline", "start_s", "first_train_s", "first_step_s", "commit", "job", "reload_wait_s_median",
           "overlap_median", "decode_floor_s", "train_floor_s"]
"""The step benchmark's CSV columns, in order (plots.plot_step_benchmark and results.step_ratios read
them by name; columns are only ever appended). `pipeline`: RunConfig(pipeline=...) of an artsg_nb row
(False for TRL); `start_s`: seconds to get ready to step (artsg_nb: GRPORun.start(); TRL: the leg's
start to its GRPOTrainer built); `first_train_s`: the first update's seconds (artsg_nb: train_s of the
first step that updated; TRL: its first step minus its first generation), `first_step_s`: the first
step's seconds (both taken from the warm-up steps the medians leave out; a pipelined leg's first
update already overlaps the second step's rollouts: the synchronous leg's is the first update alone);
`commit`: source_commit(); `job`: the job's shape (`job_label`), so rows of different jobs are never
merged or compared; `reload_wait_s_median`: the part of the reload the step waited for (a synchronous
step: all of reload_s; a pipelined one: what was left once the next step's rollouts were in, the
history's reload_wait_s; TRL: 0); `overlap_median`: a pipelined artsg_nb row's median, over its steps
after the warm-up whose own rollouts and the next step's were sampled ahead, of step / max(its
update, the rollouts it sampled ahead) (`overlap_ratios`: issue 26's build item 5, per step), NaN
for the other rows; `decode_floor_s`, `train_floor_s`: the card's floor under the job's rollout and
update (floors.py; NaN on a CPU or an unknown card)."""
FRAMEWORKS = ("artsg_nb", "trl_vllm", "trl")
"""artsg_nb; TRL's fast path, GRPOTrainer(use_vllm=True, vllm_mode="colocate"): vLLM in the trainer's
process, the mode TRL recommends (engine column "vllm-colocate"); TRL with plain `model.generate`
(engine "transformers"), its slowest mode and the only one before issue 48."""
TRL_VLLM_MEMORY = (0.35, 0.4)
"""vllm_gpu_memory_utilization of TRL's fast path: the first below LARGE_MODEL_BYTES of weights, the
second from it (the settings TRL's fast path ran at in issue 48: 0.35 at 135M, 0.4 at 7B)."""
LARGE_MODEL_BYTES = 4e9


@dataclass
class StepBenchConfig:
    """One step benchmark: which frameworks, which job, how many steps."""

    frameworks: tuple[Literal["artsg_nb", "trl_vllm", "trl"], ...] = FRAMEWORKS
    """"artsg_nb", "trl_vllm" (TRL + vLLM colocated: TRL's fast path) and/or "trl" (TRL with plain
    generate). The trl_vllm leg needs vLLM importable: `vllm_pythonpath`."""
    task: Literal["addition_chat", "addition"] = "addition_chat"
    """The job's task (tasks/chat.py, tasks/registry.py): both ask "What is a + b?". "addition_chat" reads the
    reply's last number, so a chat model that explains earns a reward at 8 new tokens and GRPO has
    a signal on most steps; "addition" wants a bare number, which SmolLM2-135M-Instruct almost
    never gives, so its updates are skipped (no signal) while TRL runs a backward on a zero loss."""
    engine: Literal["cpu", "sglang", "vllm"] = "cpu"
    """artsg_nb's server: "sglang", "vllm" or "cpu" (TRL generates in-process either way)."""
    model_path: str | None = None
    """Base model directory; None: the offline tiny model. Not with `jobs`."""
    jobs: tuple[str, ...] = ()
    """Named jobs instead of model_path x max_new_tokens (JOBS: "smollm2", "1.5b", "7b"; "7b:256"
    for one budget), run in the order given into one CSV. Their models come from `models_dir`."""
    models_dir: str | None = None
    """Where the named jobs' models are: <models_dir>/smollm2 (else the registered build) and
    <models_dir>/random-<shape>, built there when missing (`python -m artsg_nb.models random`,
    SmolLM2's tokenizer); None: the cache."""
    vllm_gpu_memory_utilization: float | None = None
    """TRL's fast path: vLLM's share of the GPU; None: TRL_VLLM_MEMORY by the model's size."""
    vllm_pythonpath: str | None = None
    """Appended to the trl_vllm leg's PYTHONPATH (vLLM from a bundle's site folder, after the
    kernel's packages); None: $ARTSG_VLLM_PYTHONPATH (tools/gpu/install.sh sets it), else nothing."""
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
    pipeline: tuple[bool, ...] = (False, True)
    """artsg_nb's RunConfig(pipeline=...): its legs run once per value (rollouts of step n+1 overlap
    step n's update when True); TRL's legs run once, they have no pipeline."""
    schedule: str | None = None
    """artsg_nb's rollout schedule; None: RunConfig's default."""
    verify_adapter: bool | None = None
    """artsg_nb's served-adapter check after reloads; None: RunConfig's default (on, every
    verify_every steps), the setting the results are quoted at. False leaves it out."""
    api_key: str | None = None
    """Sent to artsg_nb's server; None: RunConfig's default (a random key per start)."""
    isolate: bool = True
    """Each leg in its own process (Unsloth patches transformers; GPU memory is given back).
    False runs them here, one after the other (fine on CPU: the tests do)."""
    run_dir: str = "runs/bench-step"
    """Scratch directory for run directories and TRL output."""
    out: str | None = None
    """CSV path; None: benchmarks/results/<date>-step-<hardware>.csv."""
    merge: bool = True
    """When the CSV exists, keep its rows and replace only those of the legs run now (same framework,
    engine, model, max_new_tokens and pipeline): legs can be run in separate calls into one file.
    False overwrites it."""
    results_dir: str = "benchmarks/results"
    """Where the default CSV goes."""
    extra: tyro.conf.Suppress[dict] = field(default_factory=dict)
    """Not measured; kept for callers that want to tag a run."""


def job_seeds(cfg: StepBenchConfig, n: int) -> list[int]:
    """The env seeds of TRL's `n` prompts (artsg_nb's run draws its own from the same task)."""
    return [cfg.seed * 1_000_003 + i for i in range(n)]


def job_prompts(cfg: StepBenchConfig, n: int) -> list[dict]:
    """TRL's dataset rows: {"prompt": the episode's opening messages, "seed": its env seed}."""
    task = get_task(cfg.task)
    return [{"prompt": task.make_env(seed).reset(), "seed": seed} for seed in job_seeds(cfg, n)]


def task_reward_func(task_name: str):
    """The task's reward as a TRL reward function: each completion is the reply to the episode of
    its row's `seed` (single-turn tasks: the env's one step pays the reward)."""
    task = get_task(task_name)

    def reward(completions, seed, **kwargs) -> list[float]:
        out = []
        for completion, s in zip(completions, seed):
            env = task.make_env(int(s))
            env.reset()
            reply = completion[-1]["content"] if isinstance(completion, list) else completion
            out.append(float(env.step(reply).reward))
        return out

    reward.__name__ = f"{task_name}_reward"
    return reward


def _median(xs: list[float]) -> float:
    """The median of the numbers in `xs` (a NaN: a step without that part, e.g. a skipped update's
    reload, which would make statistics.median depend on the order); NaN when there is none."""
    xs = [x for x in xs if not math.isnan(x)]
    return float(statistics.median(xs)) if xs else float("nan")


def _first(xs) -> float:
    return float(xs[0]) if len(xs) else float("nan")


@cache
def source_commit() -> str:
    """The commit under test: `$ARTSG_COMMIT` when set (a GPU host's copy of the tree carries a
    stale `.git`, so the device command names the commit it runs), else the short git commit of
    the checkout this package runs from, "-dirty" appended when a tracked file differs from it;
    "" when it is no git checkout or git is missing."""
    if os.environ.get("ARTSG_COMMIT"):
        return os.environ["ARTSG_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{commit}-dirty" if dirty else commit


def leg_result(cfg: StepBenchConfig, framework: str, engine: str, max_new: int, step_s, rollout_s, train_s,
                reload_s, tokens, rewards, *, pipeline: bool = False, start_s: float = float("nan"),
                first_train_s: float | None = None, reload_wait_s=None, staleness=None) -> dict:
    """One CSV row (`COLUMNS`): medians over the steps after `cfg.warmup`, the first step's and
    first update's seconds (`first_train_s`; None: the first step's train_s); `reload_wait_s`
    None: all of reload_s was waited for; `staleness`: a pipelined leg's history column, which says
    which steps' rollouts were sampled ahead (`overlap_ratios`; None: no overlap_median)."""
    keep = slice(cfg.warmup if len(step_s) > cfg.warmup else 0, None)
    model_dir = cfg.model_path or default_model_dir()
    hardware = hardware_name(engine if framework == "artsg_nb" else ("gpu" if torch.cuda.is_available() else "cpu"))
    floors = job_floors(model_dir, hardware, max_new, _median(tokens[keep]), cfg.lora_rank)
    return {"framework": framework, "engine": engine, "model": Path(model_dir).name,
            "max_new_tokens": max_new, "steps": len(step_s), "step_s_median": _median(step_s[keep]),
            "rollout_s_median": _median(rollout_s[keep]), "train_s_median": _median(train_s[keep]),
            "reload_s_median": _median(reload_s[keep]), "tokens_per_step": _median(tokens[keep]),
            "reward_first": rewards[0] if rewards else float("nan"),
            "reward_last": rewards[-1] if rewards else float("nan"),
            "hardware": hardware,
            "date": datetime.now().strftime("%Y-%m-%d"), "pipeline": bool(pipeline), "start_s": float(start_s),
            "first_train_s": _first(train_s) if first_train_s is None else float(first_train_s),
            "first_step_s": _first(step_s), "commit": source_commit(), "job": job_label(cfg),
            "reload_wait_s_median": _median((reload_s if reload_wait_s is None else reload_wait_s)[keep]),
            "overlap_median": (_median(overlap_ratios(step_s, rollout_s, train_s, staleness)[keep])
                               if staleness is not None else float("nan")),
            "decode_floor_s": floors.decode_s, "train_floor_s": floors.train_s}


def overlap_ratios(step_s, rollout_s, train_s, staleness) -> list[float]:
    """Per pipelined step k (rows in order): step_s[k] / max(rollout_s[k + 1], train_s[k]). Step k's
    update overlaps the rollouts of step k + 1, sampled ahead and reported in that step's row. A
    ratio only where both step k's rollouts and step k + 1's were sampled ahead (`staleness` 1 in
    both rows): a step that rolled out afresh (the first, one after a skipped update or after
    rollouts ahead that failed) is not the overlap this measures. NaN elsewhere, the last step too
    (its rollouts ahead are in no row)."""
    nan = float("nan")
    ahead = [s == 1 for s in staleness]
    return [s / max(r, t) if a and a_next and t > 0 else nan
            for s, t, r, a, a_next in zip(step_s, train_s, [*rollout_s[1:], nan], ahead, [*ahead[1:], False])]


def job_label(cfg: StepBenchConfig) -> str:
    """The job's shape besides its max_new_tokens: "addition_chat 16x8 r16/32 lr0.0002 seed0" (task,
    groups x group size, LoRA r/alpha, learning rate, seed; rows from before the task was part of
    it have no task word, and their task was "addition")."""
    return (f"{cfg.task} {cfg.groups}x{cfg.group_size} r{cfg.lora_rank}/{cfg.lora_alpha} lr{cfg.learning_rate:g} "
            f"seed{cfg.seed}")


# ---------------------------------------------------------------------------- named jobs
JOBS: dict[str, tuple[str, tuple[int, ...]]] = {
    "smollm2": ("smollm2", (8, 256)),
    "1.5b": ("random-1.5b", (256, 1024)),
    "7b": ("random-7b", (256, 1024)),
}
"""Issue 48's jobs: name → (model, new-token budgets). "smollm2" is SmolLM2-135M-Instruct; the others
random-weight benchmark models at real shapes (models/random_model.py: their rewards mean nothing,
the speed is what they measure)."""
SMOLLM2 = "smollm2-135m-instruct"


def parse_job(spec: str) -> tuple[str, tuple[int, ...]]:
    """"7b" → ("7b", its budgets); "7b:256" → ("7b", (256,))."""
    name, _, budget = spec.partition(":")
    if name not in JOBS:
        raise ValueError(f"unknown job {spec!r}; known: {', '.join(JOBS)} (NAME or NAME:MAX_NEW_TOKENS)")
    return name, (int(budget),) if budget else JOBS[name][1]


def job_model_dir(name: str, models_dir: str | None) -> str:
    """The directory of a named job's model, built when missing (a random model in a process of its
    own: it draws its weights on the GPU, whose context this process must not keep)."""
    from ..models.pretrained import built_model_dir
    from ..models.random_model import default_out_dir

    smol = Path(models_dir) / "smollm2" if models_dir else None
    smol_dir = str(smol) if smol is not None and (smol / "config.json").is_file() else None
    if name == "smollm2":
        return smol_dir or built_model_dir(SMOLLM2)
    shape = name.removeprefix("random-")
    out = Path(models_dir) / name if models_dir else default_out_dir(shape, "llama", 0)
    if not (out / ".complete").is_file():
        tokenizer = smol_dir or built_model_dir(SMOLLM2)
        subprocess.run([sys.executable, "-m", "artsg_nb.models", "random", "--shape", shape, str(out),
                        "--tokenizer", tokenizer], check=True)
    return str(out)


def trl_vllm_memory(cfg: StepBenchConfig, model_dir: str) -> float:
    """vLLM's share of the GPU in TRL's fast path: cfg's, else TRL_VLLM_MEMORY by the model's weights."""
    if cfg.vllm_gpu_memory_utilization is not None:
        return cfg.vllm_gpu_memory_utilization
    model = ModelMemory.from_dir(model_dir)
    return TRL_VLLM_MEMORY[bool(model and model.weights >= LARGE_MODEL_BYTES)]
