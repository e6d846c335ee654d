"""The notebook kernel dies, or the restart policy is off.

  - kernel restart: a child python process (the old kernel) starts the CPU engine with
    start_server and is SIGKILLed, so its atexit cleanup never runs. The server lives on as an
    orphan. The next start in this process (the new kernel), in the same run_dir and on the same
    port, finds it through its pid record, stops its whole process group (never by name), and gets
    the port; no record of the dead kernel's server is left.
  - restart policy off (max_restarts=0): a server death raises ServerLostError at once, naming
    the cause, what to do and the log tail, without a restart.
(tests/test_server.py covers reaping with a fake engine in another run_dir, and a live owner's
server being left alone; the session-wide check for leftover processes is in conftest.py.)
"""
from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from artsg_nb.serving import procs
from artsg_nb.serving.server import start_server
from artsg_nb.run.session import GRPORun, RunConfig, ServerLostError
from test_server import fake_cfg, fake_engine, start_kernel  # noqa: F401  (a fixture)

pytestmark = pytest.mark.faults

OLD_KERNEL = r'''
import signal, sys
from artsg_nb.serving.server import ServerConfig, start_server
server = start_server(ServerConfig(engine="cpu", model_path=sys.argv[1], run_dir=sys.argv[2]))
print(server.port, server.pid, flush=True)
signal.pause()  # lives until killed
'''


def test_kernel_restart_reaps_the_dead_kernels_server(tmp_path, fake_engine, private_server_records, tiny_model_dir):
    run_dir = tmp_path / "run"
    kernel, port, pid = start_kernel(OLD_KERNEL, str(tiny_model_dir), str(run_dir))
    started = procs.create_time(pid)
    kernel.send_signal(signal.SIGKILL)
    kernel.wait()
    kernel.stdout.close()
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200  # an orphan, serving
    assert json.loads((run_dir / "cpu.server.json").read_text())["pid"] == pid
    assert [json.loads(p.read_text())["pid"] for p in private_server_records.glob("*.json")] == [pid]

    server = start_server(fake_cfg(fake_engine, run_dir, port=port))  # the notebook, re-run
    try:
        assert not procs.is_running(pid, started) and procs.group_members(pid) == []
        assert server.port == port and httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert json.loads((run_dir / "cpu.server.json").read_text())["pid"] == server.pid
        assert [json.loads(p.read_text())["pid"] for p in private_server_records.glob("*.json")] == [server.pid]
    finally:
        server.stop()


def test_restart_policy_off_raises_server_lost_at_once(tmp_path, fake_engine, faults):
    run = GRPORun(RunConfig(engine="cpu", run_dir=str(tmp_path), max_restarts=0))
    run.server = start_server(fake_cfg(fake_engine, tmp_path))
    faults.kill_server(run.server)

    async def rollouts():
        raise AssertionError("must not run: the server is gone")

    with pytest.raises(ServerLostError) as err:
        asyncio.run(run.supervisor.with_restarts(rollouts))
    msg = str(err.value)
    assert "the cpu server was killed by SIGKILL" in msg and "automatic restarts are off (max_restarts=0)" in msg
    assert f"Completed steps (adapters, optimizer state, history) are saved in {tmp_path}" in msg
    assert "resume=True" in msg and f"Last 20 lines of {run.server.log_path}" in msg and "fake engine ready" in msg
    assert run.restarts == 0 and not run.server.alive()
    run.stop()
