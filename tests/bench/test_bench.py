"""bench.run end to end on the CPU engine at a tiny size: the table's columns and sane values;
the CLI flags; the engine version probe."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from artsg_nb.bench import COLUMNS, BenchConfig, run_bench, summary_table
from artsg_nb.bench.__main__ import parse_args


def test_cli_flags_parse():
    argv = ["--engine", "sglang", "--groups", "3", "--schedules", "naive", "prefix_n", "--radix", "True", "False",
            "--no-raw", "--extra-args", "--attention-backend triton", "--workload", "A"]
    cfg = parse_args(argv)
    assert (cfg.engine, cfg.groups, cfg.schedules, cfg.radix, cfg.raw, cfg.workload) == (
        "sglang", 3, ("naive", "prefix_n"), (True, False), False, "A")
    assert cfg.extra_args == ("--attention-backend", "triton") and cfg.flags == " ".join(argv)


@pytest.mark.slow
def test_small_cpu_run(tmp_path):
    out = tmp_path / "bench.csv"
    cfg = BenchConfig(engine="cpu", groups=2, group_size=2, prompt_tokens=64, new_tokens=4,
                      schedules=("naive", "prefix", "prefix_n"), warmup=0, reload_repeats=1,
                      run_dir=str(tmp_path / "run"), out=str(out), flags="test", workload="T")
    df = run_bench(cfg)
    assert list(df.columns) == COLUMNS and (df["workload"] == "T").all()
    assert out.exists() and len(pd.read_csv(out)) == len(df)
    # toolkit rows for each schedule, raw rows where the raw baseline implements the schedule
    assert sorted(zip(df["mode"], df["schedule"])) == sorted(
        [("toolkit", "naive"), ("raw", "naive"), ("toolkit", "prefix"), ("raw", "prefix"),
         ("toolkit", "prefix_n")])
    assert (df["engine"] == "cpu").all() and df["hardware"].str.startswith("cpu").all()
    assert (df["engine_version"] != "unknown").all()
    assert (df["failed"] == 0).all() and (df["samples"] == 4).all()
    assert (df["wall_s"] > 0).all() and (df["out_tok_s"] > 0).all()
    assert (df["total_tok_s"] > df["out_tok_s"]).all()
    assert (df["ttft_p50_s"] <= df["e2e_p95_s"]).all()
    assert df["mean_prompt_tokens"].between(48, 80).all()
    theory = 0.5  # two identical prompts per group: the second one can reuse all of the first
    assert df["hit_rate_theoretical"].tolist() == pytest.approx([theory] * len(df), abs=0.02)
    assert (df["hit_rate_server"] >= 0.98 * df["hit_rate_theoretical"]).all()
    assert df["hit_rate_server"].tolist() == pytest.approx(df["hit_rate_requests"].tolist())
    toolkit = df[df["mode"] == "toolkit"]
    assert toolkit.loc[toolkit["schedule"] != "prefix_n", "raw_fraction"].gt(0).all()
    assert (df["reload_load_s"] > 0).all() and math.isclose(
        df["reload_s"].iloc[0], df[["reload_save_s", "reload_load_s", "reload_first_s"]].iloc[0].sum())
    assert "hit_rate_server" in summary_table(df)


def test_engine_version_skips_a_server_info_without_version():
    """vLLM in dev mode answers /server_info with its config (no "version"); /version has it."""
    import httpx

    from artsg_nb.bench.run import engine_version
    from artsg_nb.engines import run_sync

    routes = {"/server_info": {"vllm_config": {"model": "m"}}, "/version": {"version": "0.26.0"}}

    def handler(request):
        body = routes.get(request.url.path)
        return httpx.Response(200, json=body) if body else httpx.Response(404)

    class Client:
        def _client(self):
            return httpx.AsyncClient(base_url="http://engine", transport=httpx.MockTransport(handler))

    assert run_sync(engine_version(Client())) == "0.26.0"
    routes.pop("/version")
    assert run_sync(engine_version(Client())) == "unknown"


def test_each_engine_names_its_raw_request_and_reads_its_streamed_answer():
    """bench.raw holds no engine branch: each engine's RawDialect (engines/) builds the request and
    turns a stream back into what an unstreamed request returns."""
    from types import SimpleNamespace

    from artsg_nb import engines

    params = SimpleNamespace(max_new_tokens=4, temperature=1.0, top_p=1.0, ignore_eos=True)
    vllm, sglang = engines.get("vllm").raw, engines.get("sglang").raw
    assert vllm.payload([1, 2], 2, params, "m")[0] == "/v1/completions"
    assert sglang.payload([1, 2], 2, params, "m")[1]["sampling_params"]["n"] == 2
    assert engines.get("cpu").raw is sglang and "stream_options" in vllm.stream_fields
    chunks = [{"choices": [{"index": 1, "token_ids": [7]}, {"index": 0, "token_ids": [5]}]},
              {"choices": [{"index": 0, "token_ids": [6]}]},
              {"choices": [], "usage": {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}}]
    assert vllm.samples(vllm.merge_chunks(chunks), 2) == [([5, 6], 2, 1), ([7], 2, 1)]
    cumulative = [{"index": 0, "output_ids": [5], "meta_info": {"prompt_tokens": 2, "completion_tokens": 1}},
                  {"index": 0, "output_ids": [5, 6], "meta_info": {"prompt_tokens": 2, "completion_tokens": 2,
                                                                   "cached_tokens": 1}}]
    assert sglang.samples(sglang.merge_chunks(cumulative), 2) == [([5, 6], 2, 1)]
