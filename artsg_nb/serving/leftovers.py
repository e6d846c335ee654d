"""This user's servers that outlive their kernel: kept for a grace period at exit, listed, stopped.

What it does: at a clean kernel exit (JupyterLab's Restart Kernel, the end of a script that did not
call `stop()`), `keep_for_next_kernel(record)` leaves the server running for `exit_grace_s()`
seconds (`$ARTSG_SERVER_GRACE_S`, 600 by default; 0 stops it at exit as before), writes the
deadline into its pid record and starts a small detached watcher (`python -m artsg_nb.servers
expire RECORD`) that stops the server's process group at the deadline unless a new kernel adopted
it meanwhile (server.Server.adopt: a start with the same config and run dir). `list_servers()` and
`stop_servers()` (and `python -m artsg_nb.servers list|stop`) find this user's servers on this
machine from their pid records (`serving.procs.state_dir()`) and stop them by process group.

A process is named by its record (pid and create time), never by its name: nothing here can stop
a process this user's kernels did not start. Taking a kept or orphaned server over is a `claim`: its
record's owner is rewritten under one lock of this user's (state_dir()/.claims.lock), only if it
is still the record the claimer read, so of two kernels adopting the same server, or a kernel and
the watcher at the deadline, exactly one owns it; the others leave it alone.

What it does not do: start or adopt servers (server.py), or stop servers of a live kernel unless
asked (`stop_servers(all=True)` or by pid).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from . import procs
from .procs import ProcessRecord

log = logging.getLogger(__name__)

GRACE_VAR = "ARTSG_SERVER_GRACE_S"
DEFAULT_GRACE_S = 600.0


def exit_grace_s() -> float:
    """Seconds a server outlives its kernel's clean exit ($ARTSG_SERVER_GRACE_S, default 600)."""
    raw = os.environ.get(GRACE_VAR, "").strip()
    try:
        return max(0.0, float(raw)) if raw else DEFAULT_GRACE_S
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %.0f", GRACE_VAR, raw, DEFAULT_GRACE_S)
        return DEFAULT_GRACE_S


