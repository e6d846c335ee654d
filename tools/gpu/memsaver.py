"""Measure releasing SGLang's GPU memory around training on one GPU, both ways, in one shot.

usage: python3 tools/gpu/memsaver.py --model DIR --run-dir D --out JSON [--steps 3] [--budget-s 450]
                                     [--no-baseline] [--engine cpu]

`--engine cpu` runs the same stages on the CPU engine (no preflight, no memory figures): a smoke
test of this script on a machine without a GPU.

Stages, each printed as one PASS/FAIL/SKIP line and added to the JSON, which is rewritten after
every stage (a stage that fails or runs out of time leaves the earlier ones):

  preflight  torch_memory_saver in the server environment: its import, its cu13 preload hook,
             and 2 GiB in a region paused and resumed in a subprocess with LD_PRELOAD (free
             memory read by torch before/after): does the host's driver let VMM memory go at all
  grpo       one GRPORun, release_memory=True (SGLang --enable-memory-saver, plus
             --enable-weights-cpu-backup for the weights stage): a warm-up step, then --steps
             steps with release off and --steps with release on, on the same server. Per step:
             rollout / release / train / resume / reload seconds, the step's wall time, GPU memory
             (NVML) as the trainer starts, and the trainer's peak allocated memory
  direct     on that server, 3 x: memory -> release kv_cache+cuda_graph -> memory -> resume ->
             memory; the adapter's greedy output before the release vs after the resume
  weights    the same with all three tags (weights needs the CPU backup); outputs compared again
  baseline   a fresh GRPORun without the memory saver: a warm-up step + --steps steps (the cost of
             the flag itself); skipped when --budget-s would not cover it

A failing stage prints its traceback and the last 40 lines of the server log; later stages run
when they can. SIGTERM (validate.sh's timeout) stops the servers before exiting. Exit status 0
when preflight, grpo and direct passed.
"""
import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

PREFLIGHT_CHILD = r"""
import json, torch
from torch_memory_saver import torch_memory_saver as tms
free = lambda: torch.cuda.mem_get_info()[0] / 2**30
torch.cuda.init(); f0 = free()
with tms.region(tag="probe"):
    x = torch.ones(2 * 2**30 // 4, device="cuda")
torch.cuda.synchronize(); f1 = free()
tms.pause("probe"); torch.cuda.synchronize(); f2 = free()
tms.resume("probe"); x.fill_(3.0); torch.cuda.synchronize(); f3 = free()
print(json.dumps({"free_gib": [f0, f1, f2, f3], "freed_gib": f2 - f1, "refilled_ok": x[-1].item() == 3.0}))
"""
PREFLIGHT = r"""
import json, os, subprocess, sys
import torch_memory_saver, torch_memory_saver.utils as u
out = {"tms": os.path.dirname(torch_memory_saver.__file__)}
out["preload"] = str(u.get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
r = subprocess.run([sys.executable, "-c", sys.argv[1]], env=dict(os.environ, LD_PRELOAD=out["preload"]),
                   capture_output=True, text=True, timeout=150)
out["rc"], out["stderr_tail"] = r.returncode, r.stderr[-1500:]
try:
    out.update(json.loads(r.stdout.strip().splitlines()[-1]))
except Exception:
    out["stdout_tail"] = r.stdout[-800:]
print(json.dumps(out))
"""


class Recorder:
    """The JSON summary, rewritten after every stage; one PASS/FAIL/SKIP line per stage."""

    def __init__(self, path: Path, budget_s: float):
        self.path, self.t0, self.budget_s = path, time.monotonic(), budget_s
        self.data: dict = {"stages": {}}

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def stage(self, name: str, ok: bool | None, **fields) -> bool:
        self.data[name] = fields
        self.data["stages"][name] = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
        self.path.write_text(json.dumps(self.data, indent=2, default=str))
        brief = ", ".join(f"{k}={_short(v)}" for k, v in fields.items() if k in _BRIEF)
        print(f"{self.data['stages'][name]} {name} ({time.monotonic() - self.t0:.0f} s) {brief}", flush=True)
        return bool(ok)


_BRIEF = ("freed_gib", "error", "release_s", "resume_s", "device_used_gib", "step_s", "greedy_equal",
          "reason", "startup_s")


def _short(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)[:200]


def gpu_memory(index: int, server_pid: int | None) -> dict:
    """NVML: memory used on the GPU, and by the server's processes where NVML names them."""
    import psutil

    from artsg_nb.serving.gpus import list_gpus, process_memory_mib

    gpu = next((g for g in list_gpus() if g.index == index), None)
    if gpu is None:  # no GPU (--engine cpu): no figures, not a failure
        return {"device_used_gib": None, "nvml_error": f"NVML shows no GPU {index} (no driver, or not visible)"}
    used = gpu.mem_used_mib / 1024
    procs = {pid: mib / 1024 for pid, mib in process_memory_mib(index).items()}
    tree = set()
    if server_pid is not None:
        try:
            parent = psutil.Process(server_pid)
            tree = {parent.pid, *(c.pid for c in parent.children(recursive=True))}
        except psutil.Error:
            pass
    server = sum(v for pid, v in procs.items() if pid in tree) if tree & set(procs) else None
    return {"device_used_gib": used, "server_gib": server, "kernel_gib": procs.get(os.getpid()),
            "processes_gib": {str(k): v for k, v in procs.items()}}


