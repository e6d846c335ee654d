"""The loop at real model sizes on one GPU (`bash tools/gpu/validate.sh scale`; issue 46 item 3).

Builds a random-weight model at a real shape (`python -m artsg_nb.models random`, SmolLM2's
tokenizer: its rewards mean nothing, its costs are real), then runs a GRPORun on RunConfig's
defaults (colocated, release_memory as the defaults pick it, Unsloth where installed) on the
addition_chat job (16 groups x 8), a few steps per leg on one server:

  --tokens 256 1024   one leg per max_new_tokens
  --multi-turn        a leg of a 3-turn agent task whose prompts start with a ~2,000-token system
                      prompt (a shop catalogue), so each turn's prompt is 2k+ tokens

and writes one JSON record: per leg the steps' parts (rollout, release, train, resume, reload s),
their medians, the GPU memory peak (NVML, sampled every 0.5 s through the leg), the hit rate
beside what its submission path can reach, probe MAD, and the value checks of
artsg_nb.bench.checks (the reward is not checked: random weights learn nothing).

What it does not do: compare with a peer (python -m artsg_nb.bench.step does), or install anything.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from artsg_nb import GRPORun, RunConfig  # noqa: E402
from artsg_nb.bench.checks import check_rows  # noqa: E402
from artsg_nb.serving.gpus import list_gpus  # noqa: E402
from artsg_nb import StepResult, Task  # noqa: E402

PARTS = ("rollout_s", "release_s", "train_s", "resume_s", "reload_s")
CATALOGUE_ITEMS = 140
"""Items in the long task's system prompt: ~2,000 tokens with SmolLM2's tokenizer."""


def stamp(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class CatalogueEnv:
    """A shop agent whose system prompt lists the whole catalogue; three replies at most (a random
    model never answers, so every episode plays all three turns on a growing history)."""

    ITEMS = [f"item-{i:03d}" for i in range(CATALOGUE_ITEMS)]

    def __init__(self, seed: int):
        rng = random.Random(seed)
        self.item, self.turns = rng.choice(self.ITEMS), 0
        self.prices = {name: random.Random(f"{seed}/{name}").randint(1, 99) for name in self.ITEMS}

    def reset(self):
        catalogue = "\n".join(f"- {name}: aisle {i % 17}, shelf {i % 5}" for i, name in enumerate(self.ITEMS))
        system = ("You are the shop's agent. Look prices up with `price NAME`, then answer with the price "
                  f"in digits only. The catalogue:\n{catalogue}")
        return [{"role": "system", "content": system}, {"role": "user", "content": f"How much is {self.item}?"}]

    def step(self, reply: str) -> StepResult:
        self.turns += 1
        if self.turns >= 3:
            return StepResult(messages=[], reward=float(str(self.prices[self.item]) in reply), done=True)
        return StepResult(messages=[{"role": "user", "content": "Look it up: reply with price NAME."}],
                          reward=None, done=False)


CATALOGUE = Task("catalogue", "3-turn agent with a ~2k-token system prompt (benchmark only)", max_turns=3,
                 max_new_tokens=64, factory=CatalogueEnv)


class MemoryPeak:
    """The highest GPU memory in use (MiB, all GPUs summed) between start() and stop()."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.peak_mib, self._stop = every_s, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            used = sum(g.mem_used_mib or 0 for g in list_gpus())
            self.peak_mib = max(self.peak_mib, used)
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)


def leg(run: GRPORun, name: str, steps: int, deadline: float) -> dict:
    stamp(f"leg {name}: {steps} steps")
    rows = []
    with MemoryPeak() as memory:
        for _ in range(steps):
            if time.monotonic() > deadline:
                stamp(f"leg {name}: out of time after {len(rows)} steps")
                break
            row = asyncio.run(run.step())
            rows.append(row)
            stamp("  " + " ".join(f"{k}={row.get(k):.3f}" for k in PARTS if isinstance(row.get(k), float))
                  + f" hit={row.get('hit_rate')} reachable={row.get('hit_rate_reachable')} path={row.get('hit_rate_path')}")
    checks = [c.as_dict() for c in check_rows(rows)]
    return {"leg": name, "steps": len(rows), "gpu_mem_peak_gib": round(memory.peak_mib / 1024, 1),
            "medians": {k: _median(rows[1:] or rows, k) for k in (*PARTS, "hit_rate", "hit_rate_reachable",
                                                                    "probe_mad", "is_raw_ratio_mean", "completion_tokens")},
            "step_s_median": statistics.median(sum(r.get(k) or 0.0 for k in PARTS) for r in (rows[1:] or rows)) if rows else None,
            "hit_rate_path": rows[-1].get("hit_rate_path") if rows else None,
            "probe_mad_max": max((r["probe_mad"] for r in rows if isinstance(r.get("probe_mad"), float)), default=None),
            "checks": checks, "pass": bool(rows) and all(c["passed"] for c in checks), "rows": rows}


def _median(rows: list[dict], key: str):
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(statistics.median(values), 4) if values else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model directory (built with python -m artsg_nb.models random)")
    p.add_argument("--tokens", type=int, nargs="*", default=[256], help="one leg per max_new_tokens")
    p.add_argument("--multi-turn", action="store_true", help="a leg of the 3-turn 2k-token-prompt task")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--limit-s", type=float, default=500)
    p.add_argument("--run-dir", default="/tmp/runs/scale")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    deadline = time.monotonic() + a.limit_s
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": os.environ.get("ARTSG_COMMIT"), "model": a.model, "gpu": ", ".join(g.name for g in list_gpus()),
              "config": json.loads((Path(a.model) / "config.json").read_text()), "legs": []}
    t0 = time.monotonic()
    cfg = RunConfig(model_path=a.model, run_dir=a.run_dir, task="addition_chat", groups_per_step=16, group_size=8)
    run = GRPORun(cfg).start()
    record["start_s"] = round(time.monotonic() - t0, 1)
    record["release_memory"] = run.release
    stamp(f"started in {record['start_s']} s; release_memory={run.release}; plan {run.plan.describe()}")
    try:
        for tokens in a.tokens:
            run.cfg = replace(run.cfg, max_new_tokens=tokens)
            record["legs"].append(leg(run, f"addition_chat/{tokens}", a.steps, deadline))
            Path(a.out).write_text(json.dumps(record, indent=1, default=str))
        if a.multi_turn:
            run.cfg = replace(run.cfg, max_new_tokens=256, max_seq_tokens=4096, groups_per_step=8)
            run.task = CATALOGUE  # the run's task, read at each step
            record["legs"].append(leg(run, "catalogue-3turn/256", max(a.steps - 1, 2), deadline))
    except Exception as e:  # the record says where it stopped
        record["error"] = f"{type(e).__name__}: {e}"
        record["log_tail"] = run.server.log_tail(30) if run.server else None
        stamp(record["error"])
    finally:
        run.stop()
        Path(a.out).write_text(json.dumps(record, indent=1, default=str))
    ok = "error" not in record and all(leg_["pass"] for leg_ in record["legs"])
    for leg_ in record["legs"]:
        failed = [c["name"] for c in leg_["checks"] if not c["passed"]]
        print(f"{'PASS' if leg_['pass'] else 'FAIL'} scale {leg_['leg']} step {leg_['step_s_median']:.2f} s "
              f"mem {leg_['gpu_mem_peak_gib']} GiB medians {json.dumps(leg_['medians'])}"
              + (f" failed: {failed}" if failed else ""), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
