"""Issue 26 item 5 read back from a step benchmark log written before the CSV had `overlap_median`.

usage: .venv/bin/python tools/gpu/overlap_from_log.py LOG

Turns each pipelined leg in LOG (the session's "step k: rollouts under", "k groups in R s" and
"update in U s" lines) into the lists a leg's history gives, and hands them to
bench.step_job.overlap_ratios, the rule the CSV's column uses: step k's wall time (from its start
to the next step's start) over max(U_k, R_{k+1}), where both steps' rollouts were sampled ahead.
A step's rollouts count as sampled ahead when its "groups" line comes at once after its start
(a fresh rollout's comes R s later); a skipped update logs no "update in" (NaN). The first step is
left out (bench.step's warm-up). The log gives R and U to 2 decimals, so a ratio near 0.25 s is
good to about +-2 %. Prints one line per pipelined leg: the ratios and their median."""
import math
import re
import statistics
import sys
from datetime import datetime

from artsg_nb.bench.step_job import overlap_ratios

LINE = re.compile(r"(\S+ \S+),(\d+) artsg_nb.run.session: step (\d+): (.*)")


def read_legs(lines) -> list[dict[int, dict]]:
    """Per leg (a new one at each step 1), per step: start, groups_at, r (rollout s), u (update s), pipe."""
    legs, cur = [], None
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        t = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").timestamp() + int(m[2]) / 1000
        k, msg = int(m[3]), m[4]
        if msg.startswith("rollouts under") and k == 1:
            cur = {}
            legs.append(cur)
        if cur is None:  # the log starts partway through a leg
            continue
        step = cur.setdefault(k, {})
        if msg.startswith("rollouts under"):
            step["start"] = t
        elif (g := re.match(r"\d+ groups in ([0-9.]+) s", msg)):
            step["r"], step["groups_at"] = float(g[1]), t
        elif (u := re.match(r"update in ([0-9.]+) s; (.*)", msg)):
            step["u"], step["pipe"] = float(u[1]), "served from the next step" in u[2]
    return legs


def leg_ratios(leg: dict[int, dict]) -> list[float]:
    """overlap_ratios of the leg's steps in order, the first (warm-up) left out."""
    nan = float("nan")
    steps = [leg[k] for k in sorted(leg)]
    starts = [s.get("start", nan) for s in steps]
    ahead = [int("r" in s and s.get("groups_at", nan) - s.get("start", nan) < 0.5 * s["r"]) for s in steps]
    ratios = overlap_ratios([b - a for a, b in zip(starts, [*starts[1:], nan])], [s.get("r", nan) for s in steps],
                            [s.get("u", nan) for s in steps], ahead)
    return [r for r in ratios[1:] if not math.isnan(r)]


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        legs = read_legs(f.read().splitlines())
    for i, leg in enumerate(legs):
        if not any(s.get("pipe") for s in leg.values()):
            continue
        ratios = leg_ratios(leg)
        median = f"{statistics.median(ratios):.3f}" if ratios else "none"
        print(f"leg {i}: pipelined, steps {len(leg)}, per-step overlap {[round(r, 3) for r in ratios]}, median {median}")