def keep_for_next_kernel(record: ProcessRecord, grace_s: float) -> ProcessRecord:
    """Leave the server of `record` running `grace_s` more seconds for the next kernel to adopt:
    the deadline goes into its records and a detached watcher stops it then (`expire`)."""
    kept = replace(record, keep_until=time.time() + grace_s)
    kept.save()
    package_root = str(Path(__file__).resolve().parents[2])  # the watcher runs this same code
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    subprocess.Popen([sys.executable, "-m", "artsg_nb.servers", "expire", str(kept.global_path)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     env=env, start_new_session=True)
    log.info("%s server pid %d kept %.0f s for the next kernel", kept.engine, kept.pid, grace_s)
    return kept


def expire(record_path: str | Path, poll_s: float = 1.0) -> str:
    """The watcher: wait until the record's deadline, then stop the server unless a live kernel
    owns it again (adopted) or it is gone. Returns what happened: "adopted", "gone" or "stopped"."""
    record_path = Path(record_path)
    first = ProcessRecord.load(record_path)
    while True:
        rec = ProcessRecord.load(record_path)
        if rec is None or first is None or (rec.pid, rec.create_time) != (first.pid, first.create_time) \
                or not rec.server_alive():
            return "gone"
        # Adopted: a live kernel other than the one that kept it owns it now. The keeping kernel
        # itself is still alive for a moment after starting this watcher (its atexit is running).
        if (rec.owner_pid, rec.owner_create_time) != (first.owner_pid, first.owner_create_time) and rec.owner_alive():
            return "adopted"
        left = (rec.keep_until or 0.0) - time.time()
        if left <= 0:
            claimed = claim(record_path, rec)  # not while a kernel adopts it: one of the two owns it
            if claimed is None:
                continue  # claimed meanwhile: the next look says by whom
            _stop(claimed, "its grace period after the kernel's exit ended and no kernel adopted it")
            return "stopped"
        time.sleep(min(left, poll_s))


def claim(record_path: str | Path, seen: ProcessRecord) -> ProcessRecord | None:
    """Make this process the owner of the server recorded at `record_path`, atomically with every
    other claim of this user's (kernels adopting it, the watcher stopping it): only while the
    record still names the server and the owner `seen` names. Returns the record saved with the
    new owner, or None when another process claimed it first, or it is gone: then the caller
    must not use or stop the server."""
    with _claims_lock():
        rec = ProcessRecord.load(Path(record_path))
        if rec is None or _ownership(rec) != _ownership(seen):
            return None
        me = os.getpid()
        claimed = replace(rec, owner_pid=me, owner_create_time=procs.create_time(me) or 0.0)
        claimed.save()
        return claimed


def _ownership(rec: ProcessRecord) -> tuple:
    return rec.pid, rec.create_time, rec.owner_pid, rec.owner_create_time


@contextlib.contextmanager
def _claims_lock():
    """This user's lock over claims (an flock, dropped by the OS if the holder dies)."""
    path = procs.state_dir() / ".claims.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ServerInfo:
    """One of this user's servers on this machine, as `list_servers` reports it."""
    pid: int
    engine: str
    port: int
    run_dir: str
    owner_pid: int
    """The kernel that owns it (started or adopted it)."""
    state: str
    """"in use" (its kernel is alive), "kept" (its kernel exited; kept for the next one until
    `keep_until`) or "leftover" (its kernel is gone: nothing will stop it but you)."""
    keep_until: float | None
    started_at: str

    def line(self) -> str:
        if self.state == "in use":
            what = f"in use by kernel pid {self.owner_pid}"
        elif self.state == "kept":
            what = f"kept for the next kernel until {datetime.fromtimestamp(self.keep_until):%H:%M:%S}"
        else:
            what = f"leftover: its kernel (pid {self.owner_pid}) is gone"
        return f"{self.pid:>8}  {self.engine:<7} {self.port:>6}  {what:<48}  {self.run_dir}"


def list_servers() -> list[ServerInfo]:
    """This user's live servers on this machine (from their pid records), oldest first."""
    return [_info(rec) for _, rec in _live_records()]


def stop_servers(pids: list[int] | None = None, all: bool = False) -> list[ServerInfo]:  # noqa: A002
    """Stop this user's servers by process group and remove their records; the ones stopped.
    Default: the servers no live kernel owns ("kept" and "leftover"); `all=True`: every one,
    those of live kernels too; `pids`: just those (any state)."""
    stopped = []
    for _, rec in _live_records():
        info = _info(rec)
        chosen = rec.pid in pids if pids is not None else (all or info.state != "in use")
        if chosen:
            _stop(rec, "stopped by stop_servers" if pids is None else f"stopped by pid ({rec.pid})")
            stopped.append(info)
    missing = sorted(set(pids or ()) - {s.pid for s in stopped})
    if missing:
        raise LookupError(f"no server of this user with pid {', '.join(map(str, missing))} "
                          "(pids from `python -m artsg_nb.servers list`).")
    return stopped


def _live_records() -> list[tuple[Path, ProcessRecord]]:
    """(path, record) of every live server recorded in state_dir() on this host; records of
    servers that are gone are deleted on the way."""
    found, here = [], socket.gethostname()
    for path in sorted(procs.state_dir().glob("*.json")):
        rec = ProcessRecord.load(path)
        if rec is None or rec.hostname != here:
            continue
        if not rec.server_alive():
            path.unlink(missing_ok=True)
            continue
        found.append((path, rec))
    return sorted(found, key=lambda pr: pr[1].create_time)


def _info(rec: ProcessRecord) -> ServerInfo:
    if rec.owner_alive():
        state = "in use"
    elif rec.keep_until is not None and rec.keep_until > time.time():
        state = "kept"
    else:
        state = "leftover"
    return ServerInfo(rec.pid, rec.engine, rec.port, rec.run_dir, rec.owner_pid, state, rec.keep_until,
                      rec.started_at)


def _stop(rec: ProcessRecord, why: str) -> None:
    """Stop the server's process group, say why at the end of its log, then remove its records
    (last: a record gone means the whole stop is done)."""
    how = procs.stop_group(rec.pgid)
    procs.wait_port_free(rec.host, rec.port)
    try:
        with open(rec.log_path, "a", encoding="utf-8") as f:
            f.write(f"\n==== artsg_nb {datetime.now().isoformat(timespec='seconds')}: server pid {rec.pid} "
                    f"{how}: {why}\n")
    except OSError:
        pass  # the log's directory was removed: the record is what mattered
    rec.remove()
    log.info("%s server pid %d %s: %s", rec.engine, rec.pid, how, why)
