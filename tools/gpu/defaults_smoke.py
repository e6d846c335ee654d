"""The one-call GPU smoke on DEFAULT settings (`bash tools/gpu/validate.sh smoke`).

Runs on the GPU host after tools/gpu/install.sh, with the SGLang bundle and the kernel wheels, on
the CI tiny model (validate.sh passes the shipped one: the weights CI tests). Three parts, each with its own time limit, one PASS/FAIL line
each, and a JSON record of everything (`--out`):

  quickstart  notebooks/01_quickstart.ipynb unchanged, through papermill (MORE_STEPS=8: 10 steps),
              its defaults; passes when every step ran, at least 3 of them reloaded an adapter (each
              reload unloads the one before: the unload that hung on sglang#36894) and its numbers
              pass the value checks (artsg_nb.bench.checks: hit rate against what its submission
              path can reach, IS ratio ~1, probe MAD, 0 restarts, no step over 3 x the median, the
              reward rising, one load and one unload per reload, counted in the server's log)
  schedules   one GRPORun on defaults, then 5 steps under each schedule on that same server
              (auto, n, prefix, prefix_n, naive), and "n" with the prompt warm-up forced on and off
              (the submission `auto` picks, measured against the other); passes when all steps ran
              and each schedule's numbers pass the value checks
  tests       the GPU-marked tests: pytest -m "gpu or sglang" with ARTSG_TEST_ENGINES=sglang

Every part must also end inside 70 % of its limit (a check of its own): a part that lives near
its limit fails on a slower host.

Each part's log (quickstart.log, tests.log) is written beside the JSON (`--out`'s folder).

The tests part runs beside the other two (started --tests-after seconds in, once the first SGLang
start has JIT-compiled the kernels they share), so the smoke fits its ~7-minute bound: each part
is a process of its own on the one GPU (SGLang's memory fraction is of the memory free at its start).

What it does not do: install anything, or change a setting a user would not (the server flags the
offline bundle needs come from $ARTSG_SGLANG_ARGS, which validate.sh sets).
"""
from __future__ import annotations

import argparse
import asyncio
import threading
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the checks come from the package under test
from artsg_nb.bench.checks import Check, check_rows  # noqa: E402

SCHEDULES = ("auto", "n", "prefix", "prefix_n", "naive")
WARM_UP_ARMS = ("always", "never")
"""The "n" schedule again with RunConfig.prompt_warm_up forced each way (the cause of a 0 hit
rate, and which submission is faster per step, measured on the same server)."""
LIMIT_SHARE = 0.7
"""A part passes only when it ends inside this share of its limit."""


