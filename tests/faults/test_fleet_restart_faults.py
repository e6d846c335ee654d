"""A notebook re-run after a kernel restart, when the run has two servers behind sglang-router.

The old kernel (a real subprocess running a GRPORun with num_servers=2 on the CPU engine, with a
scripted reward; real SGLang with ARTSG_TEST_ENGINES=sglang) completes step 1, so both workers hold policy-step-1, and is SIGKILLed: its two
workers and its router live on. A new kernel re-runs the cells (start, step) with resume=True. It
adopts both workers — the same pids, no cold start, their API key — starts a new router over
them, stops the dead kernel's router, and its step completes and is served by both workers.

Before: every start drew a new "auto" key into the workers' configs, so a record never matched
and both workers were stopped and started cold; and adopting the first worker reaped the second
as an orphan before its own adoption could run.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from artsg_nb.serving import procs

pytest.importorskip("sglang_router", reason="needs the sglang-router package (environment-train.yml)")
pytestmark = pytest.mark.faults

TESTS = str(Path(__file__).resolve().parents[1])

KERNEL = r'''
import asyncio, json, signal, sys
from artsg_nb.run.session import GRPORun, RunConfig
model_dir, run_dir, mode, engine = sys.argv[1:5]
cfg = RunConfig(task="scripted_tasks:SCRIPTED", engine=engine, model_path=model_dir, run_dir=run_dir, group_size=2,
                groups_per_step=4, num_servers=2, lora_rank=4, lora_alpha=8, seed=3, resume=mode == "rerun", verbose=False)
run = GRPORun(cfg).start()
fleet = run.server
async def step():
    await run.step()
    return [sorted(await c.list_adapters()) for c in run.client.workers]
held = asyncio.run(step())
print(json.dumps({"mode": mode, "adopted": [s.adopted for s in fleet.servers], "pids": [s.pid for s in fleet.servers],
                  "router_pid": fleet.router.record.pid, "held": held,
                  "steps": [int(s) for s in run.history.df["step"]]}), flush=True)
if mode == "die":
    signal.pause()  # lives until killed
run.stop()
'''


def kernel(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", KERNEL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def test_rerun_after_kernel_restart_adopts_both_workers_of_a_fleet(tmp_path, tiny_model_dir, fault_engine):
    run_dir = str(tmp_path / "run")
    old = kernel(str(tiny_model_dir), run_dir, "die", fault_engine)
    line = old.stdout.readline().strip()
    if not line.startswith("{"):
        old.kill()
        pytest.fail(f"the old kernel did not complete step 1:\n{old.stderr.read()[-4000:]}")
    before = json.loads(line)
    assert before["held"] == [["policy-step-1"]] * 2 and not any(before["adopted"])
    workers = [(pid, procs.create_time(pid)) for pid in before["pids"]]
    old_router = (before["router_pid"], procs.create_time(before["router_pid"]))
    old.send_signal(signal.SIGKILL)  # no atexit: the workers and the router live on
    old.wait()
    old.stdout.close()
    old.stderr.close()

    new = kernel(str(tiny_model_dir), run_dir, "rerun", fault_engine)
    out, err = new.communicate(timeout=300)
    assert new.returncode == 0, err[-4000:]
    after = json.loads(out.strip().splitlines()[-1])
    assert after["adopted"] == [True, True] and after["pids"] == before["pids"], "a worker was started cold"
    assert after["steps"] == [1, 2] and after["held"] == [["policy-step-2"]] * 2
    assert after["router_pid"] != before["router_pid"]
    assert not procs.is_running(*old_router), "the dead kernel's router was left running"
    assert not any(procs.is_running(*w) for w in workers), "the new kernel's stop() left a worker running"
