"""Process plumbing for servers: own process group, stop by group, pid records, orphan reaping.

What it does: `spawn` starts a command in its own session (so its process group holds the
server and every worker it forks) with stdout+stderr going to a log file; `stop_group` sends
SIGTERM to the group, waits, then SIGKILL; `ProcessRecord` is the JSON record of a running
server, written both to `<run_dir>/<engine>.server.json` and to a global directory
(`$ARTSG_STATE_DIR`, default `~/.cache/artsg_nb/servers`); `reap_orphans` stops servers whose
owning kernel died (but for those a caller is about to adopt, and those a cleanly exited kernel
left for the next one until their `keep_until`: leftovers.py). Records hold the server's API key
(adopting a server needs it), so they are written 0600 whatever the umask, atomically; the log
too is created 0600 (SGLang prints its arguments, key included). `RunDirLock` is the one-writer
lock of a run directory (flock on `<run_dir>/.lock`, released by the OS when its process dies).
Ports: `port_is_free`, `pick_free_port`, `wait_port_free`, `port_owner`, and `listener_of`, which
tells whether the socket listening on a port belongs to a given process tree (a server's readiness
must come from the process it started, not from whoever holds the port).

A process is identified by (pid, create time), never by pid alone — pids are recycled — and
never by name: nothing here can kill a process it did not start.

What it does not: build command lines, wait for readiness or know about engines (server.py).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Mapping, Sequence

import psutil

from ..files import write_atomic

log = logging.getLogger(__name__)

STATE_DIR_VAR = "ARTSG_STATE_DIR"


def state_dir() -> Path:
    """Where every server record of this user lives ($ARTSG_STATE_DIR or ~/.cache/artsg_nb/servers)."""
    return Path(os.environ.get(STATE_DIR_VAR) or Path.home() / ".cache" / "artsg_nb" / "servers")


def create_time(pid: int) -> float | None:
    """When `pid` started (psutil's clock), or None if there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def is_running(pid: int, started: float | None) -> bool:
    """True if `pid` is alive, not a zombie, and is the process that started at `started`."""
    try:
        p = psutil.Process(pid)
        same = started is None or abs(p.create_time() - started) < 0.01
        return same and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []  # the fast path: nothing left, not even zombies
    except PermissionError:
        pass
    members = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                members.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return members


def spawn(cmd: Sequence[str], env: Mapping[str, str], log_path: Path, header: str = "",
          cwd: str | None = None) -> subprocess.Popen:
    """Start `cmd` in a new session (its own process group), output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)  # whatever the umask, and for a log an older version left 0644
    with open(fd, "ab") as out:
        if header:
            out.write(header.encode())
            out.flush()
        return subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=dict(env), cwd=cwd,
                                start_new_session=True)


def stop_group(pgid: int, timeout_s: float = 10.0, proc: subprocess.Popen | None = None,
               kill_timeout_s: float = 5.0) -> str:
    """SIGTERM the group, wait up to `timeout_s`, then SIGKILL it.

    Returns "gone" (nothing was running), "terminated" or "killed". `proc`, when this process
    is the parent, is reaped while waiting so that it does not linger as a zombie.
    """
    if not _signal_group(pgid, signal.SIGTERM):
        _reap(proc)
        return "gone"
    if _wait_group(pgid, timeout_s, proc):
        return "terminated"
    log.warning("process group %d still running %.0f s after SIGTERM; sending SIGKILL", pgid, timeout_s)
    _signal_group(pgid, signal.SIGKILL)
    if not _wait_group(pgid, kill_timeout_s, proc):
        log.error("process group %d survived SIGKILL (members %s)", pgid, group_members(pgid))
    return "killed"


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _wait_group(pgid: int, timeout_s: float, proc: subprocess.Popen | None) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        # A leader whose other threads are still exiting already reads as a zombie: for our own
        # child, wait until it is really reaped.
        reaped = proc is None or proc.poll() is not None
        if reaped and not group_members(pgid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _reap(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.poll()


@dataclass
class ProcessRecord:
    """What is written to disk about a running server, enough to find and stop it later."""
    pid: int
    """Server process id; also its process group id (it leads its own session)."""
    create_time: float
    """psutil create time of `pid`: tells the server from a later process with a recycled pid."""
    port: int
    host: str
    engine: str
    run_dir: str
    log_path: str
    config_hash: str
    """Hash of the launch-relevant config: a re-run cell with the same hash reuses the server."""
    owner_pid: int
    """The kernel that started it; when that process is gone the server is an orphan."""
    owner_create_time: float
    started_at: str
    """Wall-clock start time, ISO 8601."""
    command: list[str] = field(default_factory=list)
    """Command line (it holds no key: the key goes by environment)."""
    hostname: str = field(default_factory=socket.gethostname)
    """Records from another machine (a shared home directory) are left alone."""
    api_key: str | None = field(default=None, repr=False)
    """The server's API key: a later kernel needs it to adopt the server. Why records are 0600."""
    keep_until: float | None = None
    """Epoch seconds: its kernel exited cleanly and left it running until then for the next kernel
    to adopt (leftovers.keep_for_next_kernel); reap_orphans leaves it alone until then."""

    @classmethod
    def of_child(cls, pid: int, **fields) -> "ProcessRecord":
        """The record of `pid`, just started by this process (the owner)."""
        me = os.getpid()
        return cls(pid=pid, create_time=create_time(pid) or time.time(), owner_pid=me,
                   owner_create_time=create_time(me) or 0.0,
                   started_at=datetime.now().isoformat(timespec="seconds"), **fields)

    @property
    def pgid(self) -> int:
        return self.pid

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) / f"{self.engine}.server.json"

    @property
    def global_path(self) -> Path:
        return state_dir() / f"{self.hostname}-{self.engine}-{self.pid}.json"

    def save(self) -> None:
        for path in (self.run_path, self.global_path):
            write_atomic(path, json.dumps(asdict(self), indent=1), private=True, durable=True)

    def remove(self) -> None:
        for path in (self.run_path, self.global_path):
            other = ProcessRecord.load(path)  # the run_dir record may already be a newer server's
            if other is not None and (other.pid, other.create_time) == (self.pid, self.create_time):
                path.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> "ProcessRecord | None":
        try:
            return cls(**json.loads(Path(path).read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as e:
            log.warning("ignoring unreadable server record %s: %s", path, e)
            return None

    def found_in(self, path: Path) -> bool:
        """Was this record written for the directory it was found in? A copied run dir carries
        the original's record: it must not stop (or adopt) the original's server."""
        if Path(path).resolve().parent == Path(self.run_dir).resolve():
            return True
        log.warning("ignoring %s: it records a server of %s (a copied run dir?)", path, self.run_dir)
        return False

    def owner_alive(self) -> bool:
        return is_running(self.owner_pid, self.owner_create_time)

    def server_alive(self) -> bool:
        return is_running(self.pid, self.create_time)


def reap_orphans(keep: tuple[int, float] | None = None) -> list[ProcessRecord]:
    """Stop servers whose kernel died; returns their records. Live kernels' servers are kept, and
    so is `keep` = (pid, create time), a server the caller adopts.

    A server is stopped only when its pid still belongs to the process that was recorded
    (same create time); a record whose pid now belongs to another process is just deleted.
    """
    reaped = []
    here = socket.gethostname()
    for path in sorted(state_dir().glob("*.json")):
        rec = ProcessRecord.load(path)
        if rec is None:
            path.unlink(missing_ok=True)
            continue
        if rec.hostname != here or rec.owner_alive() or (rec.pid, rec.create_time) == keep:
            continue
        if rec.keep_until is not None and rec.keep_until > time.time() and rec.server_alive():
            continue  # kept for the next kernel after a clean exit; its watcher stops it in time
        started = create_time(rec.pid)  # None: gone; else ours only if the create time matches
        ours_or_gone = started is None or abs(started - rec.create_time) < 0.01
        if ours_or_gone and group_members(rec.pgid):
            log.warning("stopping orphaned %s server pid %d on %s:%d (its kernel, pid %d, is gone)",
                        rec.engine, rec.pid, rec.host, rec.port, rec.owner_pid)
            stop_group(rec.pgid)
            wait_port_free(rec.host, rec.port)
            reaped.append(rec)
        rec.remove()
        path.unlink(missing_ok=True)
    return reaped


class RunDirBusyError(RuntimeError):
    """Another live process (or another run object of this one) writes to the run directory."""


class RunDirLock:
    """One writer per run directory: an exclusive flock on `<run_dir>/.lock` holding the
    owner's pid. The OS drops it when the process dies, so a crash leaves no stale lock; a
    server spawned meanwhile does not inherit it (close-on-exec)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir).resolve() / ".lock"
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            for _ in range(20):  # the holder writes its pid just after taking the lock
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                if holder:
                    break
                time.sleep(0.05)
            holder = holder or "unknown"
            os.close(fd)
            mine = holder == str(os.getpid())
            raise RunDirBusyError(
                f"{self.path.parent} is in use by {'this kernel' if mine else 'another process'} "
                f"(pid {holder}): two runs writing one run dir would interleave their history and "
                "checkpoints. Try: " + ("stop() the earlier GRPORun of this run dir first" if mine else
                                        f"stop that run (or its kernel, pid {holder}), or use another run_dir")
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Unlock; safe to call again."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor drops the flock

    @property
    def held(self) -> bool:
        return self._fd is not None


def port_is_free(host: str, port: int) -> bool:
    """Can a server bind host:port now? (SO_REUSEADDR, as uvicorn uses, so TIME_WAIT is free.)"""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


FREE_PORT_RANGE = (20000, 32768)
"""Where free ports are picked: below Linux's ephemeral range (32768-60999), so an outgoing
connection cannot grab the port before the server binds it, and low enough for SGLang, which
derives a gRPC port = port + 10000 and refuses to start when that passes 65535."""


def pick_free_port(host: str, tries: int = 200) -> int:
    """A port in FREE_PORT_RANGE that is free on `host` right now."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(tries):
        port = rng.randrange(*FREE_PORT_RANGE)
        if port_is_free(host, port):
            return port
    raise OSError(f"no free port on {host} in {FREE_PORT_RANGE} after {tries} tries")


def wait_port_free(host: str, port: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not port_is_free(host, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def port_owner(port: int) -> str | None:
    """"pid N (command)" of the process listening on `port`, when the OS lets us see it."""
    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f"pid {conn.pid} ({' '.join(psutil.Process(conn.pid).cmdline())[:120]})"
    except (psutil.Error, OSError):
        pass
    return None


def listener_of(pid: int, host: str, port: int) -> str | None:
    """Who listens on host:port: "ours" (`pid` or a process it forked), "foreign" (another process,
    whose owner the OS may hide), "none" (nobody yet) or None (the OS does not let us look).

    One snapshot of the system's sockets, the process tree read after it: a listener of the tree
    at the snapshot is still in the tree then, so a server that binds meanwhile is never taken for
    a foreign one. Counts sockets on host itself and on the wildcard addresses that cover it."""
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.Error, OSError):
        return None
    on_port = [c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               and c.laddr.ip in (host, "0.0.0.0", "::", f"::ffff:{host}")]
    if not on_port:
        return "none"
    try:
        root = psutil.Process(pid)
        tree = {pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.Error:
        tree = set()
    return "ours" if any(p in tree for p in on_port) else "foreign"


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
