"""Step benchmark: N GRPO steps of one job through artsg_nb and through TRL's GRPOTrainer, in TRL's
fast path (vLLM colocated) and with plain generate.

    python -m artsg_nb.bench.step --engine sglang --model-path /path/SmolLM2-135M-Instruct \\
        --max-new-tokens 8 256 --steps 10 --frameworks artsg_nb trl_vllm trl
    python -m artsg_nb.bench.step --engine sglang --jobs smollm2 1.5b 7b:256 --models-dir /tmp/models

The job is the same on every side: prompts of the task (`--task`, default `addition_chat`: "What is
a + b?", the reply's last number is its answer; chat-templated: artsg_nb renders them itself, TRL
gets them as conversations), its reward (as a TRL reward function), LoRA r/alpha
on the 7 projections, `groups` prompts x `group_size` samples per step (TRL: num_generations=G,
per-device batch = groups x G, one generation batch per optimizer step), the learning rate
(constant, AdamW), temperature 1.0, the loss (dapo, ε 0.2 / 0.28, scale_rewards "group"), beta 0,
no gradient checkpointing. TRL runs twice (step_trl.py): `trl_vllm`, its fast path and the mode
it recommends, GRPOTrainer(use_vllm=True, vllm_mode="colocate") with vLLM in the trainer's process
at vllm_gpu_memory_utilization 0.35 (0.4 for models of ~2 B params and up), and `trl`, plain
`model.generate` (use_vllm=False). Each is timed per step by a TrainerCallback (on_step_begin/end);
its rollout time is its `_generate` less the weight sync into vLLM inside it (its reload).
artsg_nb runs its steps as a notebook's training cell does, `await GRPORun.run(steps)`, each step
timed from the row before to its own (rollout_s / train_s / reload_s from the row; a pipelined
step followed by another serves its version in the next one, beside its update), and
`GRPORun.start()` is timed too, at RunConfig's defaults except the job's fields (`artsg_run_config`): the
served-adapter check included, unless `--verify-adapter False`. `--jobs` runs issue 48's named
jobs (step_job.JOBS: SmolLM2 at 8 and 256 new tokens, the random-weight 1.5B and 7B Llama shapes at
256 and 1024) one after the other into one CSV, their models from `--models-dir`.

A leg is one framework x max_new_tokens, and for artsg_nb also one RunConfig(pipeline=...) value
(`--pipeline False True`: synchronous and pipelined; TRL has no pipeline and runs once). Legs run
per job as artsg_nb synchronous, artsg_nb pipelined, TRL + vLLM, TRL, each in its own process (`--leg`;
the TRL + vLLM leg with the vLLM bundle's site folder after the kernel's on its PYTHONPATH):
Unsloth patches transformers on import, and a GPU is given back cleanly when a process ends. This
module imports nothing of transformers, PEFT or TRL (the TRL leg lives in step_trl.py and is
imported by its own process only), so the artsg_nb leg's trainer imports Unsloth first, as Unsloth
requires. The first `warmup` steps are left out of the medians; the first step's and the first
update's seconds get columns of their own. Results: one row per leg with exactly `COLUMNS`,
written to `benchmarks/results/<date>-step-<hardware>.csv` (`--out`) after every leg. An existing
CSV is merged into (`--no-merge`: overwritten): the rows of the legs just run replace those of
the same framework, engine, model, max_new_tokens and pipeline, the others stay, so legs run in
separate calls (`--frameworks artsg_nb --pipeline True` after `--pipeline False`) end up in one
file. The CLI prints the table, the ratios TRL / artsg_nb against each TRL mode per job and
pipeline setting, and each row's rollout and update as a share of the card's floor (floors.py).

What it does not do: plot (plots.plot_step_benchmark) or compare engines' raw speed (bench.run).
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
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

from ..files import write_atomic
from ..rl.grpo import GRPOConfig
from ..run.config import RunConfig
from ..run.session import GRPORun
from .results import pipeline_flags, step_ratios, with_reload_wait
from .floors import floor_shares
from .step_job import COLUMNS, FRAMEWORKS, JOBS, StepBenchConfig, job_model_dir, leg_result, parse_job

log = logging.getLogger(__name__)

LEG_KEY = ["framework", "engine", "model", "max_new_tokens", "pipeline", "job"]
"""The columns that name a leg's row: a merged CSV holds one row per value of them."""


