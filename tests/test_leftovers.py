"""Servers that outlive their kernel (issue 50 item 2): a clean exit keeps the server for the next
kernel to adopt, for a grace period after which it stops itself; `list_servers` / `stop_servers`
(and `python -m artsg_nb.servers list|stop`) find and stop what is left, by process group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artsg_nb import servers as cli
from artsg_nb.serving import leftovers, procs
from artsg_nb.serving.server import ServerConfig, start_server
from waiting import wait_until

FAKE_ENGINE = r'''
import argparse, http.server
p = argparse.ArgumentParser()
p.add_argument("--host"); p.add_argument("--port", type=int)
a = p.parse_args()
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # /health and the authenticated probe adoption asks for
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.HTTPServer((a.host, a.port), Ok).serve_forever()
'''

KERNEL = r'''
import sys
from artsg_nb.serving.server import ServerConfig, start_server
s = start_server(ServerConfig(engine="cpu", model_path="fake", run_dir=sys.argv[1],
                              _command_override=(sys.executable, sys.argv[2], "--host", "{host}", "--port", "{port}")))
print(s.pid, s.adopted, flush=True)
if sys.argv[3] == "die":
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)  # no atexit: a killed kernel
'''  # then a clean exit: atexit runs, as when JupyterLab restarts the kernel


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    """Records in a directory of this test's own: list/stop see only the servers it started."""
    path = tmp_path / "records"
    monkeypatch.setenv(procs.STATE_DIR_VAR, str(path))
    yield path
    for rec in map(procs.ProcessRecord.load, path.glob("*.json")):  # a failed test's servers
        if rec is not None and rec.server_alive():
            procs.stop_group(rec.pgid)


@pytest.fixture
def engine(tmp_path) -> Path:
    path = tmp_path / "fake_engine.py"
    path.write_text(FAKE_ENGINE)
    return path