def preflight(rec: Recorder) -> None:
    from artsg_nb import engines
    from artsg_nb.serving.server_env import child_env, server_extra_env

    python = os.environ.get("ARTSG_SERVER_PYTHON", "python3")
    try:
        r = subprocess.run([python, "-c", PREFLIGHT, PREFLIGHT_CHILD], env=child_env(engines.get("sglang"), server_extra_env(engines.get("sglang"))),
                           capture_output=True, text=True, timeout=200)
        out = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-2000:]}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    ok = out.get("refilled_ok") is True and out.get("freed_gib", 0) > 1.5
    if not ok:
        print(json.dumps(out, indent=1)[-3000:])
    rec.stage("preflight", ok, **out)


def make_cfg(a, run_dir: str, release: bool, weights_backup: bool):
    from artsg_nb import engines
    from artsg_nb.serving.server_env import server_args
    from artsg_nb.run.session import RunConfig

    args = server_args(engines.get(a.engine))
    args += ("--enable-weights-cpu-backup",) if weights_backup else ()
    return RunConfig(task="addition", engine=a.engine, model_path=a.model, run_dir=run_dir, group_size=8,
                     groups_per_step=8, release_memory=release, server_args=args, max_restarts=0, seed=1)


def watch_training(run, gpu: int, notes: list) -> None:
    """Record GPU memory as each training step starts and the trainer's peak after it."""
    import torch

    train_step = run.trainer.train_step

    cuda = torch.cuda.is_available()

    def watched(groups):
        mem = gpu_memory(gpu, run.server.pid)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        metrics = train_step(groups)
        notes.append({**mem, "released": run.client.released_tags,
                      "trainer_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None})
        return metrics

    run.trainer.train_step = watched


async def grpo_steps(run, steps: int, release: bool, gpu: int) -> list[dict]:
    run.release, notes, rows = release, [], []
    watch_training(run, gpu, notes)
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            row = await asyncio.wait_for(run.step(), 300)
            rows.append({**row, "step_s": time.perf_counter() - t0, **notes[-1]})
    finally:
        del run.trainer.train_step  # the class's own method again
    return rows


def summarize(rows: list[dict]) -> dict:
    keys = ("step_s", "rollout_s", "train_s", "reload_s", "release_s", "resume_s", "device_used_gib",
            "trainer_peak_gib")
    med = lambda k: statistics.median(r[k] for r in rows) if all(r.get(k) is not None for r in rows) else None  # noqa: E731
    return {k: med(k) for k in keys}


async def direct(run, gpu: int, tags, repeats: int) -> dict:
    """Release/resume `repeats` times, memory around each; greedy outputs before vs after."""
    from artsg_nb.engines import SamplingParams

    client, pid = run.client, run.server.pid
    ids = run.trainer.tokenizer("What is 12 + 35? Think step by step. " * 12)["input_ids"]
    greedy = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    before = (await client.generate(ids, greedy, adapter=run.adapter))[0]
    info = await client.server_info()
    out = {"tags": list(tags), "server_memory_usage": [s.get("memory_usage") for s in info.get("internal_states", [])],
           "cycles": []}
    for _ in range(repeats):
        m0 = gpu_memory(gpu, pid)
        release_s = await asyncio.wait_for(client.release_memory(tags), 120)
        m1 = gpu_memory(gpu, pid)
        resume_s = await asyncio.wait_for(client.resume_memory(), 120)
        m2 = gpu_memory(gpu, pid)
        out["cycles"].append({"release_s": release_s, "resume_s": resume_s, "before": m0, "released": m1, "resumed": m2,
                              "freed_gib": None if m1["device_used_gib"] is None else
                              m0["device_used_gib"] - m1["device_used_gib"]})
    after = (await client.generate(ids, greedy, adapter=run.adapter))[0]
    cycles = out["cycles"]
    out.update(release_s=statistics.median(c["release_s"] for c in cycles),
               resume_s=statistics.median(c["resume_s"] for c in cycles),
               freed_gib=None if cycles[0]["freed_gib"] is None else statistics.median(c["freed_gib"] for c in cycles),
               greedy_equal=before.output_ids == after.output_ids,
               greedy_max_logprob_diff=max(abs(a - b) for a, b in zip(before.logprobs, after.logprobs)))
    return out


def failed(rec: Recorder, name: str, run, e: BaseException) -> None:
    traceback.print_exc()
    tail = run.server.log_tail(40) if run is not None and run.server is not None else ""
    print(f"---- last 40 lines of the server log:\n{tail}", flush=True)
    rec.stage(name, False, error=f"{type(e).__name__}: {e}", log_tail=tail)


def main_run(a, rec: Recorder) -> None:
    from artsg_nb.engines import DEFAULT_TAGS, MEMORY_TAGS
    from artsg_nb.run.session import GRPORun

    run = None
    try:
        t0 = time.perf_counter()
        run = GRPORun(make_cfg(a, f"{a.run_dir}/saver", release=True, weights_backup=True)).start()
        startup_s = time.perf_counter() - t0
        gpu = (run.plan.server_gpus or (0,))[0]
        warm = asyncio.run(grpo_steps(run, 1, False, gpu))
        off = asyncio.run(grpo_steps(run, a.steps, False, gpu))
        on = asyncio.run(grpo_steps(run, a.steps, True, gpu))
        off_m, on_m = summarize(off), summarize(on)
        rec.stage("grpo", True, startup_s=startup_s, warmup=warm, off=off, on=on, off_median=off_m, on_median=on_m,
                  step_s=f"off {_short(off_m['step_s'])} / on {_short(on_m['step_s'])}")
    except BaseException as e:
        failed(rec, "grpo", run, e)
        if run is not None:
            run.stop()
        if not isinstance(e, Exception):
            raise
        return
    try:
        for name, tags, repeats in (("direct", DEFAULT_TAGS, 3), ("weights", MEMORY_TAGS, 2)):
            try:
                res = asyncio.run(direct(run, gpu, tags, repeats))
                freed = a.engine == "cpu" or (res["freed_gib"] or 0) > 0  # the CPU engine has no figures
                rec.stage(name, res["greedy_equal"] and freed, **res)
            except Exception as e:
                failed(rec, name, run, e)
                if not run.server.alive():
                    break
    finally:
        run.stop()


def baseline(a, rec: Recorder) -> None:
    from artsg_nb.run.session import GRPORun

    if a.no_baseline or rec.left_s() < 200:
        rec.stage("baseline", None, reason="--no-baseline" if a.no_baseline else f"{rec.left_s():.0f} s of budget left")
        return
    run = None
    try:
        t0 = time.perf_counter()
        run = GRPORun(make_cfg(a, f"{a.run_dir}/no-saver", release=False, weights_backup=False)).start()
        startup_s = time.perf_counter() - t0
        gpu = (run.plan.server_gpus or (0,))[0]
        warm = asyncio.run(grpo_steps(run, 1, False, gpu))
        rows = asyncio.run(grpo_steps(run, a.steps, False, gpu))
        rec.stage("baseline", True, startup_s=startup_s, warmup=warm, rows=rows, median=summarize(rows),
                  step_s=summarize(rows)["step_s"])
    except Exception as e:
        failed(rec, "baseline", run, e)
    finally:
        if run is not None:
            run.stop()


def report(rec: Recorder) -> None:
    d, g = rec.data, rec.data.get("grpo", {})
    on, off, base = g.get("on_median") or {}, g.get("off_median") or {}, (d.get("baseline") or {}).get("median") or {}
    direct_ = d.get("direct") or {}
    cyc = (direct_.get("cycles") or [{}])[0]
    gib = lambda m: _short(m.get("device_used_gib")) if m else "?"  # noqa: E731
    print(f"memsaver: {json.dumps(d['stages'])}")
    print(f"memsaver: release_s {_short(direct_.get('release_s'))} resume_s {_short(direct_.get('resume_s'))} | "
          f"GPU used GiB {gib(cyc.get('before'))} -> released {gib(cyc.get('released'))} -> resumed {gib(cyc.get('resumed'))} | "
          f"step s off {_short(off.get('step_s'))} / on {_short(on.get('step_s'))} / no saver {_short(base.get('step_s'))} | "
          f"GPU used at train start: off {_short(off.get('device_used_gib'))} / on {_short(on.get('device_used_gib'))} GiB | "
          f"greedy equal: kv {direct_.get('greedy_equal')} weights {(d.get('weights') or {}).get('greedy_equal')}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=450.0, help="skip the baseline when this would be exceeded")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--engine", default="sglang", choices=["sglang", "cpu"])
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` → SystemExit → servers stopped
    rec = Recorder(Path(a.out), a.budget_s)
    rec.data["args"] = vars(a)
    try:
        if a.engine == "cpu":
            rec.stage("preflight", True, reason="--engine cpu: nothing to check")
        else:
            preflight(rec)
        main_run(a, rec)
        baseline(a, rec)
    finally:
        report(rec)
    return 0 if all(rec.data["stages"].get(s) == "PASS" for s in ("preflight", "grpo", "direct")) else 1


if __name__ == "__main__":
    sys.exit(main())
