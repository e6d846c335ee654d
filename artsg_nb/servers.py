"""This user's inference servers on this machine, from the command line.

    python -m artsg_nb.servers list            # every live server: pid, engine, port, state, run dir
    python -m artsg_nb.servers stop            # those no live kernel owns (kept after an exit, or leftovers)
    python -m artsg_nb.servers stop --all      # every one, live kernels' too
    python -m artsg_nb.servers stop PID [PID]  # just those

Servers are found from their pid records (`~/.cache/artsg_nb/servers`, or $ARTSG_STATE_DIR) and
stopped by process group, never by name. The same from Python: `artsg_nb.list_servers()`,
`artsg_nb.stop_servers()`. (`expire RECORD` is the watcher a kernel's clean exit starts:
serving/leftovers.py.)
"""
from __future__ import annotations

import argparse
import sys

from .serving.leftovers import ServerInfo, expire, list_servers, stop_servers

__all__ = ["ServerInfo", "list_servers", "stop_servers", "main"]

HEADER = f"{'PID':>8}  {'ENGINE':<7} {'PORT':>6}  {'STATE':<48}  RUN DIR"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m artsg_nb.servers", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every live server of this user on this machine")
    stop = sub.add_parser("stop", help="stop the servers no live kernel owns (--all: every one; or PIDs)")
    stop.add_argument("pids", nargs="*", type=int, metavar="PID", help="stop just these servers")
    stop.add_argument("--all", action="store_true", help="also the servers of live kernels")
    watcher = sub.add_parser("expire", help=argparse.SUPPRESS)
    watcher.add_argument("record")
    a = parser.parse_args(argv)
    if a.command == "expire":
        expire(a.record)
        return 0
    if a.command == "list":
        servers = list_servers()
        print("\n".join([HEADER, *(s.line() for s in servers)]) if servers else "no servers running")
        return 0
    if a.pids and a.all:
        parser.error("give PIDs or --all, not both")
    try:
        stopped = stop_servers(a.pids or None, all=a.all)
    except LookupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for s in stopped:
        print(f"stopped {s.engine} server pid {s.pid} (port {s.port}, {s.run_dir})")
    if not stopped:
        print("nothing to stop" + ("" if a.all else " (servers of live kernels are kept: --all stops them too)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
