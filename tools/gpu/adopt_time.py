"""Start-up of a run: a cold start beside a re-run after a kernel restart that adopts the live server.

usage: python3 tools/gpu/adopt_time.py [--engine sglang|cpu] [--model-path DIR] [--run-dir D] [--out JSON]

For issue 26 item 4 ("an adopted server is reused in <= 10 s"). Two notebook kernels, each a real
subprocess running the cells a user runs, on RunConfig's defaults (only the flags above change them):

  cold      GRPORun(cfg).start() (server launched while the trainer loads), one step(); then the
            kernel is SIGKILLed as a crashed or restarted kernel would be. Its server lives on.
  adopted   a new kernel runs the same cells with resume=True: start() adopts the live server (its
            key from the 0600 record) instead of launching one, the trainer loads, the run resumes
            after step 1; then one step() and stop().

It prints one line per kernel (start_s: GRPORun.start(); trainer_s: the trainer's build, warm-up
included, the run clock's "trainer_build" span; first_step_s; warm_up_s; adopted) and `PASS adopt` when the second kernel adopted the
server and its step completed, else `FAIL adopt` with the kernel's output. Figures are printed, not
judged: the issue's 10 s is read off them. Everything goes to --out as JSON.

What it does not do: time a re-run cell in the same kernel (start_server hands back the live server
at once), or a fleet (serving/fleet.py adopts each worker the same way).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

KERNEL = r'''
import asyncio, json, logging, os, sys, time
if os.environ.get("ADOPT_LOG"):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
from artsg_nb.run.session import GRPORun, RunConfig
engine, model, run_dir, resume = sys.argv[1], sys.argv[2] or None, sys.argv[3], sys.argv[4] == "1"
cfg = RunConfig(engine=engine, model_path=model, run_dir=run_dir, resume=resume, verbose=False)
t0 = time.perf_counter()
run = GRPORun(cfg).start()
start_s = time.perf_counter() - t0
# the trainer's build, warm-up included, as the run's clock timed it beside the server's start
built = {"trainer_s": s.seconds for s in run.clock.since(0.0) if s.name == "trainer_build"}
t1 = time.perf_counter()
row = asyncio.run(run.step())
record = {"start_s": start_s, "first_step_s": time.perf_counter() - t1, "step": row["step"],
          **{k: row.get(k) for k in ("rollout_s", "train_s", "reload_s")},
          "adopted": run.server.adopted, "server_pid": run.server.pid, "warm_up_s": run.trainer.warm_up_s, **built}
print("RESULT " + json.dumps(record), flush=True)
if not resume:
    time.sleep(600)  # killed here, as a crashed kernel; its server lives on
run.stop()
'''


def kernel(engine: str, model: str | None, run_dir: Path, resume: bool, timeout_s: float) -> dict:
    """One kernel's cells in a subprocess; its RESULT record (the cold one is then SIGKILLed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", KERNEL, engine, model or "", str(run_dir), "1" if resume else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, deadline = [], time.monotonic() + timeout_s
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"the {'adopting' if resume else 'cold'} kernel gave no result (exit {proc.poll()}); "
                           "its last lines:\n" + "".join(lines[-30:]))
    finally:
        if not resume:  # the kernel only, not its server's process group
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=timeout_s)


def line(name: str, r: dict) -> str:
    warm = f"{r['warm_up_s']:.2f}" if r.get("warm_up_s") is not None else "off"
    return (f"{name:8s} start {r['start_s']:6.2f} s  trainer {r.get('trainer_s', float('nan')):6.2f} s  "
            f"(warm-up {warm})  first step {r['first_step_s']:6.2f} s  adopted {r['adopted']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="sglang")
    p.add_argument("--model-path", default=None)
    p.add_argument("--run-dir", default="/tmp/runs/adopt-time")
    p.add_argument("--timeout-s", type=float, default=420.0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    run_dir = Path(a.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    try:
        cold = kernel(a.engine, a.model_path, run_dir, False, a.timeout_s)
        print(line("cold", cold), flush=True)
        adopted = kernel(a.engine, a.model_path, run_dir, True, a.timeout_s)
        print(line("adopted", adopted), flush=True)
    except BaseException:
        sys.path.insert(0, str(REPO))
        from artsg_nb.serving.procs import reap_orphans  # a dead kernel's server, by its process group
        reap_orphans()
        raise
    ok = adopted["adopted"] and adopted["server_pid"] == cold["server_pid"] and adopted["step"] == cold["step"] + 1
    print(f"{'PASS' if ok else 'FAIL'} adopt: start {cold['start_s']:.1f} s cold -> {adopted['start_s']:.1f} s "
          f"adopted ({a.engine}, {Path(a.model_path).name if a.model_path else 'tiny'})", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"engine": a.engine, "model_path": a.model_path, "cold": cold,
                                           "adopted": adopted, "pass": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
