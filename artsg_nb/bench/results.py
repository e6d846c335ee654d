"""Benchmark results: the row format, the CSV files, and the tables made from them.

What it does
- `COLUMNS`: one row per engine x radix x schedule x mode x repeat (benchmarks/README.md says what
  each column means); `results_frame(rows)` fills in the columns derived across rows, and
  `save_results` writes the CSV (default runs/bench/<date>-<engine>-<hardware>.csv: a benchmark you
  run goes under runs/, and into the tracked benchmarks/results/ only when `--out` puts it there).
- `load_results(dir)`, `latest_results(df)`, `result_sources(df)`, `results_table(df)`: committed
  benchmark CSVs (`gpu` is accepted for `hardware`) with the file each row came from and a
  `workload` label per shape (`label_workloads`), the newest file per engine and workload, where
  each file comes from, and the toolkit rows averaged over repeats; `summary_table` is the text
  table the CLI prints.
- `load_step_results(dir)`, `step_ratios(df)`: the step benchmark's CSVs (bench.step), the newest
  per hardware, and TRL step / artsg_nb step per job.

What it does not do: measure (bench.run) or draw (plots.plot_engine_comparison).
"""
from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd

COLUMNS = [
    "date", "hardware", "engine", "engine_version", "model", "mode", "schedule", "radix", "repeat",
    "groups", "group_size", "turns", "prompt_tokens", "new_tokens", "stream_all", "requests",
    "samples", "failed", "mean_prompt_tokens", "wall_s", "out_tok_s", "total_tok_s",
    "ttft_p50_s", "ttft_p95_s", "e2e_p50_s", "e2e_p95_s", "hit_rate_server", "hit_rate_requests",
    "hit_rate_theoretical", "hit_vs_theoretical", "raw_fraction", "flushed", "reload_save_s",
    "reload_load_s", "reload_first_s", "reload_s", "flags", "workload"]
"""Columns of a benchmark DataFrame (plots.plot_engine_comparison reads them by name).."""
SHAPE_COLUMNS = ["groups", "group_size", "prompt_tokens", "new_tokens", "turns", "stream_all"]
"""Benchmark columns that make two rows comparable (besides engine, schedule and radix)."""


# ---------------------------------------------------------------------------- writing

def results_frame(rows: list[dict]) -> pd.DataFrame:
    """Run rows as a frame in COLUMNS order, with `hit_vs_theoretical` and `raw_fraction`
    (a toolkit row's output tok/s over its raw replay's) filled in."""
    df = pd.DataFrame(rows).reindex(columns=COLUMNS)
    best = df["hit_rate_server"].where(df["hit_rate_server"].notna(), df["hit_rate_requests"])
    df["hit_vs_theoretical"] = best / df["hit_rate_theoretical"]
    raw = df[df["mode"] == "raw"].set_index(["engine", "radix", "schedule", "repeat"])["out_tok_s"]
    key = list(zip(df["engine"], df["radix"], df["schedule"], df["repeat"]))
    df["raw_fraction"] = [row.out_tok_s / raw[k] if row.mode == "toolkit" and k in raw.index else np.nan
                          for k, row in zip(key, df.itertuples())]
    return df