# ---------------------------------------------------------------------------- the artsg_nb leg
def artsg_run_config(cfg: StepBenchConfig, max_new: int, pipeline: bool) -> RunConfig:
    """The job as a RunConfig: the job's fields (task, model, group shape, tokens, temperature,
    learning rate, LoRA shape, seed, the loss), `pipeline`, and only those of `schedule`,
    `verify_adapter` and `api_key` that `cfg` sets; RunConfig's defaults for everything else.
    verbose=False: no progress line per step."""
    run_dir = Path(cfg.run_dir) / f"artsg_nb-{cfg.engine}-{max_new}{'-pipe' if pipeline else ''}"
    chosen = {"schedule": cfg.schedule, "verify_adapter": cfg.verify_adapter, "api_key": cfg.api_key}
    return RunConfig(task=cfg.task, engine=cfg.engine, model_path=cfg.model_path, run_dir=str(run_dir),
                     group_size=cfg.group_size, groups_per_step=cfg.groups, max_new_tokens=max_new,
                     temperature=1.0, learning_rate=cfg.learning_rate, lora_rank=cfg.lora_rank,
                     lora_alpha=cfg.lora_alpha, seed=cfg.seed, pipeline=pipeline,
                     grpo=GRPOConfig(loss_type="dapo", beta=0.0, max_completion_length=max_new),
                     verbose=False, **{k: v for k, v in chosen.items() if v is not None})


async def artsg_leg(cfg: StepBenchConfig, max_new: int, pipeline: bool = False) -> dict:
    """`cfg.steps` GRPORun steps of the job; one result row (start_s: GRPORun.start(), server and
    trainer up)."""
    rc = artsg_run_config(cfg, max_new, pipeline)
    shutil.rmtree(rc.run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    run = GRPORun(rc).start()
    start_s = time.perf_counter() - t0
    step_s, rows, last = [], [], [time.perf_counter()]

    def timed(row: dict) -> None:  # a step's time: from the row before to its own, as `run()` goes
        now = time.perf_counter()
        rows.append(row)
        step_s.append(now - last[0])
        last[0] = now

    try:
        await run.run(cfg.steps, on_step=timed)
    finally:
        run.stop()
    col = lambda k: [float(r[k]) if r.get(k) is not None else float("nan") for r in rows]  # noqa: E731
    skipped = sum(bool(r.get("update_skipped")) for r in rows)
    if skipped:  # TRL computes a zero gradient for such a step; the train medians are not the same work
        log.warning("artsg_nb skipped the update on %d of %d steps (max_new_tokens=%d): every group's rewards "
                    "were equal, so no gradient. Its train/reload medians are not comparable with TRL's; try "
                    "more groups, a larger group_size or more tokens until the job has a reward signal",
                    skipped, len(rows), max_new)
    updated = [r for r in rows if not r.get("update_skipped")]  # the first update: a skipped one trains nothing
    first_train_s = float(updated[0]["train_s"]) if updated else float("nan")
    return leg_result(cfg, "artsg_nb", cfg.engine, max_new, step_s, col("rollout_s"), col("train_s"),
                       col("reload_s"), col("tokens"), col("reward_mean"), pipeline=pipeline, start_s=start_s,
                       first_train_s=first_train_s, reload_wait_s=col("reload_wait_s") if pipeline else None,
                       staleness=col("staleness") if pipeline else None)


# ---------------------------------------------------------------------------- orchestration
def legs(cfg: StepBenchConfig) -> list[tuple[str, int, bool]]:
    """(framework, max_new_tokens, pipeline) of each leg, in running order: per job artsg_nb
    synchronous, artsg_nb pipelined, TRL + vLLM colocated, TRL with plain generate (each TRL mode
    once, pipeline False). On the CPU engine TRL's fast path is left out: vLLM colocated needs a GPU."""
    chosen = set(cfg.frameworks)
    if "trl_vllm" in chosen and (cfg.engine == "cpu" or not vllm_installed(cfg)):
        log.warning("leaving out TRL's fast path (trl_vllm): %s", "vLLM colocated needs a GPU (engine cpu)"
                    if cfg.engine == "cpu" else "vllm is not importable here nor in --vllm-pythonpath / "
                    "$ARTSG_VLLM_PYTHONPATH (on the GPU host: carry the .vllm-bundle parts, tools/gpu/install.sh)")
        chosen.discard("trl_vllm")
    frameworks = sorted(chosen, key=lambda fw: _leg_rank(fw, False))
    return [(fw, m, pipe) for m in dict.fromkeys(cfg.max_new_tokens) for fw in frameworks
            for pipe in (sorted(set(cfg.pipeline)) if fw == "artsg_nb" else [False])]


def _leg_rank(framework: str, pipeline: bool) -> int:
    """A leg's place within its job: artsg_nb synchronous, artsg_nb pipelined, TRL, anything else."""
    return FRAMEWORKS.index(framework) * 2 + bool(pipeline) if framework in FRAMEWORKS else 2 * len(FRAMEWORKS)


def leg_name(framework: str, max_new: int, pipeline: bool) -> str:
    """A leg as `--leg` names it: "artsg_nb:256", "artsg_nb:256:pipe", "trl:256"."""
    return f"{framework}:{max_new}{':pipe' if pipeline else ''}"


def parse_leg_name(name: str) -> tuple[str, int, bool]:
    """leg_name's inverse."""
    framework, max_new, *rest = name.split(":")
    if rest not in ([], ["pipe"]):
        raise ValueError(f"leg {name!r}: expected FRAMEWORK:MAX_NEW or FRAMEWORK:MAX_NEW:pipe")
    return framework, int(max_new), rest == ["pipe"]


def run_leg(cfg: StepBenchConfig, framework: str, max_new: int, pipeline: bool = False) -> dict:
    """One leg in this process."""
    if framework == "artsg_nb":
        return asyncio.run(artsg_leg(cfg, max_new, pipeline))
    if framework in ("trl", "trl_vllm"):
        from .step_trl import trl_leg  # here, not above: the artsg_nb leg must import Unsloth before TRL does

        return trl_leg(cfg, max_new, vllm=framework == "trl_vllm")
    raise ValueError(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")


def _leg_in_subprocess(cfg: StepBenchConfig, framework: str, max_new: int, pipeline: bool = False) -> dict:
    name = leg_name(framework, max_new, pipeline)
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, out_path = Path(tmp) / "cfg.json", Path(tmp) / "row.json"
        cfg_path.write_text(json.dumps(asdict(cfg)))
        cmd = [sys.executable, "-m", "artsg_nb.bench.step", "--leg", name, str(cfg_path), str(out_path)]
        proc = subprocess.run(cmd, env=leg_env(cfg, framework))
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"step benchmark leg {name} failed with exit code {proc.returncode}; its output is "
                               f"above. Try: run it alone with `{' '.join(cmd[:5])}` after fixing the cause.")
        return json.loads(out_path.read_text())


def leg_env(cfg: StepBenchConfig, framework: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """A leg's process environment: this one's, and for TRL's fast path vLLM's site folder after
    the kernel's packages on PYTHONPATH (cfg.vllm_pythonpath, else $ARTSG_VLLM_PYTHONPATH)."""
    env = dict(os.environ if base is None else base)
    site = cfg.vllm_pythonpath or env.get("ARTSG_VLLM_PYTHONPATH")
    if framework == "trl_vllm" and site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), site) if p)
    return env


