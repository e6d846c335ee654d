"""One child process group the kernel launched or adopted: the lifecycle a server and a router share.

What it does: `ManagedProcess` spawns a command in its own process group with its output appended
to a log (`_spawn`: a header line with the command, then procs.spawn), records it on disk
(procs.ProcessRecord: what `reap_orphans` and `python -m artsg_nb.servers` read), keeps it in this
process's live set, waits until it is ready (`_poll_ready`: polls a readiness check while watching
that the process lives, with a timeout), reads the tail of what this start wrote to the log, and
stops it: SIGTERM to the group, wait, SIGKILL, idempotent (`stop`), or SIGKILL at once (`kill`, for
a process stopped by SIGSTOP). It is a context manager. At a clean interpreter exit each live
process of this process gets its `at_exit()` (stop; a server keeps itself for the next kernel).

What it does not: build command lines, say what "ready" means or what a failure means (the
subclasses: server.Server, router.Router, through `_ready`, `_exit_error`, `_not_ready_error`),
or know about engines.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Sequence

import httpx
import psutil

from ..files import log_tail
from . import procs

log = logging.getLogger(__name__)

POLL_S = 0.25
"""Seconds between two readiness polls."""


class ManagedProcess:
    """A process group this kernel started (or adopted): spawn, record, ready-wait, log tail, stop.

    Subclasses hold `proc`, `record`, `log_path`, `api_key`, `url`, and say what ready means."""

    proc: subprocess.Popen | None = None
    record: procs.ProcessRecord | None = None
    api_key: str | None = None
    log_path: Path
    url: str
    _log_offset: int = 0

    # ---- what a subclass says ----------------------------------------------------------------
    @property
    def label(self) -> str:
        """What log lines call it ("sglang server", "router")."""
        return type(self).__name__.lower()

    def _ready(self, http: httpx.Client) -> bool:
        """One readiness poll (it may raise to end the wait)."""
        raise NotImplementedError

    def _exit_error(self, code: int, elapsed_s: float) -> Exception:
        """The error for a process that exited with `code` while starting."""
        raise NotImplementedError

    def _not_ready_error(self, timeout_s: float) -> Exception:
        """The error for a process still not ready after `timeout_s`."""
        raise NotImplementedError

    # ---- state -------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.record.pid if self.record is not None else None

    def _any_pid(self) -> int | None:
        """The recorded pid, else the Popen's (a process handed in without a record)."""
        return self.pid if self.pid is not None else (self.proc.pid if self.proc is not None else None)

    def alive(self) -> bool:
        """Is the process running? (Not whether it answers.)"""
        if self.proc is not None:
            return self.proc.poll() is None
        return self.record is not None and self.record.server_alive()

    def stopped(self) -> bool:
        """Is the process stopped (SIGSTOP: alive, never answering) or unreadable? False without one."""
        pid = self._any_pid()
        if pid is None:
            return False
        try:
            return psutil.Process(pid).status() == psutil.STATUS_STOPPED
        except psutil.Error:
            return True

    def log_tail(self, n: int = 20) -> str:
        """The last `n` lines this start wrote to the log."""
        return log_tail(self.log_path, n, since=self._log_offset)

    # ---- lifecycle ---------------------------------------------------------------------------
    def _mark_log(self) -> None:
        """From here on is this start's part of the log (log_tail reads no earlier line)."""
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0

    def _spawn(self, cmd: Sequence[str], env: dict[str, str], *, port: int, host: str, engine: str,
               shown: Sequence[str] | None = None, config_hash: str = "", record_key: str | None = None) -> None:
        """Launch `cmd` in its own process group (its log headed by `shown`, the command without
        secrets), record it on disk (with `record_key`, the key a later kernel adopts it with),
        and count it live."""
        shown = list(shown if shown is not None else cmd)
        self._mark_log()
        header = f"\n==== artsg_nb {datetime.now().isoformat(timespec='seconds')}: {' '.join(shown)}\n"
        self.proc = procs.spawn(cmd, env, self.log_path, header)
        self.record = procs.ProcessRecord.of_child(
            self.proc.pid, port=port, host=host, engine=engine, run_dir=str(self.log_path.parent),
            log_path=str(self.log_path), config_hash=config_hash, command=shown, api_key=record_key)
        self.record.save()
        _LIVE.add(self)

    def _own(self, record: procs.ProcessRecord) -> None:
        """Take `record`'s live process as this one's (an adoption: no Popen handle)."""
        self.proc, self.record = None, record
        self.record.save()
        self._mark_log()
        _LIVE.add(self)

    def _poll_ready(self, timeout_s: float, tick: Callable[[float], None] | None = None) -> None:
        """Poll `_ready` every POLL_S until it says yes, checking the process each round; raise
        `_exit_error` when it exits, `_not_ready_error` after `timeout_s`. `tick(elapsed_s)`
        after each unready round (a progress bar)."""
        t0 = time.monotonic()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.Client(timeout=httpx.Timeout(5.0, connect=1.0), headers=headers) as http:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise self._exit_error(code, time.monotonic() - t0)
                if self._ready(http):
                    log.info("%s ready on %s after %.1f s", self.label, self.url, time.monotonic() - t0)
                    return
                elapsed = time.monotonic() - t0
                if elapsed > timeout_s:
                    raise self._not_ready_error(timeout_s)
                if tick is not None:
                    tick(elapsed)
                time.sleep(POLL_S)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, wait up to `timeout_s`, SIGKILL it. Safe to call again."""
        if self.record is None:
            return
        how = procs.stop_group(self.record.pgid, timeout_s, proc=self.proc)
        log.info("%s pid %d stopped (%s)", self.label, self.record.pid, how)
        self.record.remove()
        self.record = None
        _LIVE.discard(self)

    def kill(self) -> None:
        """SIGKILL the process group (works on a stopped process, where SIGTERM would wait for a
        SIGCONT), then reap it; the restart logic starts a new one."""
        pid = self._any_pid()
        if pid is None:
            return
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            return
        try:
            if self.proc is not None:
                self.proc.wait(timeout=30)
        except Exception as e:  # noqa: BLE001 — the restart logic reaps it anyway
            log.warning("%s pid %s not reaped after SIGKILL: %s", self.label, pid, e)

    def at_exit(self) -> None:
        """What a clean exit of the kernel does with it: stop it."""
        self.stop(timeout_s=5)

    def owned_here(self) -> bool:
        """Started or adopted by this process (not by the parent of a fork)."""
        return self.record is not None and self.record.owner_pid == os.getpid()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_LIVE: set[ManagedProcess] = set()  # started or adopted by this process, not yet stopped


def live(kind: type[ManagedProcess] = ManagedProcess) -> list[ManagedProcess]:
    """The processes of class `kind` this process started or adopted and has not stopped."""
    return [p for p in list(_LIVE) if isinstance(p, kind)]


def stop_all(kind: type[ManagedProcess] = ManagedProcess) -> None:
    """Stop every process of class `kind` this process started (not a fork's parent's)."""
    for p in live(kind):
        if p.owned_here():
            p.stop(timeout_s=5)


def _at_exit() -> None:
    for p in live():
        if p.owned_here():
            p.at_exit()


atexit.register(_at_exit)
