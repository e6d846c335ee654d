"""tools/gpu/step_profile.py: its interval arithmetic on hand-worked numbers, and (slow) the real
script for 2 steps on the CPU engine, checked for behaviour — every step's rollouts and reload are
seen, request counts follow groups x group size and the schedule, the parts of a step add up to
its wall time — never for particular timings."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu" / "step_profile.py"
GROUPS, SIZE = 3, 4


def load_tool():
    spec = importlib.util.spec_from_file_location("step_profile", SCRIPT)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_union_and_exclusive_parts_by_hand():
    sp = load_tool()
    assert sp.covered_s([(0, 2), (1, 3), (5, 6)]) == 4
    assert sp.covered_s([(0, 2), (1, 3), (5, 6)], within=(1, 5.5)) == 2.5
    # 0-10 s step: a rollout 1-4, an admin call 3-5 (its first second hidden under the rollout),
    # train_step 5-8 inside nothing, a kernel gap in the rollouts phase 0-1, bookkeeping 8-10.
    reqs = [sp.Request("POST", "/generate", 1.0, "step", 0, kind="rollout", t1=4.0),
            sp.Request("GET", "/metrics", 3.0, "step", 0, t1=5.0)]
    spans = [{"name": "train_step", "t0": 5.0, "t1": 8.0, "nested": False},
             {"name": "rollouts", "t0": 0.0, "t1": 5.0, "nested": False}]
    assert sp.exclusive_parts(0.0, 10.0, reqs, spans) == {
        "kernel gaps in rollouts": 1.0, "server: POST /generate rollout": 3.0, "server: GET /metrics": 1.0,
        "train: train_step": 3.0, "kernel gaps elsewhere (step bookkeeping)": 2.0}


@pytest.mark.slow
def test_two_steps_on_the_cpu_engine(tiny_model_dir, tmp_path):
    out = tmp_path / "profile.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    # scripted reward: every step has a signal, so every step publishes (loads) a new adapter
    cmd = [sys.executable, str(SCRIPT), "--engine", "cpu", "--model-path", str(tiny_model_dir),
           "--task", "scripted_tasks:ADDITION_WITH_SIGNAL", "--steps", "2", "--groups-per-step", str(GROUPS),
           "--group-size", str(SIZE), "--run-dir", str(tmp_path / "run"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "top 5 costs that are neither decoding nor training" in proc.stdout
    record = json.loads(out.read_text())
    assert record["schedule"] == "n" and [s["step"] for s in record["steps"]] == [1, 2]
    for s in record["steps"]:
        mine = [r for r in s["requests"] if r["task"] == "step"]
        ep = s["endpoints"]
        rollouts = [r for r in mine if r["what"] == "POST /generate rollout"]
        # schedule "n": one request per group (a balanced n adds one warm-up per group)
        assert len(rollouts) == GROUPS and sum(r["samples"] for r in rollouts) == GROUPS * SIZE == s["row"]["samples"]
        assert ep.get("POST /generate warm-up", {}).get("n", 0) == (GROUPS if record["balanced_n"] else 0)
        assert ep["POST /load_lora_adapter"]["n"] == (2 if s["step"] == 1 else 1)  # step 1 also serves policy-step-0
        assert ep["POST /unload_lora_adapter"]["n"] == 1 and ep["GET /v1/models"]["n"] >= 1
        # the served-adapter check: at the first reload on the server, then every verify_every (10) steps
        assert ep.get("POST /generate score", {}).get("n", 0) == (1 if s["step"] == 1 else 0)
        assert all(r["status"] == 200 and r["end_s"] >= r["start_s"] for r in mine)
        assert [x["name"] for x in s["spans"]].count("train_step") == 1
        assert sum(s["parts"].values()) == pytest.approx(s["wall_s"], rel=1e-6)
        assert s["server_s"] + s["kernel_s"] == pytest.approx(s["wall_s"]) and 0 < s["server_share"] < 1
        starts = [t["start_s"] for t in s["timeline"]]
        assert starts == sorted(starts)
        assert {t["what"] for t in s["timeline"]} >= {"POST /generate rollout", "train_step"}
    top = record["summary"]["top_non_decoding"]
    assert 1 <= len(top) <= 5 and not {c["what"] for c in top} & {"server: POST /generate rollout", "train: train_step"}
    assert record["summary"]["steps"] == [2]
