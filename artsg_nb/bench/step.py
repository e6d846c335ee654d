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
transformers on import, and a GPU is given back cleanly when a process ends. This module imports
nothing of transformers, PEFT or TRL (the TRL leg lives in step_trl.py and is imported by its own
process only), so the artsg_nb leg's trainer imports Unsloth first, as Unsloth requires. The first `warmup`
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
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path
from typing import Sequence

import pandas as pd
import tyro

from ..rl.grpo import GRPOConfig
from ..run.config import RunConfig
from ..run.session import GRPORun
from .results import step_ratios
from .step_job import COLUMNS, FRAMEWORKS, StepBenchConfig, leg_result

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- the artsg_nb leg
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
    return leg_result(cfg, "artsg_nb", cfg.engine, max_new, step_s, col("rollout_s"), col("train_s"),
                       col("reload_s"), col("tokens"), col("reward_mean"))


# ---------------------------------------------------------------------------- orchestration
def run_leg(cfg: StepBenchConfig, framework: str, max_new: int) -> dict:
    """One leg in this process."""
    if framework == "artsg_nb":
        return asyncio.run(artsg_leg(cfg, max_new))
    if framework == "trl":
        from .step_trl import trl_leg  # here, not above: the artsg_nb leg must import Unsloth before TRL does

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
