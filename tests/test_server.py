"""Server lifecycle against a fake engine (a tiny http.server answering /health), command lines
of the real engines against the reference flags, and — once artsg_nb.cpu_engine exists — one
start/stop of the real CPU engine through the notebook's code path."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from artsg_nb import engines
from artsg_nb.serving import procs, server
from artsg_nb.serving.gpus import GpuInfo, plan_gpus
from artsg_nb.serving.server import (PortInUseError, ServerConfig, ServerNotReady, ServerStartError,
                             build_command, build_env, start_server)
from waiting import LIVES_UNTIL_KILLED, poll_until

FAKE_ENGINE = r'''
import argparse, http.server, signal, subprocess, sys, time
p = argparse.ArgumentParser()
p.add_argument("--host"); p.add_argument("--port", type=int)
p.add_argument("--delay", type=float, default=0.0)
p.add_argument("--exit-code", type=int)
p.add_argument("--ignore-term", action="store_true")
p.add_argument("--child-pid-file")
p.add_argument("--bind-port", type=int)
a = p.parse_args()
print("fake engine starting", flush=True)
if a.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if a.child_pid_file:  # a worker, like SGLang's scheduler processes
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])  # lives until killed
    open(a.child_pid_file, "w").write(str(child.pid))
if a.exit_code is not None:
    for i in range(30):
        print(f"loading shard {i}")
    print("RuntimeError: fake failure")
    sys.exit(a.exit_code)
time.sleep(a.delay)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path in ("/health", "/model_info") else 404)
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass

httpd = http.server.HTTPServer((a.host, a.bind_port or a.port), Health)
print("fake engine ready", flush=True)
httpd.serve_forever()
'''

FAKE_KERNEL = r'''
import json, signal, sys
from artsg_nb.serving.server import ServerConfig, start_server
s = start_server(ServerConfig(engine="cpu", model_path="fake", run_dir=sys.argv[1],
                              _command_override=tuple(json.loads(sys.argv[2]))))
print(s.port, s.pid, flush=True)
signal.pause()  # lives until killed
'''


def start_kernel(code: str, *args: str):
    """A stand-in notebook kernel: `python -c code *args` starts a server and prints "port pid".
    Returns (the kernel process, port, server pid); the caller kills the kernel to orphan it."""
    kernel = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    line = kernel.stdout.readline()
    if not line:
        kernel.wait()
        pytest.fail(f"the kernel could not start its server:\n{kernel.stderr.read()[-4000:]}")
    kernel.stderr.close()
    port, pid = map(int, line.split())
    return kernel, port, pid


@pytest.fixture(scope="module", autouse=True)
def state_dir(tmp_path_factory):
    """Records go to a private directory; at the end nothing may be left running."""
    path = tmp_path_factory.mktemp("state")
    old = os.environ.get(procs.STATE_DIR_VAR)
    os.environ[procs.STATE_DIR_VAR] = str(path)
    yield path
    leaks = server.live_servers()
    server.stop_all()
    children = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    records = list(path.glob("*.json"))
    if old is None:
        os.environ.pop(procs.STATE_DIR_VAR)
    else:
        os.environ[procs.STATE_DIR_VAR] = old
    assert not leaks, f"servers left running by tests: {leaks}"
    assert not children, f"processes left behind: {[p.cmdline() for p in children]}"
    assert not records, f"records left behind: {records}"


@pytest.fixture(scope="module")
def fake_engine(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fake") / "fake_engine.py"
    path.write_text(FAKE_ENGINE)
    return path


def fake_cfg(fake_engine, run_dir, *args, **kw) -> ServerConfig:
    cmd = ("{python}", str(fake_engine), "--host", "{host}", "--port", "{port}", *args)
    return ServerConfig(engine="cpu", model_path="fake", run_dir=str(run_dir),
                        _command_override=cmd, **kw)


def health(srv) -> int:
    return httpx.get(f"{srv.url}/health", timeout=2).status_code


def gone(pid: int, started: float | None) -> bool:
    return not procs.is_running(pid, started)


# ---- lifecycle with the fake engine ---------------------------------------------------------
def test_start_ready_records_stop(fake_engine, tmp_path, state_dir):
    srv = server.Server(fake_cfg(fake_engine, tmp_path)).start()
    assert srv.alive() and health(srv) == 200
    assert srv.url.startswith("http://127.0.0.1:")
    rec = json.loads((tmp_path / "cpu.server.json").read_text())
    assert rec["pid"] == srv.pid and rec["port"] == srv.port and rec["owner_pid"] == os.getpid()
    assert len(list(state_dir.glob("*.json"))) == 1
    assert os.getpgid(srv.pid) == srv.pid  # leads its own process group
    assert "fake engine ready" in srv.log_tail()
    pid, started = srv.pid, srv.record.create_time
    srv.stop()
    srv.stop()  # idempotent
    assert not srv.alive() and gone(pid, started)
    assert not (tmp_path / "cpu.server.json").exists() and not list(state_dir.glob("*.json"))
    assert procs.port_is_free("127.0.0.1", srv.port)


def test_context_manager_and_restart_keeps_port(fake_engine, tmp_path):
    with start_server(fake_cfg(fake_engine, tmp_path)) as srv:
        port, pid = srv.port, srv.pid
        srv.restart()
        assert srv.port == port and srv.pid != pid and health(srv) == 200
    assert not srv.alive()


def test_exit_during_start_shows_log_tail(fake_engine, tmp_path):
    cfg = fake_cfg(fake_engine, tmp_path, "--exit-code", "3")
    with pytest.raises(ServerStartError) as err:
        start_server(cfg)
    msg = str(err.value)
    assert "exited with code 3" in msg and "Try:" in msg
    assert f"Last 20 lines of {tmp_path / 'cpu.log'}" in msg
    assert "RuntimeError: fake failure" in msg and "loading shard 11" in msg
    assert "loading shard 10\n" not in msg  # only the last 20 lines
    assert not isinstance(err.value, ServerNotReady)
    assert not (tmp_path / "cpu.server.json").exists()


def test_memory_saver_without_its_package_names_the_fix(tmp_path):
    # What SGLang 0.5.14 logs when --enable-memory-saver meets an environment without the package.
    code = ("import sys; print('WARNING: enable_memory_saver is enabled, but torch-memory-saver is not installed.'); "
            "print(\"ModuleNotFoundError: No module named 'torch_memory_saver'\"); sys.exit(1)")
    cfg = ServerConfig("cpu", "fake", tmp_path, _command_override=("{python}", "-c", code))
    with pytest.raises(ServerStartError, match="torch_memory_saver package.*whl-tms"):
        start_server(cfg)


def test_timeout_raises_not_ready_and_stops(fake_engine, tmp_path):
    cfg = fake_cfg(fake_engine, tmp_path, "--delay", "60", startup_timeout_s=3.0)  # 3 s: its first line appears on a loaded CI box
    t0 = time.monotonic()
    with pytest.raises(ServerNotReady) as err:
        start_server(cfg)
    assert time.monotonic() - t0 < 10
    assert "no /health on 127.0.0.1:" in str(err.value) and "after 3 s" in str(err.value)
    assert "fake engine starting" in str(err.value)
    assert not server.live_servers()


def test_given_port_busy_raises_before_launch(fake_engine, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is already in use"):
            start_server(fake_cfg(fake_engine, tmp_path, port=port))
    assert not (tmp_path / "cpu.log").exists()  # nothing was launched


def test_bind_failure_in_log_is_port_in_use(fake_engine, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(PortInUseError, match="Address already in use"):
            start_server(fake_cfg(fake_engine, tmp_path, "--bind-port", str(busy)))


def test_idempotent_start_and_config_change(fake_engine, tmp_path):
    cfg = fake_cfg(fake_engine, tmp_path)
    first = start_server(cfg)
    again = start_server(fake_cfg(fake_engine, tmp_path, startup_timeout_s=30))  # timeout only
    assert again is first and again.pid == first.pid
    old_pid, old_started = first.pid, first.record.create_time
    changed = start_server(fake_cfg(fake_engine, tmp_path, max_lora_rank=32))
    assert changed is not first and changed.alive() and gone(old_pid, old_started)
    changed.stop()
    assert start_server(fake_cfg(fake_engine, tmp_path, max_lora_rank=32)) is not changed  # dead → new
    server._REGISTRY[(str(tmp_path.resolve()), "cpu")].stop()


def test_sigkill_when_sigterm_is_ignored(fake_engine, tmp_path):
    srv = start_server(fake_cfg(fake_engine, tmp_path, "--ignore-term"))
    t0 = time.monotonic()
    srv.stop(timeout_s=0.5)
    assert srv.proc.returncode == -signal.SIGKILL and time.monotonic() - t0 < 5


def test_stop_kills_the_whole_process_group(fake_engine, tmp_path):
    pid_file = tmp_path / "child.pid"
    srv = start_server(fake_cfg(fake_engine, tmp_path, "--child-pid-file", str(pid_file)))
    child = int(pid_file.read_text())
    child_started = procs.create_time(child)
    assert procs.is_running(child, child_started) and os.getpgid(child) == srv.pid
    srv.stop()
    assert poll_until(lambda: gone(child, child_started), timeout_s=5)


def test_orphans_of_a_dead_kernel_are_reaped(fake_engine, tmp_path, state_dir):
    mine = start_server(fake_cfg(fake_engine, tmp_path / "mine"))  # a live owner's server: kept
    cmd = ["{python}", str(fake_engine), "--host", "{host}", "--port", "{port}"]
    kernel = subprocess.Popen([sys.executable, "-c", FAKE_KERNEL, str(tmp_path / "dead"), json.dumps(cmd)],
                              stdout=subprocess.PIPE, text=True)
    port, pid = map(int, kernel.stdout.readline().split())
    orphan_started = procs.create_time(pid)
    kernel.send_signal(signal.SIGKILL)  # the kernel dies without running atexit
    kernel.wait()
    kernel.stdout.close()
    assert procs.is_running(pid, orphan_started) and not procs.port_is_free("127.0.0.1", port)

    fresh = start_server(fake_cfg(fake_engine, tmp_path / "fresh"))  # reaps on start
    assert gone(pid, orphan_started) and procs.port_is_free("127.0.0.1", port)
    assert not (tmp_path / "dead" / "cpu.server.json").exists()
    assert mine.alive() and fresh.alive()
    assert server.reap_orphans() == []
    mine.stop()
    fresh.stop()


def test_reaper_leaves_a_recycled_pid_alone(tmp_path, state_dir):
    """A record whose pid now belongs to another process is deleted, the process is not touched."""
    bystander = subprocess.Popen([sys.executable, "-c", LIVES_UNTIL_KILLED])
    try:
        rec = procs.ProcessRecord(pid=bystander.pid, create_time=procs.create_time(bystander.pid) - 100,
                                  port=1, host="127.0.0.1", engine="cpu", run_dir=str(tmp_path),
                                  log_path="x", config_hash="h", owner_pid=2**22 + 7,
                                  owner_create_time=0.0, started_at="then")
        rec.save()
        assert server.reap_orphans() == []
        assert bystander.poll() is None and not list(state_dir.glob("*.json"))
    finally:
        bystander.kill()
        bystander.wait()


# ---- command lines (no launch) --------------------------------------------------------------
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BUNDLE = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
          "--cuda-graph-max-bs", "80")


def test_sglang_command_matches_gpu_readme():
    cfg = ServerConfig("sglang", "MODEL_DIR", "runs/x", port=30000, mem_fraction=0.5, extra_args=BUNDLE)
    assert build_command(cfg, python="python3") == [
        "python3", "-c", engines.sglang.LAUNCHER, "--model-path", "MODEL_DIR", "--host", "127.0.0.1",
        "--port", "30000", "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", *MODULES,
        "--max-loras-per-batch", "4", "--enable-metrics", "--enable-cache-report",
        "--mem-fraction-static", "0.5", *BUNDLE]


def test_sglang_optional_flags_and_plan():
    plan = plan_gpus([GpuInfo(0, "H200", "GPU-a", 143771, 0)])
    cfg = ServerConfig("sglang", "M", "r", port=1, gpu_plan=plan, api_key="s3cret", enable_memory_saver=True,
                       schedule_policy="lpm", disable_radix_cache=True, lora_target_modules=["all"])
    cmd = build_command(cfg, python="py")
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.45"  # from the colocated plan
    assert cmd[cmd.index("--lora-target-modules") + 1:cmd.index("--max-loras-per-batch")] == ["all"]
    for flag in ("--enable-memory-saver", "--disable-radix-cache"):
        assert flag in cmd
    assert cmd[cmd.index("--schedule-policy") + 1] == "lpm"
    assert not any("s3cret" in a for a in cmd) and "--api-key" not in cmd  # argv is world-readable
    env = build_env(cfg, api_key="s3cret")
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["PYTHONUNBUFFERED"] == "1"
    assert env["ARTSG_SGLANG_API_KEY"] == "s3cret"
    assert "--mem-fraction-static" not in build_command(ServerConfig("sglang", "M", "r", port=1), "py")


def test_build_env_is_the_whole_server_environment():
    kernel = {"PATH": "/bin", "PYTHONPATH": "/kernel/site", "PYTHONHOME": "/k", "ARTSG_SGLANG_API_KEY": "stale",
              "CUDA_VISIBLE_DEVICES": "3"}
    cfg = ServerConfig("sglang", "M", "r", port=1, env={"SGLANG_X": "1"})
    env = build_env(cfg, extra_env={"PYTHONPATH": "/server/site"}, base=kernel)
    assert env["PATH"] == "/bin" and env["SGLANG_X"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert env["PYTHONPATH"] == "/server/site" and "PYTHONHOME" not in env  # the server's packages, not the kernel's
    assert "ARTSG_SGLANG_API_KEY" not in env  # no key: a stale one from the kernel would lock the run out
    assert build_env(cfg, api_key="k", base=kernel)["ARTSG_SGLANG_API_KEY"] == "k"
    assert "PYTHONPATH" not in build_env(cfg, base=kernel)
    cpu = build_env(ServerConfig("cpu", "M", "r", port=1), base=kernel)
    assert cpu["PYTHONPATH"] == "/kernel/site"  # the CPU engine runs on the kernel's own packages
    assert kernel["ARTSG_SGLANG_API_KEY"] == "stale"  # the kernel's environment is untouched


def test_vllm_command_and_env_match_gpu_readme():
    cfg = ServerConfig("vllm", "MODEL_DIR", "r", port=8000, mem_fraction=0.5,
                       extra_args=("--attention-backend", "TRITON_ATTN"), env={"VLLM_USE_FLASHINFER_SAMPLER": "0"})
    assert build_command(cfg, python="python3") == [
        "python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "MODEL_DIR",
        "--host", "127.0.0.1", "--port", "8000", "--enable-lora", "--max-lora-rank", "16",
        "--max-loras", "4", "--enable-prefix-caching", "--logprobs-mode", "processed_logprobs",
        "--enable-prompt-tokens-details", "--gpu-memory-utilization", "0.5",
        "--attention-backend", "TRITON_ATTN"]
    env = build_env(cfg, extra_env={"PYTHONPATH": "/tmp/vsite"}, api_key="vk")
    assert env["VLLM_API_KEY"] == "vk"  # vLLM reads it when --api-key is absent
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PYTHONPATH"] == "/tmp/vsite" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    no_cache = build_command(ServerConfig("vllm", "M", "r", port=1, disable_radix_cache=True), "py")
    assert "--no-enable-prefix-caching" in no_cache and "--enable-prefix-caching" not in no_cache


def test_memory_saver_flag_per_engine():
    saver = dict(port=1, enable_memory_saver=True, enable_weights_cpu_backup=True)
    sglang = build_command(ServerConfig("sglang", "M", "r", **saver), "py")
    cpu = build_command(ServerConfig("cpu", "M", "r", **saver), "py")
    assert {"--enable-memory-saver", "--enable-weights-cpu-backup"} <= set(sglang) & set(cpu)
    vllm = build_command(ServerConfig("vllm", "M", "r", **saver), "py")
    assert "--enable-sleep-mode" in vllm and "--enable-memory-saver" not in vllm  # sleep always backs up weights
    plain = build_command(ServerConfig("sglang", "M", "r", port=1), "py")
    assert not {"--enable-memory-saver", "--enable-weights-cpu-backup"} & set(plain)


@pytest.mark.parametrize("rank", [2, 4, 48, 100, 1024])
def test_vllm_rejects_ranks_it_does_not_support(rank):
    with pytest.raises(ValueError, match="vLLM accepts max_lora_rank only in"):
        ServerConfig("vllm", "M", "r", max_lora_rank=rank)
    ServerConfig("sglang", "M", "r", max_lora_rank=rank)  # SGLang takes any rank


def test_cpu_engine_command():
    cfg = ServerConfig("cpu", "/m", "r", port=5, api_key="k", disable_radix_cache=True, mem_fraction=0.3)
    assert build_command(cfg, python="py") == [
        "py", "-m", "artsg_nb.cpu_engine", "--model-path", "/m", "--host", "127.0.0.1", "--port", "5",
        "--max-lora-rank", "16", "--lora-target-modules", *MODULES, "--max-loras-per-batch", "4",
        "--enable-cache-report", "--disable-radix-cache"]
    assert build_env(cfg, api_key="k")["ARTSG_CPU_ENGINE_API_KEY"] == "k"
    assert cfg.timeout_s == 120 and ServerConfig("sglang", "/m", "r").timeout_s == 600


def test_start_server_applies_the_engine_args_variable(monkeypatch):
    """$ARTSG_SGLANG_ARGS reaches every start_server caller (GRPORun, bench, tools), not only
    GRPORun; explicit extra_args win."""
    monkeypatch.setenv("ARTSG_SGLANG_ARGS", "--attention-backend triton")
    srv = server.Server(ServerConfig("sglang", "M", "r", port=1))
    assert srv.config.extra_args == ("--attention-backend", "triton")
    assert build_command(srv.config, "py")[-2:] == ["--attention-backend", "triton"]
    assert server.Server(ServerConfig("sglang", "M", "r", extra_args=("--x",))).config.extra_args == ("--x",)


def test_api_key_defaults_to_a_random_key_per_start(caplog):
    cfg = ServerConfig("cpu", "M", "r")
    assert cfg.api_key == "auto"
    a, b = server.resolve_api_key(cfg), server.resolve_api_key(cfg)
    assert a != b and len(a) >= 40
    with caplog.at_level("WARNING"):
        assert server.resolve_api_key(ServerConfig("cpu", "M", "r", api_key=None)) is None
    assert "api_key=None" in caplog.text
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig("cpu", "M", "r", api_key="two words")


def test_config_validation():
    with pytest.raises(ValueError, match="engine="):
        ServerConfig("tgi", "M", "r")
    with pytest.raises(ValueError, match="mem_fraction"):
        ServerConfig("sglang", "M", "r", mem_fraction=1.5)
    with pytest.raises(ValueError, match="needs a port"):
        build_command(ServerConfig("sglang", "M", "r"))
    with pytest.raises(ValueError, match="gRPC port"):
        ServerConfig("sglang", "M", "r", port=60000)


def test_free_ports_suit_sglang():
    ports = {procs.pick_free_port("127.0.0.1") for _ in range(50)}
    assert all(20000 <= p < 32768 and p + 10000 <= 65535 for p in ports) and len(ports) > 40


# ---- the real CPU engine --------------------------------------------------------------------
HAS_CPU_ENGINE = importlib.util.find_spec("artsg_nb.cpu_engine") is not None
HAS_WEB = all(importlib.util.find_spec(m) is not None for m in ("fastapi", "uvicorn"))


@pytest.mark.skipif(not HAS_CPU_ENGINE, reason="artsg_nb/cpu_engine/ is not written yet")
@pytest.mark.skipif(not HAS_WEB, reason="the CPU engine's fastapi/uvicorn are not installed here")
def test_real_cpu_engine_starts_and_stops(tmp_path):
    from artsg_nb.models.tiny import default_model_dir

    cfg = ServerConfig(engine="cpu", model_path=str(default_model_dir(pretrain_steps=0)), run_dir=str(tmp_path))
    srv = start_server(cfg)
    try:
        assert health(srv) == 200
        assert start_server(cfg) is srv
    finally:
        pid, started = srv.pid, srv.record.create_time
        srv.stop()
    assert gone(pid, started) and not srv.alive()


# ---- the race for a port (issue 49, defect 3) -------------------------------------------------
# Two notebooks starting on one port, or a local user who took it first: the start that does not
# own the port must fail naming it, never report ready on the other process's answers, and never
# send that process its key. `port_is_free` patched to True is the race: the check before launch
# saw the port free, then the other process bound it.
FOREIGN = r'''
import http.server, sys
seen = open(sys.argv[1], "a")
class AnyKey(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        seen.write(f"{self.path} {self.headers.get('Authorization')}\n"); seen.flush()
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    do_POST = do_GET
    def log_message(self, *args):
        pass
httpd = http.server.HTTPServer(("127.0.0.1", 0), AnyKey)
print(httpd.server_address[1], flush=True)
httpd.serve_forever()
'''


@pytest.fixture
def foreign(tmp_path):
    """A process of someone else listening on 127.0.0.1, answering 200 to any request and key;
    yields (port, the requests it received as "path authorization" lines)."""
    seen = tmp_path / "foreign-requests.txt"
    seen.touch()
    proc = subprocess.Popen([sys.executable, "-c", FOREIGN, str(seen)], stdout=subprocess.PIPE, text=True)
    try:
        yield int(proc.stdout.readline()), seen
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def cpu_cfg(run_dir, **kw) -> ServerConfig:
    from artsg_nb.models.tiny import default_model_dir
    return ServerConfig(engine="cpu", model_path=str(default_model_dir(pretrain_steps=0)), run_dir=str(run_dir), **kw)


needs_cpu_engine = pytest.mark.skipif(not (HAS_CPU_ENGINE and HAS_WEB),
                                      reason="the CPU engine or its fastapi/uvicorn are not installed here")


@needs_cpu_engine
@pytest.mark.parametrize("api_key", ["auto", None])
def test_second_start_on_one_port_loses_with_the_port_named(tmp_path, monkeypatch, api_key):
    first = start_server(cpu_cfg(tmp_path / "a", port=procs.pick_free_port("127.0.0.1"), api_key=api_key))
    try:
        monkeypatch.setattr(procs, "port_is_free", lambda host, port: True)
        second = server.Server(cpu_cfg(tmp_path / "b", port=first.port, api_key=api_key))
        with pytest.raises(PortInUseError, match=f"port {first.port} on 127.0.0.1"):
            second.start()
        assert not second.alive() and second.record is None and not (tmp_path / "b" / "cpu.server.json").exists()
        headers = {"Authorization": f"Bearer {first.api_key}"} if first.api_key else {}
        assert httpx.get(f"{first.url}/model_info", headers=headers, timeout=5).status_code == 200
    finally:
        first.stop()


@needs_cpu_engine
@pytest.mark.parametrize("api_key", ["auto", None])
def test_a_foreign_listener_on_the_port_is_never_probed(tmp_path, monkeypatch, foreign, api_key):
    port, seen = foreign
    monkeypatch.setattr(procs, "port_is_free", lambda host, port: True)
    srv = server.Server(cpu_cfg(tmp_path, port=port, api_key=api_key))
    with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 was taken by another process") as err:
        srv.start()
    assert "nothing was sent" in str(err.value) and "Try: port=None" in str(err.value)
    assert not srv.alive() and srv.record is None
    assert seen.read_text() == ""  # not one request, so not the key either


@needs_cpu_engine
def test_a_free_port_taken_before_the_bind_is_given_up_for_another(tmp_path, monkeypatch, foreign):
    port, seen = foreign
    picks = iter([port])
    real_pick = procs.pick_free_port
    monkeypatch.setattr(procs, "pick_free_port", lambda host: next(picks, None) or real_pick(host))
    srv = server.Server(cpu_cfg(tmp_path)).start()
    try:
        assert srv.port != port and health(srv) == 200
        assert "Bearer" not in seen.read_text()
    finally:
        srv.stop()


# ---- real SGLang on a GPU host (see tools/gpu/README.md) -------------------------------------
def _sglang_env_ready() -> bool:
    from artsg_nb.serving.gpus import list_gpus
    return bool(os.environ.get("ARTSG_SERVER_PYTHON")) and bool(list_gpus())


SGLANG_TEST_ARGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch",
                    "--grammar-backend", "none", "--disable-cuda-graph")  # valid for any 0.5.x

KERNEL_STARTS_SGLANG = r'''
import sys
from artsg_nb.serving.gpus import plan_gpus
from artsg_nb.serving.server import ServerConfig, start_server
s = start_server(ServerConfig("sglang", sys.argv[1], sys.argv[2], gpu_plan=plan_gpus(prefer="colocated"),
                              mem_fraction=0.3, extra_args=tuple(sys.argv[3:])))
print(s.port, s.pid, flush=True)
import signal; signal.pause()  # lives until killed
'''


def _gpu0_processes_gib() -> dict[int, float]:
    from artsg_nb.serving.gpus import list_gpus, process_memory_mib
    return {pid: mib / 1024 for pid, mib in process_memory_mib(list_gpus()[0].index).items()}


class GpuHolding:
    """What a server's processes hold on GPU 0, by NVML's figures for those processes, so that other
    GPU users do not count (the smoke runs these tests beside its other parts, on the same GPU).
    `counted` is False where NVML names none of them (a runtime that reports other pids, or none):
    the device-wide figures would then count the other parts' servers, so there is nothing to check."""

    def __init__(self, pids: list[int]):
        self.pids = set(pids)
        self.counted = bool(self.pids & set(_gpu0_processes_gib()))

    def gib(self) -> float:
        return sum(gib for pid, gib in _gpu0_processes_gib().items() if pid in self.pids)

    def released(self, timeout_s: float = 30) -> bool:
        """Whether, within timeout_s, NVML names none of the processes any more."""
        return poll_until(lambda: not self.pids & set(_gpu0_processes_gib()), timeout_s, poll_s=0.5)