def vllm_installed(cfg: StepBenchConfig) -> bool:
    """Whether the trl_vllm leg's process can import vllm (found without importing it here)."""
    site = cfg.vllm_pythonpath or os.environ.get("ARTSG_VLLM_PYTHONPATH")
    in_site = any((Path(p) / "vllm" / "__init__.py").is_file() for p in (site or "").split(os.pathsep) if p)
    return in_site or importlib.util.find_spec("vllm") is not None


def run_jobs(cfg: StepBenchConfig) -> pd.DataFrame:
    """cfg.jobs one after the other (`run_step_bench` each, with the job's model and budgets) into
    one CSV: the first merges as cfg.merge says, the others into what the first wrote."""
    if cfg.model_path is not None:
        raise ValueError("give --jobs or --model-path, not both: each job names its own model")
    df, out = pd.DataFrame(columns=COLUMNS), cfg.out
    for i, spec in enumerate(cfg.jobs):
        name, budgets = parse_job(spec)
        model = job_model_dir(JOBS[name][0], cfg.models_dir)
        job = replace(cfg, jobs=(), model_path=model, max_new_tokens=budgets, out=out, merge=cfg.merge or i > 0)
        df = run_step_bench(job)
        out = out or str(default_path(df, cfg.results_dir))
    return df


def run_step_bench(cfg: StepBenchConfig) -> pd.DataFrame:
    """Every leg (`legs`), each in its own process unless cfg.isolate is False. The CSV is written
    after each leg (one that fails or runs out of time keeps the rows before it), merged into the
    rows already in it unless cfg.merge is False (`merge_rows`); the frame as written."""
    todo = legs(cfg)
    if not todo:
        raise ValueError(f"no legs to run: frameworks={cfg.frameworks}, pipeline={cfg.pipeline}, "
                         f"max_new_tokens={cfg.max_new_tokens}")
    leg = _leg_in_subprocess if cfg.isolate else run_leg
    path, df = None, pd.DataFrame(columns=COLUMNS)
    for framework, max_new, pipeline in todo:
        row = pd.DataFrame([leg(cfg, framework, max_new, pipeline)]).reindex(columns=COLUMNS)
        if path is None:  # the default file is named after the first row's hardware
            path = Path(cfg.out) if cfg.out else default_path(row, cfg.results_dir)
            df = earlier_rows(path) if cfg.merge else df
        df, replaced = merge_rows(df, row)
        for old in replaced.itertuples():
            log.info("%s: replacing the earlier row of %s %s %s max_new_tokens=%s%s (commit %s, %s)", path,
                     old.framework, old.engine, old.model, old.max_new_tokens, " pipelined" if old.pipeline else "",
                     old.commit if isinstance(old.commit, str) and old.commit else "?", old.date)
        write_atomic(path, df.to_csv(index=False))
        log.info("wrote %s (%d rows)", path, len(df))
    return df