def stamp(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def part_quickstart(model: str, work: Path, limit_s: float, logs: Path) -> dict:
    run_dir = work / "quickstart"
    cmd = [sys.executable, "-m", "papermill", str(REPO / "notebooks/01_quickstart.ipynb"), str(work / "01.ipynb"),
           "-p", "RUN_DIR", str(run_dir), "-p", "MODEL_PATH", model, "-p", "MORE_STEPS", "8",
           "--cwd", str(REPO / "notebooks"), "--log-output"]
    ok, log_tail = _run(cmd, logs / "quickstart.log", limit_s)
    rows = _history(run_dir)
    reloads = [r for r in rows if r.get("reload_s") is not None]
    server_log = run_dir / "sglang.log"
    checks = check_rows(rows, reward_rising=True, log_text=server_log.read_text(errors="replace") if server_log.exists() else "")
    result = _summary(rows) | {"reloads": len(reloads), "log_tail": None if ok else log_tail, "checks": _record(checks)}
    result["pass"] = ok and len(rows) == 10 and len(reloads) >= 3 and all(c.passed for c in checks)
    return result


def part_schedules(model: str, work: Path, limit_s: float) -> dict:
    from artsg_nb import GRPORun, RunConfig

    per = {}
    run = GRPORun(RunConfig(model_path=model, run_dir=str(work / "schedules"))).start()
    arms = [(schedule, None) for schedule in SCHEDULES] + [("n", warm_up) for warm_up in WARM_UP_ARMS]
    try:
        deadline = time.monotonic() + limit_s
        for schedule, warm_up in arms:
            name = schedule if warm_up is None else f"n/warm-up {warm_up}"
            run.cfg = replace(run.cfg, schedule=schedule)
            run.client.prompt_warm_up = warm_up or run.cfg.prompt_warm_up  # the client's public option
            rows = []
            for _ in range(5):
                left_s = deadline - time.monotonic()
                rows.append(asyncio.run(asyncio.wait_for(run.step(), timeout=max(left_s, 1))))
            checks = check_rows(rows)  # its first step is the arm's first on this server: not checked for hits
            per[name] = _summary(rows) | {"reloads": sum(r.get("reload_s") is not None for r in rows),
                                          "checks": _record(checks), "pass": all(c.passed for c in checks)}
            stamp(f"  schedule {name}: {per[name]}")
        info = asyncio.run(run.client.server_info())
    except Exception as e:  # the record says which schedule stopped and why
        return {"pass": False, "schedules": per, "error": f"{type(e).__name__}: {e}",
                "log_tail": run.server.log_tail(30) if run.server else None}
    finally:
        run.stop()
    return {"pass": len(per) == len(arms) and all(arm["pass"] for arm in per.values()), "schedules": per,
            "sglang_version": info.get("version"), "restarts": run.restarts}


def _record(checks: list[Check]) -> list[dict]:
    """The checks as the JSON record keeps them, each failed one printed as it is found."""
    for check in checks:
        if not check.passed:
            stamp(f"  check {check.name} FAILED: {json.dumps(check.value)[:400]} (rule: {check.limit})")
    return [c.as_dict() for c in checks]


def part_tests(work: Path, limit_s: float, logs: Path) -> dict:
    env = {**os.environ, "ARTSG_TEST_ENGINES": "sglang"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "gpu or sglang", str(REPO / "tests")]
    ok, tail = _run(cmd, logs / "tests.log", limit_s, env=env, cwd=REPO)
    summary = next((line for line in reversed(tail.splitlines()) if " passed" in line or " failed" in line), tail[-300:])
    return {"pass": ok, "summary": summary.strip()}


def _run(cmd, log: Path, limit_s: float, env=None, cwd=None) -> tuple[bool, str]:
    """`cmd` in its own process group; past `limit_s` the whole group is killed (the notebook's
    kernel and the servers it started too), so nothing holds the GPU for the next part."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            ok = proc.wait(timeout=limit_s) == 0
        except subprocess.TimeoutExpired:
            f.write(f"\n[smoke] timed out after {limit_s:g} s\n")
            ok = False
        finally:
            _kill_group(proc.pid)
    return ok, "\n".join(log.read_text(errors="replace").splitlines()[-30:])


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _history(run_dir: Path) -> list[dict]:
    path = run_dir / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


PHASES = ("rollout_s", "release_s", "train_s", "resume_s", "reload_s")


def _summary(rows: list[dict]) -> dict:
    rows = [r | {"step_s": sum(r.get(k) or 0.0 for k in PHASES)} for r in rows]  # the phases of one step

    def median(key):
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return round(statistics.median(values), 4) if values else None
    return {"steps": len(rows), "step_s_median": median("step_s"), "rollout_s_median": median("rollout_s"),
            "train_s_median": median("train_s"), "reload_s_median": median("reload_s"),
            "hit_rate_median": median("hit_rate"), "hit_rate_reachable_median": median("hit_rate_reachable"),
            "hit_rate_path": next((r.get("hit_rate_path") for r in reversed(rows) if r.get("hit_rate_path")), None),
            "is_raw_ratio_mean_median": median("is_raw_ratio_mean"), "probe_mad_max": _max(rows, "probe_mad"),
            "reward": [round(r.get("reward_mean", 0), 3) for r in rows]}


def _max(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(max(values), 4) if values else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the tiny model built on the host")
    p.add_argument("--work", default="/tmp/runs/smoke")
    p.add_argument("--out", required=True, help="JSON record (benchmarks/results/<date>-<card>-smoke.json)")
    p.add_argument("--parts", nargs="*", default=["quickstart", "schedules", "tests"])
    p.add_argument("--limit-s", nargs="*", default=[], metavar="PART=SECONDS", help="override a part's time limit")
    p.add_argument("--tests-after", type=float, default=75.0,
                   help="seconds after the start at which the tests part starts beside the others; -1: after them")
    a = p.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "gpu": _gpu_name(),
              "commit": _commit(), "settings": "RunConfig defaults", "server_args": os.environ.get("ARTSG_SGLANG_ARGS")}
    # The parts' limits fit validate.sh's bound on the smoke (a device call is 600 s): quickstart then
    # schedules in one lane (at most 460 s), the tests beside them from 75 s (at most 525 s). Measured
    # on H100s (2026-12-06/07): quickstart 110-160 s with a cold SGLang start (kernels JIT-compiled),
    # schedules 70-105 s for five schedules (seven arms now: ~140 s), the GPU-marked tests 215-300 s
    # beside them; each limit keeps its part inside 70 % (LIMIT_SHARE).
    limits = {"quickstart": 240, "schedules": 220, "tests": 450}
    limits |= {k: float(v) for k, v in (item.split("=") for item in a.limit_s)}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("smoke: terminated"))  # so `finally` stops the servers
    logs = Path(a.out).parent  # beside the JSON, so the device call brings them back with it
    runners = {"quickstart": lambda: part_quickstart(a.model, work, limits["quickstart"], logs),
               "schedules": lambda: part_schedules(a.model, work, limits["schedules"]),
               "tests": lambda: part_tests(work, limits["tests"], logs)}
    lock = threading.Lock()  # the record and its file are written by both lanes

    def run_part(name: str) -> None:
        t0 = time.monotonic()
        stamp(f"{name}: start")
        try:
            result = runners[name]()
        except Exception as e:  # a part that raises is a FAIL line, not a lost record
            result = {"pass": False, "error": f"{type(e).__name__}: {e}"}
        result["wall_s"] = round(time.monotonic() - t0, 1)
        inside = Check("inside_limit", result["wall_s"] <= LIMIT_SHARE * limits[name], result["wall_s"],
                       f"ends inside {LIMIT_SHARE:.0%} of its {limits[name]:g} s limit")
        result["checks"] = result.get("checks", []) + _record([inside])
        result["pass"] = result["pass"] and inside.passed
        brief = {k: v for k, v in result.items() if k not in ("log_tail", "schedules", "checks")}
        with lock:
            record[name] = result
            print(f"{'PASS' if result['pass'] else 'FAIL'} {name} {result['wall_s']:.0f} s {json.dumps(brief)}", flush=True)
            failed = [c["name"] for c in result.get("checks", []) if not c["passed"]]
            if failed:
                print(f"    failed checks: {', '.join(failed)}", flush=True)
            if not result["pass"] and result.get("log_tail"):
                print("    " + str(result["log_tail"]).replace("\n", "\n    "), flush=True)
            Path(a.out).write_text(json.dumps(record, indent=2))

    beside = "tests" in a.parts and a.tests_after >= 0 and len(a.parts) > 1
    lane = threading.Thread(target=lambda: (time.sleep(a.tests_after), run_part("tests")), daemon=True) if beside else None
    if lane is not None:
        lane.start()
    for name in a.parts:
        if not (beside and name == "tests"):
            run_part(name)
    if lane is not None:
        lane.join()
    record["parallel_tests_after_s"] = a.tests_after if beside else None
    Path(a.out).write_text(json.dumps(record, indent=2))
    return 0 if all(record[n]["pass"] for n in a.parts) else 1


def _gpu_name() -> str | None:
    try:
        from artsg_nb.serving.gpus import list_gpus
        return ", ".join(g.name for g in list_gpus()) or None
    except Exception:
        return None


def _commit() -> str | None:
    """The commit under test: $ARTSG_COMMIT when set (the GPU host's copy of the tree may carry a
    stale .git: a smoke at b7469a4 recorded 983c7d2), else git's."""
    if os.environ.get("ARTSG_COMMIT"):
        return os.environ["ARTSG_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return os.environ.get("ARTSG_COMMIT")
    return out.stdout.strip() or os.environ.get("ARTSG_COMMIT")


if __name__ == "__main__":
    sys.exit(main())