def _sglang_memory_lines(log: Path) -> list[str]:
    """What SGLang's log says of its memory (free at start, weights loaded, KV pool sized)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [line[-200:] for line in lines if "avail mem" in line or "KV Cache" in line][-6:]


@pytest.mark.gpu
@pytest.mark.sglang
@pytest.mark.skipif(not _sglang_env_ready(), reason="needs a GPU and ARTSG_SERVER_PYTHON (real SGLang)")
def test_real_sglang_orphan_reaped_then_start_stop(tmp_path):
    """A kernel that dies leaves SGLang (and its scheduler workers) running on the GPU; the next
    start reaps the whole group and frees the memory; its own server stops cleanly too."""
    from artsg_nb.serving.gpus import plan_gpus
    from artsg_nb.models.tiny import default_model_dir

    model = str(default_model_dir("0.5b", pretrain_steps=0))
    kernel, port, pid = start_kernel(KERNEL_STARTS_SGLANG, model, str(tmp_path / "dead"), *SGLANG_TEST_ARGS)
    workers = procs.group_members(pid)
    orphan = GpuHolding(workers)
    held_gib = orphan.gib()
    # Its KV pool is 0.3 of what was free when SGLang started, less the weights: 0.3 x 141 GiB on an
    # idle H200, 14.9 GiB on an H100 that another part's server shared (2026-12-06). A CUDA context
    # and the 0.5b model's weights alone come to ~1.5 GiB: more than 3 means it holds a pool.
    assert len(workers) >= 2, workers
    assert held_gib > 3 or not orphan.counted, (held_gib, _sglang_memory_lines(tmp_path / "dead" / "sglang.log"))
    kernel.send_signal(signal.SIGKILL)
    kernel.wait()
    kernel.stdout.close()
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200  # orphaned, alive

    cfg = ServerConfig("sglang", model, str(tmp_path / "new"), gpu_plan=plan_gpus(prefer="colocated"),
                       mem_fraction=0.3, extra_args=SGLANG_TEST_ARGS)
    t0 = time.monotonic()
    srv = start_server(cfg)  # reaps first
    try:
        print(f"SGLang {srv.server_env.version} ready in {time.monotonic() - t0:.0f} s; orphan held "
              + (f"{held_gib:.1f} GiB" if orphan.counted else "memory NVML does not attribute to its pids"))
        assert not any(procs.is_running(w, None) for w in workers)
        assert orphan.released(timeout_s=0), "NVML still names the reaped orphan's processes"
        assert procs.port_is_free("127.0.0.1", port)
        served = GpuHolding(procs.group_members(srv.pid))
        assert health(srv) == 200 and len(served.pids) >= 2
        assert start_server(cfg) is srv
        cmd = srv.record.command
        # 0.3 of the GPU's total over what was free at launch (SGLang counts from there): at least 0.3,
        # more while another part's server shares the GPU. That the reap comes before this reading is
        # test_a_start_reaps_orphans_before_it_reads_the_free_memory's (on CPU).
        assert 0.3 <= float(cmd[cmd.index("--mem-fraction-static") + 1]) < 1
    finally:
        srv.stop(timeout_s=30)
    assert served.released(), f"NVML still names the stopped server's processes: {served.gib():.1f} GiB"


def test_a_start_reaps_orphans_before_it_reads_the_free_memory(monkeypatch, tmp_path):
    """SGLang's launch fraction is the planned share over the memory free at launch: read while a
    dead kernel's server still held its share, it would size the new server over the orphan's
    memory. So a start reaps first, then reads the free memory."""
    from artsg_nb.serving import gpus
    from artsg_nb.serving.server_env import ServerEnv

    events = []

    class Launched(Exception):
        pass

    def launch(self):
        self._launch_config()
        raise Launched

    monkeypatch.setattr(server, "reap_orphans", lambda: events.append("reap") or [])
    monkeypatch.setattr(gpus, "launch_mem_fraction", lambda share, ids: events.append("read free memory") or share)
    monkeypatch.setattr(server, "check_model_path", lambda path: None)
    monkeypatch.setattr(server, "find_server_env", lambda spec, python: ServerEnv(sys.executable, spec.name, "test", {}, "test"))
    monkeypatch.setattr(server.Server, "_launch", launch)
    total = 143771.0
    plan = plan_gpus([GpuInfo(0, "NVIDIA H200", "GPU-0", total, 512.0)], prefer="colocated")
    cfg = ServerConfig("sglang", str(tmp_path), str(tmp_path), gpu_plan=plan, mem_fraction=0.3, api_key=None)
    with pytest.raises(Launched):
        server.Server(cfg).start()
    assert events == ["reap", "read free memory"]


@pytest.mark.parametrize("ok, style", [(True, "success"), (False, "danger")])
def test_start_bar_ends_green_on_success_and_red_on_failure(ok, style, capsys):
    """tqdm.notebook paints a bar closed short of its total red: a server ready after 9 of
    120 s must not look failed, and a failure must never look done."""
    from tqdm.notebook import tqdm as notebook_tqdm

    from artsg_nb.serving.server import _end_bar

    bar = notebook_tqdm(total=120, bar_format="{desc}: {n:.0f}/{total} s")
    bar.update(9)
    _end_bar(bar, ok=ok)
    bar.close()
    assert bar.container.children[1].bar_style == style


def test_an_sglang_server_beside_another_is_launched_with_its_share_of_the_total(monkeypatch, tmp_path, caplog):
    """SGLang counts --mem-fraction-static from the memory free at its start; vLLM's
    --gpu-memory-utilization and the CPU engine's flag count from the total (or nothing)."""
    from artsg_nb.serving import gpus

    total = 143771.0
    half_taken = [GpuInfo(0, "NVIDIA H200", "GPU-0", total, 512.0 + 0.35 * total)]
    monkeypatch.setattr(gpus, "list_gpus", lambda: half_taken)
    plan = plan_gpus(half_taken, num_servers=2).for_server(1)

    def launched_fraction(engine: str) -> str | None:
        cfg = ServerConfig(engine=engine, model_path=str(tmp_path), run_dir=str(tmp_path), gpu_plan=plan, api_key=None)
        caplog.clear()  # the config's own api_key=None warning
        cmd = build_command(server.Server(cfg)._launch_config(), "py", 1)
        assert "api_key=None" not in caplog.text, "the launch copy ran __post_init__ again"
        flag = {"sglang": "--mem-fraction-static", "vllm": "--gpu-memory-utilization"}.get(engine)
        return cmd[cmd.index(flag) + 1] if flag in cmd else None

    assert launched_fraction("sglang") == "0.5414"  # 0.35 x total over the 64.6 % free
    assert launched_fraction("vllm") == "0.35"
    monkeypatch.setattr(gpus, "list_gpus", lambda: [GpuInfo(0, "NVIDIA H200", "GPU-0", total, total - 12 * 1024)])
    assert launched_fraction("sglang") == "0.5"  # no room for its share: the 6 of 12 GiB free that fit beside the reserve


@pytest.mark.parametrize("key", ["-starts-with-a-dash", "plain_key-123"])
def test_the_key_launcher_hands_any_key_to_an_argparse_program(tmp_path, key):
    """secrets.token_urlsafe starts with '-' once in 64 keys; `--api-key -xyz` then reads to argparse
    as a missing value and the program exits 2 (fresh-clone CI at d018595: sglang_router's
    launch_router, in the fleet restart fault test). `--api-key=<key>` holds for every key."""
    from artsg_nb.engines.spec import key_launcher

    (tmp_path / "keyed_program.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--api-key')\nprint(p.parse_args().api_key)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TEST_KEY": key}
    done = subprocess.run([sys.executable, "-c", key_launcher("keyed_program", "TEST_KEY")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, key), done.stderr