def earlier_rows(path: Path) -> pd.DataFrame:
    """The rows already in `path` in COLUMNS (new columns empty; `pipeline` False where the file
    predates it); none when there is no file or it is no step benchmark CSV (no `framework`)."""
    try:
        old = pd.read_csv(path, dtype={"commit": str})  # a hash of digits is no number
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return pd.DataFrame(columns=COLUMNS)
    if "framework" not in old:
        log.warning("%s has no framework column: not a step benchmark CSV, it will be overwritten", path)
        return pd.DataFrame(columns=COLUMNS)
    old = old.reindex(columns=COLUMNS)
    old["pipeline"] = pipeline_flags(old["pipeline"])
    return with_reload_wait(old)


def _leg_keys(df: pd.DataFrame) -> list[tuple]:
    """Each row's LEG_KEY, as comparable values (a CSV may read a model name as a number)."""
    flags = pipeline_flags(df["pipeline"])
    return [(str(r.framework), str(r.engine), str(r.model), int(r.max_new_tokens), bool(p),
             "" if pd.isna(r.job) else str(r.job)) for r, p in zip(df[LEG_KEY].itertuples(), flags)]


def merge_rows(earlier: pd.DataFrame, new: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(merged, replaced): `earlier`'s rows but those of a leg in `new` (same LEG_KEY), and
    `new`'s, in leg order per job (artsg_nb synchronous, pipelined, TRL; stable otherwise); the
    rows of `earlier` that were dropped."""
    new_keys = set(_leg_keys(new))
    unknown_job = {k[:-1] for k in new_keys}  # a row from before the job column: the same leg if all else is
    gone = [k in new_keys or (k[-1] == "" and k[:-1] in unknown_job) for k in _leg_keys(earlier)]
    replaced = earlier[gone]
    parts = [part for part in (earlier[[not g for g in gone]], new) if len(part)]
    merged = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=COLUMNS)
    merged["pipeline"] = pipeline_flags(merged["pipeline"])
    rank = [_leg_rank(fw, pipe) for fw, pipe in zip(merged["framework"], merged["pipeline"])]
    order = merged.assign(_rank=rank).sort_values(["max_new_tokens", "_rank"], kind="stable").index
    return merged.loc[order].reset_index(drop=True).reindex(columns=COLUMNS), replaced.reset_index(drop=True)


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
    """A leg's child process: `--leg FRAMEWORK:MAX_NEW[:pipe] CONFIG_JSON OUT_JSON` (_leg_in_subprocess)."""
    leg, cfg_path, out_path = argv
    cfg = StepBenchConfig(**json.loads(Path(cfg_path).read_text()))
    cfg = replace(cfg, frameworks=tuple(cfg.frameworks), max_new_tokens=tuple(cfg.max_new_tokens),
                  pipeline=tuple(cfg.pipeline))
    Path(out_path).write_text(json.dumps(run_leg(cfg, *parse_leg_name(leg))))


def main(argv: Sequence[str] | None = None) -> pd.DataFrame | None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--leg"]:  # a child process: one leg, its row as JSON
        _leg_main(argv[1:])
        return None
    cfg = parse_args(argv)
    df = run_jobs(cfg) if cfg.jobs else run_step_bench(cfg)
    print_summary(df)
    return df


def print_summary(df: pd.DataFrame) -> None:
    """The rows, the ratios against each TRL mode, and each row's parts as shares of the card's floor."""
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.float_format", "{:.3g}".format):
        print(df.to_string(index=False))
        r = step_ratios(df)
        if not r.empty:
            print("\nartsg_nb vs TRL per job and pipeline setting: speedup_vs_trl_vllm = TRL + vLLM colocated (TRL's "
                  "fast path) step / artsg_nb step; speedup_vs_trl = TRL with plain generate step / artsg_nb step; "
                  "first_train_s: artsg_nb's first update:")
            print(r.to_string())
        shares = floor_shares(df)
        if not shares.empty:
            print("\nshare of the card's floor (floor / measured; decode: max_new_tokens x weight bytes / HBM "
                  "bandwidth, train: (4 N + 6 P) x tokens / bf16 peak; benchmarks/README.md):")
            print(shares.to_string(index=False))


if __name__ == "__main__":
    main()
