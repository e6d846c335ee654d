"""A notebook re-run after a kernel restart, when the adopted server still holds adapters.

The old kernel (a real subprocess running a GRPORun on the CPU engine, with a scripted reward)
completes step 1 and is SIGKILLed at one of two points:
  - "after_step": step 1 complete; the server holds policy-step-1;
  - "after_load": during step 2, after policy-step-2 was saved, renamed and loaded into the
    server, before its history row: the server holds policy-step-2, history says [1].
A new kernel (another subprocess) re-runs the same cells — start, step, step — with resume=True
or resume=False. It adopts the live server (no cold start), and every step completes: the names
the dead kernel loaded are unloaded first, so loading them again from this run's files is no
`AdapterExistsError` (before: every step() raised it). The served adapter is verified against
the trainer after each step (verify_adapter), so a stale version kept under a reused name fails.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.faults

TESTS = str(Path(__file__).resolve().parents[1])

KERNEL = r'''
import asyncio, json, signal, sys
from artsg_nb.run.history import History
from artsg_nb.run.session import GRPORun, RunConfig
model_dir, run_dir, mode, resume = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
cfg = RunConfig(task="scripted_tasks:SCRIPTED", engine="cpu", model_path=model_dir, run_dir=run_dir, group_size=2,
                groups_per_step=2, lora_rank=4, lora_alpha=8, seed=3, resume=resume, verbose=False)
if mode == "after_load":  # die in step 2 once policy-step-2 is served, before its row is written
    append = History.append
    def append_then_die(self, row):
        if row["step"] == 2:
            print("killme", flush=True)
            signal.pause()  # lives until killed
        return append(self, row)
    History.append = append_then_die
run = GRPORun(cfg).start()
async def cells(n):
    for _ in range(n):
        await run.step()
    return await run.client.list_adapters()
if mode in ("after_step", "after_load"):
    asyncio.run(cells(1 if mode == "after_step" else 2))
    print("killme", flush=True)
    signal.pause()  # lives until killed
held = asyncio.run(cells(2))
print(json.dumps({"adopted": run.server.adopted, "pid": run.server.pid, "held": sorted(held),
                  "steps": [int(s) for s in run.history.df["step"]]}), flush=True)
run.stop()
'''


def kernel(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", KERNEL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


@pytest.mark.parametrize("resume", [True, False], ids=["resume", "fresh"])
@pytest.mark.parametrize("kill_point", ["after_step", "after_load"])
def test_rerun_after_kernel_restart_with_adapters_loaded(tmp_path, tiny_model_dir, kill_point, resume):
    run_dir = str(tmp_path / "run")
    old = kernel(str(tiny_model_dir), run_dir, kill_point, "0")
    line = old.stdout.readline().strip()
    if line != "killme":
        old.kill()
        pytest.fail(f"the old kernel did not get to {kill_point}:\n{old.stderr.read()[-4000:]}")
    pid = json.loads((Path(run_dir) / "cpu.server.json").read_text())["pid"]
    old.send_signal(signal.SIGKILL)  # no atexit: the server lives on with the adapters it loaded
    old.wait()
    old.stdout.close()
    old.stderr.close()

    new = kernel(str(tiny_model_dir), run_dir, "rerun", "1" if resume else "0")
    out, err = new.communicate(timeout=300)
    assert new.returncode == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["adopted"] and result["pid"] == pid  # the live server, not a cold start
    # resume=True continues from the last step with a row (1); a fresh run starts again at 1.
    assert result["steps"] == ([1, 2, 3] if resume else [1, 2])
    assert result["held"] == [f"policy-step-{result['steps'][-1]}"]