def kernel(run_dir: Path, engine: Path, grace_s: float, how: str = "exit") -> tuple[int, bool]:
    """A stand-in notebook kernel that starts (or adopts) the server of run_dir, then exits
    cleanly (how="exit") or is killed ("die"); (server pid, whether it adopted)."""
    env = {**os.environ, leftovers.GRACE_VAR: str(grace_s)}
    out = subprocess.run([sys.executable, "-c", KERNEL, str(run_dir), str(engine), how], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout, out.stderr[-3000:]
    pid, adopted = out.stdout.split()
    return int(pid), adopted == "True"


def test_a_clean_exit_keeps_the_server_for_the_next_kernel_which_adopts_it(tmp_path, engine):
    run_dir = tmp_path / "run"
    pid, adopted = kernel(run_dir, engine, grace_s=300)
    assert not adopted and procs.is_running(pid, None), "the kernel's exit stopped its server"
    [info] = leftovers.list_servers()
    assert (info.pid, info.state) == (pid, "kept") and info.keep_until > time.time() + 200
    assert procs.reap_orphans() == [] and procs.is_running(pid, None), "another start reaped a kept server"
    again, adopted = kernel(run_dir, engine, grace_s=0)  # the restarted kernel: no cold start
    assert (again, adopted) == (pid, True)
    wait_until(lambda: not procs.is_running(pid, None))  # its own exit, with a grace of 0, stopped it
    assert leftovers.list_servers() == []


def test_the_server_stops_itself_when_no_kernel_adopts_it_in_time(tmp_path, engine):
    pid, _ = kernel(tmp_path / "run", engine, grace_s=1)
    wait_until(lambda: not (tmp_path / "run" / "cpu.server.json").exists())  # the watcher's last act
    assert not procs.is_running(pid, None) and leftovers.list_servers() == []
    assert "grace period" in (tmp_path / "run" / "cpu.log").read_text()


def test_a_grace_of_zero_stops_the_server_at_exit(tmp_path, engine):
    pid, _ = kernel(tmp_path / "run", engine, grace_s=0)
    assert not procs.is_running(pid, None)


def test_list_and_stop_find_leftovers_and_leave_live_kernels_servers(tmp_path, engine, capsys):
    mine = start_server(ServerConfig(engine="cpu", model_path="fake", run_dir=str(tmp_path / "mine"),
                                     _command_override=(sys.executable, str(engine), "--host", "{host}",
                                                        "--port", "{port}")))
    try:  # every start reaps the orphans before it: the killed kernel's comes last
        kept, _ = kernel(tmp_path / "kept", engine, grace_s=300)
        leftover, _ = kernel(tmp_path / "dead", engine, grace_s=0, how="die")
        states = {s.pid: s.state for s in leftovers.list_servers()}
        assert states == {leftover: "leftover", kept: "kept", mine.pid: "in use"}
        assert cli.main(["list"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].split()[:3] == ["PID", "ENGINE", "PORT"] and len(out) == 4
        by_pid = {int(line.split()[0]): line for line in out[1:]}  # oldest first
        assert "in use by kernel" in by_pid[mine.pid] and "kept for the next kernel until" in by_pid[kept]
        assert "leftover: its kernel" in by_pid[leftover]
        with pytest.raises(LookupError, match="no server of this user with pid 1"):
            leftovers.stop_servers([1])
        assert cli.main(["stop"]) == 0  # the ones no live kernel owns
        said = capsys.readouterr().out
        assert f"pid {kept} " in said and f"pid {leftover} " in said and procs.is_running(mine.pid, None)
        assert not procs.is_running(leftover, None) and not procs.is_running(kept, None)
        assert [s.pid for s in leftovers.stop_servers(all=True)] == [mine.pid]
        assert not mine.alive()
    finally:
        mine.stop()


def test_the_grace_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(leftovers.GRACE_VAR, raising=False)
    assert leftovers.exit_grace_s() == 600
    monkeypatch.setenv(leftovers.GRACE_VAR, "30")
    assert leftovers.exit_grace_s() == 30
    monkeypatch.setenv(leftovers.GRACE_VAR, "ten minutes")
    assert leftovers.exit_grace_s() == 600


def test_stop_by_pid_through_the_command_line(tmp_path, engine, capsys):
    pid, _ = kernel(tmp_path / "run", engine, grace_s=300)
    assert cli.main(["stop", str(pid)]) == 0
    assert f"stopped cpu server pid {pid}" in capsys.readouterr().out and not procs.is_running(pid, None)
    assert cli.main(["stop", str(pid)]) == 1 and "no server of this user" in capsys.readouterr().err


def test_the_watcher_does_not_take_the_kernel_that_kept_the_server_for_its_adopter(tmp_path, engine):
    """The keeping kernel is still alive when its watcher starts (its atexit is running): under
    load the watcher saw it alive, took that for an adoption and left the server running for good."""
    from dataclasses import replace

    server = start_server(ServerConfig(engine="cpu", model_path="fake", run_dir=str(tmp_path / "run"),
                                       _command_override=(sys.executable, str(engine), "--host", "{host}",
                                                          "--port", "{port}")))
    try:
        kept = replace(server.record, keep_until=time.time() + 0.3)  # kept by this (live) process
        kept.save()
        assert leftovers.expire(kept.global_path, poll_s=0.05) == "stopped"
        assert not procs.is_running(server.pid, None)
    finally:
        server.stop()  # this process's bookkeeping (server.live_servers()): the watcher stopped the process


GATED_ENGINE = r'''
import argparse, http.server, os, time
from pathlib import Path
p = argparse.ArgumentParser()
p.add_argument("--host"); p.add_argument("--port", type=int)
a = p.parse_args()
here = Path(__file__).parent
class Gated(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # the first request after the test makes `hold` waits for `go`
        try:
            os.rename(here / "hold", here / "held")
        except FileNotFoundError:
            pass
        else:
            while not (here / "go").exists():
                time.sleep(0.01)
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer((a.host, a.port), Gated).serve_forever()
'''


def _server_of(run_dir: Path, engine: Path):
    from artsg_nb.serving.server import Server
    from artsg_nb.serving.server_config import with_env_args
    return Server(with_env_args(ServerConfig(engine="cpu", model_path="fake", run_dir=str(run_dir), _command_override=(
        sys.executable, str(engine), "--host", "{host}", "--port", "{port}"))))


def test_two_kernels_adopting_one_leftover_server_do_not_both_own_it(tmp_path):
    """Kernel A has read the dead kernel's record and is checking the server when kernel B reads
    it too: before, both checked, both wrote themselves in as its owner and both used (and would
    stop) it. Now A claims the record first, so B finds it owned and leaves it alone."""
    import threading

    engine = tmp_path / "gated_engine.py"
    engine.write_text(GATED_ENGINE)
    run_dir = tmp_path / "run"
    pid, _ = kernel(run_dir, engine, grace_s=0, how="die")
    a, b = _server_of(run_dir, engine), _server_of(run_dir, engine)
    adopted = {}
    (tmp_path / "hold").touch()  # A's first request to the server waits
    first = threading.Thread(target=lambda: adopted.update(a=a.adopt(reap=False)))
    first.start()
    try:
        wait_until(lambda: (tmp_path / "held").exists(), what="kernel A checking the server")
        adopted["b"] = b.adopt(reap=False)
    finally:
        (tmp_path / "go").touch()
        first.join(60)
    assert sorted(adopted.values()) == [False, True], f"both kernels took the server: {adopted}"
    owner = procs.ProcessRecord.load(run_dir / "cpu.server.json")
    assert owner.pid == pid and owner.owner_pid == os.getpid()
    for server in (a, b):
        server.stop()
    assert not procs.is_running(pid, None)


def test_the_watcher_leaves_a_server_a_kernel_adopts_at_its_deadline(tmp_path, engine, monkeypatch):
    """The deadline passes while a kernel adopts the kept server: before, the watcher, which had
    read the record just before, stopped the server the kernel had just taken. Now the watcher
    claims the record before it stops anything; the adoption comes too late and says so."""
    run_dir = tmp_path / "run"
    pid, _ = kernel(run_dir, engine, grace_s=300)  # kept, its own watcher asleep for 300 s
    rec = procs.ProcessRecord.load(run_dir / "cpu.server.json")
    due = procs.ProcessRecord(**{**rec.__dict__, "keep_until": time.time()})
    due.save()
    adopter, adopted = _server_of(run_dir, engine), []
    real_stop_group = procs.stop_group

    def adopt_then_stop(pgid, *args, **kwargs):  # a kernel adopts it between the watcher's look and its stop
        adopted.append(adopter.adopt(reap=False))
        return real_stop_group(pgid, *args, **kwargs)

    monkeypatch.setattr(procs, "stop_group", adopt_then_stop)
    assert leftovers.expire(due.global_path, poll_s=0.05) == "stopped"
    assert adopted == [False], "a kernel adopted the server the watcher then stopped"
    assert not procs.is_running(pid, None)
