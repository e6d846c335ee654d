"""tools/gpu/step_profile.py: its interval arithmetic on hand-worked numbers, and (slow) the real
script for 2 steps on the CPU engine, checked for behaviour — every step's rollouts and reload are
seen, request counts follow groups x group size and the schedule, the parts of a step add up to
its wall time — never for particular timings."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpu_tools import load_gpu_tool

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu" / "step_profile.py"
GROUPS, SIZE = 3, 4


def load_tool():
    return load_gpu_tool("step_profile")


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


class StubTrainer:
    """Trainer.train_step's shape of calls (make_batch → backward over micro_batches → optimizer_step)
    on small tensors: batches of `lengths` sequences, micro-batches of two, each cut to its longest."""

    def __init__(self):
        self.fail = False

    def train_step(self, groups):
        batch = self.make_batch(groups)
        self.backward(batch)
        self.optimizer_step()
        return {}

    def make_batch(self, lengths):
        import torch
        if self.fail:
            raise ValueError("no valid trajectory")
        mask = torch.tensor([[1] * n + [0] * (max(lengths) - n) for n in lengths])
        return SimpleNamespace(input_ids=torch.zeros_like(mask), attention_mask=mask)

    def micro_batches(self, batch, budget=None):  # Trainer.micro_batches' signature
        for i in range(0, batch.input_ids.shape[0], 2):
            part = batch.attention_mask[i:i + 2]
            yield SimpleNamespace(input_ids=batch.input_ids[i:i + 2, :int(part.sum(1).max())])

    def backward(self, batch, part=None, budget=None):  # Trainer.backward's signature and call
        gc.collect()  # a collection inside train_step, on its thread
        return [mb for mb in self.micro_batches(batch if part is None else part, budget)]

    def optimizer_step(self):
        return 0.0


def test_the_trainer_is_looked_into_one_record_per_train_step():
    sp = load_tool()
    rec, trainer = sp.Recorder(), StubTrainer()
    trainer.train_step = sp.sync_span(rec, "train_step", trainer.train_step)  # the span the run's clock gives it
    sp.instrument_trainer(trainer, rec)
    on_gc = sp._gc_recorder(rec)
    gc.callbacks.append(on_gc)
    try:
        trainer.train_step([5, 3, 4])
        trainer.train_step([4, 5, 2])  # (2, 5) seen, (1, 2) new
        trainer.train_step([5, 5, 4])  # (2, 5) and (1, 4): both seen
        gc.collect()  # outside train_step: not recorded
        trainer.fail = True
        with pytest.raises(ValueError):
            trainer.train_step([1])
    finally:
        gc.callbacks.remove(on_gc)
    _, spans, _, records = rec.take()
    assert [r["shapes"] for r in records] == [[(2, 5), (1, 4)], [(2, 5), (1, 2)], [(2, 5), (1, 4)], []]
    assert [r["new_shape"] for r in records] == [True, True, False, False]
    assert [(r["sequences"], r["width"], r["tokens"]) for r in records[:3]] == [(3, 5, 12), (3, 5, 11), (3, 5, 14)]
    assert all("counters" in r for r in records)  # written even for the step that raised
    steps = [s for s in spans if s["name"] == "train_step"]
    assert len(steps) == 4
    for step in steps[:3]:  # each holds its backward and the collection made there
        assert {s["name"] for s in spans if step["t0"] <= s["t0"] <= step["t1"]} >= {"make_batch", "backward", "gc"}
    # every part and collection recorded lies inside a train_step (the collect() after them is not recorded)
    assert all(any(t["t0"] <= s["t0"] and s["t1"] <= t["t1"] for t in steps)
               for s in spans if s["name"] in (*sp.TRAINER_PARTS, "gc"))
    assert all(s["nested"] for s in spans if s["name"] in (*sp.TRAINER_PARTS, "gc"))


def test_the_gc_callback_is_removed_when_the_run_fails():
    sp = load_tool()
    trainer = StubTrainer()
    trainer.tokenizer = SimpleNamespace(apply_chat_template=None, encode=None, decode=None)
    trainer.score_tokens = lambda ids: []
    run = SimpleNamespace(trainer=trainer)
    before = list(gc.callbacks)
    with pytest.raises(RuntimeError, match="cut short"):
        with sp.instrument_run(run, sp.Recorder()):
            assert len(gc.callbacks) == len(before) + 1
            raise RuntimeError("cut short")
    assert gc.callbacks == before


def test_a_collection_on_the_training_thread_is_recorded_as_a_nested_gc_span():
    sp = load_tool()
    rec = sp.Recorder()
    on_gc = sp._gc_recorder(rec)
    gc.callbacks.append(on_gc)
    try:
        gc.collect()  # no train_step open: not recorded
        assert not rec.spans
        rec.training_thread = threading.get_ident()
        gc.collect()
    finally:
        gc.callbacks.remove(on_gc)
    full = [s for s in rec.spans if s["name"] == "gc" and s["generation"] == 2]
    assert full and all(s["nested"] and s["t1"] >= s["t0"] for s in full)


def test_trainer_detail_and_the_new_shape_summary_by_hand():
    sp = load_tool()
    # train_step 1-3 s holding make_batch 1-1.1, backward 1.1-2.5 with a gen-2 collection 2-2.4, optimizer 2.5-2.9
    spans = [{"name": "train_step", "t0": 1.0, "t1": 3.0, "nested": False},
             {"name": "make_batch", "t0": 1.0, "t1": 1.1, "nested": True},
             {"name": "backward", "t0": 1.1, "t1": 2.5, "nested": True},
             {"name": "gc", "t0": 2.0, "t1": 2.4, "nested": True, "generation": 2, "collected": 0},
             {"name": "gc", "t0": 3.5, "t1": 3.6, "nested": True, "generation": 0, "collected": 0},  # after it
             {"name": "optimizer_step", "t0": 2.5, "t1": 2.9, "nested": True}]
    record = {"sequences": 8, "width": 12, "tokens": 80, "shapes": [(6, 12), (2, 9)], "new_shape": True,
              "counters": {"cuda_mallocs": 3}}
    t = sp.trainer_detail([record], spans)
    assert t["train_s"] == 2.0 and t["backward_s"] == pytest.approx(1.4) and t["optimizer_step_s"] == pytest.approx(0.4)
    assert t["padded_tokens"] == 90 and t["s_per_1k_padded"] == pytest.approx(2.0 / 90 * 1e3)
    assert t["gc"] == {"n": 1, "s": pytest.approx(0.4), "oldest_generation": 2}
    assert sp.trainer_detail([], spans) is None
    # a new shape that costs more per token, a longer batch of seen shapes that costs the same per token
    steps = [{"trainer": {**t, "train_s": 2.0, "s_per_1k_padded": 20.0}},
             {"trainer": {**t, "new_shape": False, "train_s": 0.5, "s_per_1k_padded": 5.0}},
             {"trainer": {**t, "new_shape": False, "train_s": 1.0, "s_per_1k_padded": 5.0}}, {"trainer": None}]
    tr = sp.training_summary(steps)
    assert tr["new_shape_mean_s"] == 2.0 and tr["seen_shapes_mean_s"] == pytest.approx(0.75)
    assert tr["new_shape_s_per_1k_padded"] == 20.0 and tr["seen_shapes_s_per_1k_padded"] == 5.0
    assert tr["counters"] == {"cuda_mallocs": 9} and len(tr["per_step"]) == 3


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
        # the step's phases, from the run's clock (no method of the run is wrapped)
        assert {"rollouts", "rewards", "version", "publish", "save", "history", "prune"} <= {x["name"] for x in s["spans"]}
        t = s["trainer"]  # inside train_step: every valid trajectory, in micro-batches, parts within it
        assert t["sequences"] <= s["row"]["samples"] and sum(rows for rows, _ in t["shapes"]) == t["sequences"]
        assert t["sequences"] <= t["tokens"] <= t["padded_tokens"] <= t["sequences"] * t["width"]
        assert t["make_batch_s"] + t["backward_s"] + t["optimizer_step_s"] <= t["train_s"] and t["backward_s"] > 0
        u = s["update_timing"]  # the trainer's own split of the update, read from its public last_update
        assert u["wall_s"] > 0 and u["thread_cpu_s"] > 0 and u["why"].startswith(f"{u['wall_s']:.3f} s: ")
        seen = {tuple(shape) for earlier in record["steps"][:s["step"] - 1] for shape in earlier["trainer"]["shapes"]}
        assert t["new_shape"] == any(tuple(shape) not in seen for shape in t["shapes"])
        assert sum(s["parts"].values()) == pytest.approx(s["wall_s"], rel=1e-6)
        assert s["server_s"] + s["kernel_s"] == pytest.approx(s["wall_s"]) and 0 < s["server_share"] < 1
        starts = [t["start_s"] for t in s["timeline"]]
        assert starts == sorted(starts)
        assert {t["what"] for t in s["timeline"]} >= {"POST /generate rollout", "train_step"}
    top = record["summary"]["top_non_decoding"]
    assert 1 <= len(top) <= 5 and not {c["what"] for c in top} & {"server: POST /generate rollout", "train: train_step"}
    assert record["summary"]["steps"] == [2]
    assert [r["shapes"] for r in record["summary"]["training"]["per_step"]] == [record["steps"][1]["trainer"]["shapes"]]
    assert "training per step (* = met a micro-batch shape new to the run)" in proc.stdout
