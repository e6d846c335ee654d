"""bench.results: the committed benchmark CSVs read back, labelled by workload, tabulated."""
import math

import pandas as pd
import pytest

from artsg_nb.bench import results

def bench_rows(engine="sglang", hardware="NVIDIA H200 x1", date="2026-12-01T10:00:00", **shape):
    base = {"date": date, "hardware": hardware, "engine": engine, "engine_version": "0.5.14",
            "flags": "--engine " + engine, "groups": 8, "group_size": 8, "prompt_tokens": 1500,
            "new_tokens": 128, "turns": 1, "stream_all": True, "radix": "on", **shape}
    return [{**base, "mode": mode, "schedule": schedule, "repeat": repeat, "out_tok_s": out,
             "hit_rate_server": 0.5, "hit_rate_theoretical": 0.875}
            for mode, schedule, repeat, out in [("toolkit", "naive", 0, 100.0), ("toolkit", "naive", 1, 200.0),
                                                ("raw", "naive", 0, 1000.0), ("toolkit", "prefix", 0, 300.0)]]


def write_csv(path, rows):
    pd.DataFrame(rows).to_csv(path, index=False)


def test_load_results_without_files_is_empty_with_the_bench_columns(tmp_path):
    df = results.load_results(tmp_path)
    assert df.empty and {"source", "gpu", "workload", "engine", "mode"} <= set(df.columns)
    assert results.latest_results(df).empty
    assert results.results_table(df).empty


def test_load_results_filters_by_gpu_and_keeps_the_newest_file_per_workload(tmp_path):
    write_csv(tmp_path / "old-sglang.csv", bench_rows(date="2026-11-01T10:00:00"))
    write_csv(tmp_path / "new-sglang.csv", bench_rows(date="2026-12-01T10:00:00"))
    write_csv(tmp_path / "prefill-sglang.csv", bench_rows(date="2026-10-01T10:00:00", prompt_tokens=6000))
    write_csv(tmp_path / "cpu.csv", bench_rows(engine="cpu", hardware="cpu x2"))
    df = results.load_results(tmp_path, gpu="h200")
    assert set(df["source"]) == {"old-sglang.csv", "new-sglang.csv", "prefill-sglang.csv"}
    latest = results.latest_results(df)
    assert set(latest["source"]) == {"new-sglang.csv", "prefill-sglang.csv"}  # older shape kept: different workload
    assert sorted(latest["workload"].unique()) == ["8x8, 1500-token prompts, 128 new tokens, 1 turn",
                                                   "8x8, 6000-token prompts, 128 new tokens, 1 turn"]


def test_a_gpu_column_and_a_workload_label_are_accepted(tmp_path):
    rows = [{**r, "gpu": r.pop("hardware"), "workload": "A", "stream_all": False} for r in bench_rows()]
    write_csv(tmp_path / "labelled.csv", rows)
    df = results.load_results(tmp_path, gpu="H200")
    assert (df["hardware"] == "NVIDIA H200 x1").all()
    assert df["workload"].iloc[0] == "A: 8x8, 1500-token prompts, 128 new tokens, 1 turn, leaders stream"
    assert results.results_table(df).index.get_level_values("workload").unique().tolist() == [df["workload"].iloc[0]]
    sources = results.result_sources(df)
    assert sources.loc["labelled.csv", ["engines", "engine_version", "rows"]].tolist() == ["sglang", "0.5.14", 4]


def test_results_table_averages_toolkit_repeats(tmp_path):
    table = results.results_table(pd.DataFrame(bench_rows()))
    naive = table.xs("naive", level="schedule")
    assert naive["out_tok_s"].iloc[0] == pytest.approx(150.0)  # (100 + 200) / 2; the raw row is left out
    assert naive["hit_rate"].iloc[0] == pytest.approx(0.5)
    assert len(table) == 2 and not math.isnan(table["hit_rate_theoretical"].iloc[0])


def test_a_benchmark_without_out_writes_under_runs_not_into_the_tracked_results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = results.save_results(pd.DataFrame({"hardware": ["cpu x2"], "engine": ["cpu"]}), None, "cpu")
    assert path.parts[:2] == ("runs", "bench") and path.exists()
    assert not (tmp_path / "benchmarks").exists()


def test_models_list_names_what_is_built_here_too():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "artsg_nb.models", "--list"], capture_output=True, text=True, check=True)
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    assert {"smollm2-135m-instruct", "tiny", "random"} <= set(names)
