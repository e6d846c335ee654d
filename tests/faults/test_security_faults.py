"""Security defaults and process lifecycle faults (issue 15): who may drive a server, who may
write a run dir, and what a dead kernel, a copied run dir or a failed start leave behind.

  - a server started with defaults on a shared box: other local users can reach 127.0.0.1 and
    read every process's argv (/proc/<pid>/cmdline) → it requires a random key (401 without it
    on every route but /health and /metrics), the key is in no argv of its process group, and
    the pid records and the log that hold it are 0600 even under umask 0;
  - the notebook kernel dies (SIGKILL) and the cell is re-run with the same config → the live
    server is adopted with the key from its 0600 record (no cold start), in ≤ 20 s;
  - two notebooks start a GRPORun on one run dir at the same moment → exactly one trains, the
    other gets RunDirBusyError naming the holder's pid;
  - a run dir copied with its server record, started in the same kernel → the original's server
    keeps running (the record is ignored with a warning);
  - GRPORun.start() fails after the server is up (the trainer cannot be built) → the server is
    stopped, no record is left and the run dir's lock is released.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from artsg_nb.serving import procs
from artsg_nb.engines import SamplingParams
from artsg_nb.serving.procs import RunDirBusyError, RunDirLock
from artsg_nb.serving.server import ServerConfig, start_server
from artsg_nb.run.session import GRPORun, RunConfig
from test_server import fake_cfg, fake_engine, start_kernel  # noqa: F401  (a fixture)

pytestmark = pytest.mark.faults

# A request that proves the server answers: exactly 2 tokens whatever the model would sample
# (ignore_eos), so the check does not depend on where these weights happen to stop.
TWO_TOKENS = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def argv_of_group(pgid: int) -> list[str]:
    """The command lines, as any local user reads them, of every process in group `pgid`."""
    out = []
    for pid in procs.group_members(pgid):
        try:
            out.append(open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"))
        except OSError:
            continue
    return out


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_default_server_requires_a_key_that_no_argv_shows(tmp_path, model_dir, private_server_records, fault_engine):
    old_umask = os.umask(0)  # the worst umask: every file would be world-writable
    try:
        server = start_server(ServerConfig(engine=fault_engine, model_path=str(model_dir), run_dir=str(tmp_path)))
    finally:
        os.umask(old_umask)
    try:
        url, key = server.url, server.api_key
        assert key and len(key) >= 40  # secrets.token_urlsafe(32)
        assert httpx.post(f"{url}/generate", json={"input_ids": [1, 2, 3]}).status_code == 401
        assert httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"}).status_code == 401
        assert httpx.get(f"{url}/model_info", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
        argvs = argv_of_group(server.pid)
        assert argvs and not any(key in a for a in argvs), "the key is readable in /proc/<pid>/cmdline"

        async def generate():
            async with server.client() as client:  # sends the key
                return await client.generate([1, 2, 3], TWO_TOKENS)
        assert len(asyncio.run(generate())[0].output_ids) == 2

        records = [tmp_path / f"{fault_engine}.server.json", *private_server_records.glob("*.json")]
        assert len(records) == 2 and all(mode(p) == 0o600 for p in records), [oct(mode(p)) for p in records]
        assert all(json.loads(p.read_text())["api_key"] == key for p in records)
        assert mode(server.log_path) == 0o600  # SGLang prints its arguments, key included, to the log
        assert not [cmd for cmd in argv_of_group(server.pid) if key in cmd], "the key is in a server process's argv"
    finally:
        server.stop()


ADOPTING_KERNEL = r'''
import signal, sys
from artsg_nb.serving.server import ServerConfig, start_server
server = start_server(ServerConfig(engine=sys.argv[3], model_path=sys.argv[1], run_dir=sys.argv[2]))
print(server.port, server.pid, flush=True)
signal.pause()  # lives until killed
'''


def test_kernel_restart_adopts_the_live_server(tmp_path, model_dir, private_server_records, fault_engine):
    run_dir = tmp_path / "run"
    kernel, port, pid = start_kernel(ADOPTING_KERNEL, str(model_dir), str(run_dir), fault_engine)
    started = procs.create_time(pid)
    key = json.loads((run_dir / f"{fault_engine}.server.json").read_text())["api_key"]
    kernel.send_signal(signal.SIGKILL)  # the kernel dies: no atexit, the server lives on
    kernel.wait()
    kernel.stdout.close()

    t0 = time.monotonic()
    server = start_server(ServerConfig(engine=fault_engine, model_path=str(model_dir), run_dir=str(run_dir)))
    try:
        async def generate():
            async with server.client() as client:
                return await client.generate([1, 2, 3], TWO_TOKENS)
        assert len(asyncio.run(generate())[0].output_ids) == 2
        usable_s = time.monotonic() - t0
        print(f"kernel restart → usable server in {usable_s:.2f} s (adopted pid {pid})")
        assert usable_s <= 20
        assert server.adopted and server.pid == pid and procs.is_running(pid, started) and server.port == port
        assert server.api_key == key
        rec = json.loads((run_dir / f"{fault_engine}.server.json").read_text())
        assert rec["owner_pid"] == os.getpid() and rec["pid"] == pid
        assert [json.loads(p.read_text())["owner_pid"] for p in private_server_records.glob("*.json")] == [os.getpid()]
        assert start_server(ServerConfig(engine=fault_engine, model_path=str(model_dir), run_dir=str(run_dir))) is server
    finally:
        server.stop()
    assert not procs.is_running(pid, started) and procs.group_members(pid) == []


WRITER_KERNEL = r'''
import signal, sys
from artsg_nb.serving.procs import RunDirBusyError
from artsg_nb.run.session import GRPORun, RunConfig
print("ready", flush=True)
sys.stdin.readline()  # the test releases both kernels at the same moment
try:
    run = GRPORun(RunConfig(engine="cpu", model_path=sys.argv[1], run_dir=sys.argv[2], verbose=False)).start()
except RunDirBusyError as e:
    print("busy", str(e).replace("\n", " "), flush=True)
    sys.exit(0)
print("started", run.server.pid, flush=True)
signal.pause()  # lives until killed
'''


@pytest.mark.slow  # two kernels import torch; the winner starts a server and builds its trainer
def test_two_writers_on_one_run_dir(tmp_path, model_dir, private_server_records):
    run_dir = tmp_path / "run"
    kernels = [subprocess.Popen([sys.executable, "-c", WRITER_KERNEL, str(model_dir), str(run_dir)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
               for _ in range(2)]
    try:
        assert [k.stdout.readline().strip() for k in kernels] == ["ready", "ready"]
        for k in kernels:
            k.stdin.write("go\n")
        for k in kernels:
            k.stdin.flush()
        lines = {k.pid: k.stdout.readline().strip() for k in kernels}
        started = [pid for pid, line in lines.items() if line.startswith("started")]
        busy = [line for line in lines.values() if line.startswith("busy")]
        assert len(started) == 1 and len(busy) == 1, lines
        assert f"pid {started[0]}" in busy[0] and "another run_dir" in busy[0], busy[0]
        with pytest.raises(RunDirBusyError, match=f"pid {started[0]}"):  # and in this kernel too
            RunDirLock(run_dir).acquire()
    finally:
        for k in kernels:
            k.kill()
            k.wait()
            k.stdout.close()
            k.stdin.close()
    RunDirLock(run_dir).acquire().release()  # the OS dropped the dead kernel's lock
    procs.reap_orphans()  # the winner's server, orphaned by the kill
    assert not list(private_server_records.glob("*.json"))


def test_copied_run_dir_record_leaves_the_original_server_alone(tmp_path, fake_engine):
    original = start_server(fake_cfg(fake_engine, tmp_path / "a"))
    try:
        shutil.copytree(tmp_path / "a", tmp_path / "b")  # carries a/cpu.server.json along
        copy = start_server(fake_cfg(fake_engine, tmp_path / "b"))
        try:
            assert original.alive() and httpx.get(f"{original.url}/health", timeout=5).status_code == 200
            assert copy.alive() and copy.pid != original.pid
            assert json.loads((tmp_path / "b" / "cpu.server.json").read_text())["run_dir"] == str(tmp_path / "b")
        finally:
            copy.stop()
        assert original.alive()
    finally:
        original.stop()


def test_failed_start_stops_the_server_and_releases_the_lock(tmp_path, model_dir, monkeypatch,
                                                             private_server_records):
    import artsg_nb.run.session as session_module

    def broken_trainer(*args, **kwargs):  # rl.distributed.make_trainer, as the run calls it
        raise RuntimeError("injected: the trainer cannot be built")

    monkeypatch.setattr(session_module, "make_trainer", broken_trainer)
    run = GRPORun(RunConfig(engine="cpu", model_path=str(model_dir), run_dir=str(tmp_path), verbose=False))
    try:
        with pytest.raises(RuntimeError, match="injected"):
            run.start()
        # The server started beside the trainer (server.start_while) was stopped when the trainer failed.
        engines_left = [p for p in psutil.Process().children(recursive=True)
                        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "artsg_nb.cpu_engine" in " ".join(p.cmdline())]
        assert not engines_left, f"the failed start left its server running: {engines_left}"
        assert not list(private_server_records.glob("*.json")) and not (tmp_path / "cpu.server.json").exists()
        RunDirLock(tmp_path).acquire().release()
    finally:
        if run.server is not None and run.server.alive():
            run.server.stop()