def save_results(df: pd.DataFrame, out: str | os.PathLike | None, engine: str) -> Path:
    """Write `df` to `out` (None: runs/bench/<date>-<engine>-<hardware>.csv); the path."""
    path = Path(out) if out else _default_path(df, engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    return path


def _default_path(df: pd.DataFrame, engine: str) -> Path:
    hw = str(df["hardware"].iloc[0]) if len(df) else "unknown"
    slug = "".join(c if c.isalnum() else "-" for c in hw.lower()).strip("-")
    return BENCH_RUNS / f"{datetime.now():%Y%m%d-%H%M}-{engine}-{slug}.csv"


BENCH_RUNS = Path("runs/bench")
"""Where a benchmark's CSV goes unless --out says otherwise (runs/ is not tracked)."""


SUMMARY = ["engine", "mode", "schedule", "radix", "wall_s", "out_tok_s", "ttft_p50_s", "e2e_p50_s",
           "hit_rate_server", "hit_rate_requests", "hit_rate_theoretical", "raw_fraction", "reload_s"]


def summary_table(df: pd.DataFrame) -> str:
    """The compact text table the CLI prints."""
    return df[SUMMARY].to_string(index=False, float_format=lambda x: f"{x:.3g}")


# ---------------------------------------------------------------------------- reading

def load_results(results_dir: str | os.PathLike, gpu: str | None = None) -> pd.DataFrame:
    """Every `*.csv` in `results_dir` as one frame, `source` = the file name and `workload` labelled
    (`label_workloads`); empty, with those columns, when there is none. `gpu` keeps rows whose
    gpu/hardware contains it (case-insensitive), e.g. "H200"."""
    frames = [_read_csv(f) for f in sorted(Path(results_dir).glob("*.csv"))]
    frames = [f for f in frames if {"engine", "mode", "schedule"} <= set(f.columns)]  # not step / scale-out CSVs
    if not frames:
        return pd.DataFrame(columns=["source", "gpu", *COLUMNS])
    df = pd.concat(frames, ignore_index=True)
    if "gpu" not in df:
        df["gpu"] = df.get("hardware")
    if "hardware" not in df:
        df["hardware"] = df["gpu"]
    df["date"] = pd.to_datetime(df.get("date"), errors="coerce")
    if gpu:
        df = df[df["gpu"].astype(str).str.contains(gpu, case=False, regex=False)]
    return label_workloads(df).reset_index(drop=True)


def _read_csv(path: Path) -> pd.DataFrame:
    """One results CSV, `source` = its file name; a commit stays text (`5683e12` is no number)."""
    return pd.read_csv(path, dtype={"commit": str}).assign(source=path.name)


def label_workloads(df: pd.DataFrame) -> pd.DataFrame:
    """`workload` = the row's own label, if any, and its shape, e.g. "A: 8x8, 1500-token prompts,
    128 new tokens, 1 turn": rows of different shapes must not be averaged together."""
    df = df.copy()
    shape = [f"{_int(r.groups)}x{_int(r.group_size)}, {_int(r.prompt_tokens)}-token prompts, "
             f"{_int(r.new_tokens)} new tokens, {_int(r.turns)} turn{'' if _int(r.turns) == '1' else 's'}"
             + ("" if str(r.stream_all).lower() != "false" else ", leaders stream")
             for r in df.reindex(columns=SHAPE_COLUMNS).itertuples()]
    given = df["workload"] if "workload" in df else pd.Series(np.nan, index=df.index)
    df["workload"] = [s if pd.isna(g) or not str(g).strip() else f"{g}: {s}" for g, s in zip(given, shape)]
    return df


def latest_results(df: pd.DataFrame) -> pd.DataFrame:
    """Per (engine, gpu, workload), only the rows of the newest file that has it: older runs stay
    committed for the record, the comparison shows the current one."""
    if df.empty:
        return df
    key = ["engine", "gpu", "workload"]
    dates = df.groupby([*key, "source"], dropna=False)["date"].max().reset_index()
    newest = dates.sort_values("date", na_position="first").groupby(key, dropna=False).tail(1)
    return df.merge(newest[[*key, "source"]], on=[*key, "source"])


def load_step_results(results_dir: str | os.PathLike) -> pd.DataFrame:
    """The newest step benchmark CSV (`*-step-*.csv`, bench.step) of each hardware, one frame with
    `source` = its file name; empty when there is none."""
    frames = [_read_csv(f) for f in sorted(Path(results_dir).glob("*-step-*.csv"))]
    if not frames:
        return pd.DataFrame()
    df = with_reload_wait(pd.concat(frames, ignore_index=True))
    newest = df.groupby("hardware")["source"].max()  # file names start with the date
    return df[df["source"].isin(newest)].reset_index(drop=True)


def with_reload_wait(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with `reload_wait_s_median` where a row from before that column can say it: a
    synchronous artsg_nb row waited for all of its reload, a TRL row for none; a pipelined one
    stays unknown (NaN)."""
    if "framework" not in df or "reload_s_median" not in df:
        return df
    wait = df["reload_wait_s_median"] if "reload_wait_s_median" in df else pd.Series(np.nan, index=df.index)
    sync = (df["framework"] == "artsg_nb") & ~pipeline_flags(df.get("pipeline", pd.Series(False, index=df.index)))
    wait = wait.mask(wait.isna() & sync, df["reload_s_median"]).mask(wait.isna() & (df["framework"] == "trl"), 0.0)
    return df.assign(reload_wait_s_median=wait)


def pipeline_flags(values: pd.Series) -> pd.Series:
    """A step CSV's `pipeline` column as bools: True and "True" (a column with gaps reads as text)
    are True; False, "False" and a missing value (a row from before the column) False."""
    return values.map(lambda v: str(v).strip().lower() == "true")


TRL_MODES = ("trl_vllm", "trl")
"""The TRL rows a ratio is taken against: TRL + vLLM colocated (its fast path), TRL with plain generate."""


def step_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Per hardware (file: `source`, when the frame has it) and job (max_new_tokens), and per
    `pipeline` setting where the frame has that column: artsg_nb's median step time, each TRL
    mode's for the same job (TRL_MODES present in the frame: `trl_vllm_step_s`, `trl_step_s`) and
    TRL / artsg_nb (`speedup_vs_trl_vllm`, `speedup_vs_trl`; > 1 means artsg_nb is faster), with artsg_nb's
    `reload_s_median`, `reload_wait_s_median`, `first_train_s` (its first update) and `overlap_median`
    (a pipelined row's median per step of step / max(its update, the rollouts it sampled ahead))
    where the frame has them, and per
    `job` shape where it has that. Rows of the same key are averaged; empty unless artsg_nb and a
    TRL mode are in the frame."""
    if df.empty or "framework" not in df:
        return pd.DataFrame()
    by = ["max_new_tokens"] if "hardware" not in df or "source" not in df else ["source", "max_new_tokens"]
    if "job" in df:  # rows of different job shapes are never compared; a file from before: ""
        df, by = df.assign(job=df["job"].fillna("").astype(str)), by + ["job"]
    if "model" in df and df["model"].nunique() > 1:  # several models' jobs in one file
        df, by = df.assign(model=df["model"].astype(str)), ["model", *by]
    ours = df[df["framework"] == "artsg_nb"]
    peers = [fw for fw in TRL_MODES if (df["framework"] == fw).any()]
    if ours.empty or not peers:
        return pd.DataFrame()
    keys = by + (["pipeline"] if "pipeline" in df else [])
    if "pipeline" in df:
        ours = ours.assign(pipeline=pipeline_flags(ours["pipeline"]))
    extra = [c for c in ("reload_s_median", "reload_wait_s_median", "first_train_s", "overlap_median") if c in df]
    out = ours.groupby(keys)[["step_s_median", *extra]].mean().rename(columns={"step_s_median": "artsg_nb_step_s"})
    ratios = []
    for fw in peers:
        theirs = df[df["framework"] == fw].groupby(by)["step_s_median"].mean().rename(f"{fw}_step_s")
        out = out.join(theirs, on=by)
        out[f"speedup_vs_{fw}"] = out[f"{fw}_step_s"] / out["artsg_nb_step_s"]
        ratios += [f"{fw}_step_s", f"speedup_vs_{fw}"]
    out = out[["artsg_nb_step_s", *ratios, *extra]]
    if "job" in by and out.index.get_level_values("job").nunique() == 1:  # one job: no need to name it
        out = out.droplevel("job")
    return out


def result_sources(df: pd.DataFrame) -> pd.DataFrame:
    """Where each result comes from: one row per file with its date, GPU, engines and versions,
    workloads and flags."""
    def join(values):
        return ", ".join(dict.fromkeys(str(v) for v in values if pd.notna(v)))

    return df.groupby("source").agg(date=("date", "min"), gpu=("gpu", join), engines=("engine", join),
                                    engine_version=("engine_version", join), workloads=("workload", "nunique"),
                                    flags=("flags", join), rows=("mode", "size"))


def results_table(df: pd.DataFrame) -> pd.DataFrame:
    """Toolkit rows averaged over repeats, one row per workload, engine, radix and schedule;
    `hit_rate` from the server's counters, else the per-request counts. Rows without a
    `workload` (run_bench's) are labelled first."""
    df = df[df["mode"] == "toolkit"] if "mode" in df else pd.DataFrame(columns=["workload"])
    df = df.copy() if "workload" in df else label_workloads(df)
    df["hit_rate"] = df.get("hit_rate_server", pd.Series(dtype=float)).fillna(df.get("hit_rate_requests"))
    metrics = ["out_tok_s", "ttft_p50_s", "e2e_p50_s", "hit_rate", "hit_rate_theoretical", "raw_fraction", "reload_s"]
    df = df.reindex(columns=["workload", "engine", "radix", "schedule", *metrics])
    df[metrics] = df[metrics].apply(pd.to_numeric, errors="coerce")
    return df.groupby(["workload", "engine", "radix", "schedule"], sort=False, dropna=False)[metrics].mean()


def _int(value) -> str:
    return str(int(value)) if pd.notna(value) else "?"
