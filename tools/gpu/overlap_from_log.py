"""Issue 26 item 5 read back from a step benchmark log written before the CSV had `overlap_median`.

usage: python3 tools/gpu/overlap_from_log.py LOG

For each pipelined leg in LOG (the session's "step k: rollouts under", "k groups in R s" and "update
in U s" lines), per step k after the first (bench.step's warm-up): its wall time, from its start to
the next step's start, over max(U_k, R_{k+1}), the rollouts it sampled ahead for step k+1 being
reported in that step's line (bench.step_job.overlap_ratios does the same from the history rows).
The log gives R and U to 2 decimals, so a ratio near 0.25 s is good to about +-2 %; the last step
has no pair. Prints one line per pipelined leg: the ratios and their median."""
import re
import statistics
import sys
from datetime import datetime
text = open(sys.argv[1]).read().splitlines()
legs, cur = [], None
for line in text:
    m = re.match(r"(\S+ \S+),(\d+) artsg_nb.run.session: step (\d+): (.*)", line)
    if not m:
        continue
    t = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").timestamp() + int(m[2]) / 1000
    k, msg = int(m[3]), m[4]
    if msg.startswith("rollouts under") and k == 1:
        cur = {}
        legs.append(cur)
    if cur is None:  # the log starts partway through a leg
        continue
    if msg.startswith("rollouts under"):
        cur.setdefault(k, {})["start"] = t
    elif (g := re.match(r"\d+ groups in ([0-9.]+) s", msg)):
        cur.setdefault(k, {})["r"] = float(g[1])
    elif (u := re.match(r"update in ([0-9.]+) s; (.*)", msg)):
        cur.setdefault(k, {})["u"] = float(u[1]); cur[k]["pipe"] = "served from the next step" in u[2]
for i, leg in enumerate(legs):
    if not any(s.get("pipe") for s in leg.values()):
        continue
    ks = sorted(leg)
    ratios = []
    for k in ks[1:]:  # warm-up 1
        nxt = leg.get(k + 1, {})
        if "u" in leg[k] and "start" in nxt and "r" in nxt:  # a skipped update logs no "update in"
            wall = leg[k + 1]["start"] - leg[k]["start"]
            ratios.append(wall / max(leg[k]["u"], leg[k + 1]["r"]))
    median = f"{statistics.median(ratios):.3f}" if ratios else "none"
    print(f"leg {i}: pipelined, steps {len(ks)}, per-step overlap {[round(r, 3) for r in ratios]}, median {median}")
