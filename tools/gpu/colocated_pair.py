"""Two SGLang workers of a colocated fleet on one GPU, started the way Fleet.start starts them
(serving.fleet.gpu_lanes: one after another, each with its planned share re-expressed over the
memory free at its launch, serving.gpus.launch_mem_fraction), without the router (its wheels and
the SGLang bundle do not fit in one device call together). Both must answer /health and one
request each; prints one JSON line per worker (launch fraction, free GPU memory before it, start
seconds, SGLang's KV cache line) and writes them to --out.

    python3 tools/gpu/colocated_pair.py --model /path/to/model --run-dir /tmp/runs/pair --out pair.json

Before, the fleet started both at once with --mem-fraction-static 0.35 each and the second died
with "Loaded weights leave no GPU memory for the KV cache" (H200, commit 7de1b1f).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

from artsg_nb.engines import SamplingParams
from artsg_nb.serving.fleet import fleet_configs, gpu_lanes
from artsg_nb.serving.gpus import list_gpus, plan_gpus
from artsg_nb.serving.server import Server, ServerConfig

KV_LINE = re.compile(r"KV Cache is allocated.*")


def launch_flag(server: Server, flag: str = "--mem-fraction-static") -> str | None:
    cmd = server.record.command if server.record else []
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def kv_line(server: Server) -> str | None:
    found = KV_LINE.findall(Path(server.log_path).read_text(errors="replace"))
    return found[-1][:200] if found else None


async def one_request(server: Server) -> int:
    async with server.client() as client:
        gens = await client.generate([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    return len(gens[0].output_ids)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    plan = plan_gpus(num_servers=a.servers, prefer="colocated")
    base = ServerConfig(engine="sglang", model_path=a.model, run_dir=a.run_dir,
                        mem_fraction=plan.server_mem_fraction, gpu_plan=plan)  # as GRPORun builds it
    servers = [Server(c) for c in fleet_configs(base, plan)]
    lanes = gpu_lanes(servers)
    rows: list[dict] = []
    ok = len(lanes) == 1
    print(f"{plan.describe()}; lanes {[len(lane) for lane in lanes]}", flush=True)
    try:
        for i, server in enumerate(lanes[0]):
            free_mib, t0 = list_gpus()[0].mem_free_mib, time.monotonic()
            server.start()
            rows.append({"worker": i, "planned_share": plan.server_mem_fraction, "launched_fraction": launch_flag(server),
                         "free_gib_before": round(free_mib / 1024, 1), "start_s": round(time.monotonic() - t0, 1),
                         "kv_cache": kv_line(server)})
            print(json.dumps(rows[-1]), flush=True)
        for row, server in zip(rows, lanes[0]):
            row["tokens_answered"] = asyncio.run(one_request(server))
        ok = ok and all(r["tokens_answered"] == 4 for r in rows)
    except Exception as e:  # a probe: record what happened and the log's tail
        ok = False
        rows.append({"error": f"{type(e).__name__}: {str(e)[-1500:]}"})
        print(rows[-1]["error"], flush=True)
    finally:
        for server in servers:
            server.stop()
    print(f"{'PASS' if ok else 'FAIL'} colocated pair: {json.dumps(rows)}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"ok": ok, "workers": rows}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
