"""Bad configuration: each mistake gets a specific message that says what to do, before anything
is launched (no server log, no server record, no child process left).

  - server environment missing  → envs.ServerEnvNotFoundError naming the command that creates it
  - model_path not a model      → server.ModelPathError naming the path and what a model dir holds
  - port in use                 → server.PortInUseError naming the port, its owner and port=None
  - GPU engine on a CPU box     → gpus.NoGpuError from GRPORun.start, suggesting engine='cpu'
  - unknown task                → tasks.UnknownTaskError listing the tasks; the CLI prints it as
                                  one line, exit status 1, no traceback
(Adapter rank/target modules, disk full and unsafe adapters are checked on a live run in
test_faults.py.)
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import psutil
import pytest

from artsg_nb.serving.server_env import ServerEnvNotFoundError
from artsg_nb.serving.gpus import NoGpuError, list_gpus
from artsg_nb.serving.server import ModelPathError, PortInUseError, ServerConfig, start_server
from artsg_nb.run.session import GRPORun, RunConfig
from artsg_nb.tasks.registry import UnknownTaskError, list_tasks

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def assert_nothing_launched(run_dir, records) -> None:
    assert not list(run_dir.glob("*.log")), "a server log was written"
    assert not list(records.glob("*.json")), "a server record was written"
    children = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    assert not children, f"processes were started: {[p.cmdline() for p in children]}"


def test_missing_server_env_names_the_command_that_creates_it(tmp_path, model_dir, monkeypatch,
                                                               private_server_records):
    missing = tmp_path / "gone-env" / "bin" / "python"
    monkeypatch.setenv("ARTSG_SERVER_PYTHON", str(missing))  # a stale variable, say
    with pytest.raises(ServerEnvNotFoundError) as err:
        start_server(ServerConfig("sglang", str(model_dir), tmp_path / "run"))
    msg = str(err.value)
    assert "no Python environment with sglang was found" in msg and f"ARTSG_SERVER_PYTHON: {missing} (missing)" in msg
    assert "make server-env" in msg and "Try: create it with" in msg
    assert_nothing_launched(tmp_path / "run", private_server_records)


def test_model_path_that_is_not_a_model_fails_before_launch(tmp_path, private_server_records):
    not_a_model = tmp_path / "checkpoints"
    not_a_model.mkdir()
    (not_a_model / "notes.txt").write_text("the model is somewhere else")
    with pytest.raises(ModelPathError) as err:  # through the notebook's entry point
        GRPORun(RunConfig(engine="cpu", model_path=str(not_a_model), run_dir=str(tmp_path / "run"))).start()
    msg = str(err.value)
    assert f"model_path {not_a_model} is not a model directory: it has no config.json" in msg
    assert "A model directory holds config.json, the weights (*.safetensors) and the tokenizer" in msg
    with pytest.raises(ModelPathError, match=f"model_path {tmp_path / 'typo'} does not exist"):
        start_server(ServerConfig("cpu", str(tmp_path / "typo"), tmp_path / "run"))
    assert_nothing_launched(tmp_path / "run", private_server_records)


def test_port_in_use_names_its_owner(tmp_path, model_dir, private_server_records):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortInUseError) as err:
            start_server(ServerConfig("cpu", str(model_dir), tmp_path / "run", port=port))
    msg = str(err.value)
    assert f"port {port} on 127.0.0.1 is already in use by pid {os.getpid()}" in msg
    assert "Try: port=None to get a free port" in msg
    assert_nothing_launched(tmp_path / "run", private_server_records)


@pytest.mark.skipif(bool(list_gpus()), reason="this machine has a GPU")
def test_gpu_engine_without_a_gpu_fails_before_launch(tmp_path, private_server_records):
    run = GRPORun(RunConfig(engine="sglang", run_dir=str(tmp_path / "run")))
    with pytest.raises(NoGpuError) as err:
        run.start()
    assert "a GPU was asked for" in str(err.value) and "use engine='cpu'" in str(err.value)
    assert run.server is None and run.trainer is None
    assert_nothing_launched(tmp_path / "run", private_server_records)


def test_unknown_task_lists_the_tasks(tmp_path):
    expected = f"unknown task 'nope'; known tasks: {', '.join(t.name for t in list_tasks())}"
    with pytest.raises(UnknownTaskError, match=expected):
        GRPORun(RunConfig(task="nope", run_dir=str(tmp_path / "run"))).start()

    cli = subprocess.run([sys.executable, "-m", "artsg_nb.train", "--task", "nope", "--run-dir", str(tmp_path / "cli")],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 1 and "Traceback" not in cli.stderr, cli.stderr
    assert cli.stderr.strip().splitlines()[-1].startswith(f"error: UnknownTaskError: {expected}")
    assert not (tmp_path / "cli").exists()


def test_eval_every_without_an_eval_split_fails_before_anything_starts(tmp_path, private_server_records):
    """Issue 50: `--task my_tasks:task --eval-every 2` on a dataset task with no eval split trained
    two steps, then died with a 20-frame traceback. Now: one line, exit status 1, nothing started."""
    (tmp_path / "my_tasks.py").write_text(
        "from artsg_nb import Task\n"
        "def zero(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
        "task = Task.from_dataset([{'prompt': f'q{i}'} for i in range(6)], reward_funcs=zero)\n")
    cli = subprocess.run([sys.executable, "-m", "artsg_nb.train", "--task", "my_tasks:task", "--eval-every", "2",
                          "--engine", "cpu", "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert cli.returncode == 1 and "Traceback" not in cli.stderr, cli.stderr
    assert cli.stderr.strip().splitlines()[-1].startswith(
        "error: ConfigError: eval_every=2 evaluates task 'dataset' on held-out prompts, but: split 'eval' has no rows")
    assert not (tmp_path / "run").exists()
    assert_nothing_launched(tmp_path / "run", private_server_records)


def test_engine_typo_fails_with_the_closest_name(tmp_path):
    cli = subprocess.run([sys.executable, "-m", "artsg_nb.train", "--engine", "sglnag", "--run-dir", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 1 and "Traceback" not in cli.stderr, cli.stderr
    assert "error: ConfigError: unknown engine 'sglnag'; did you mean 'sglang'?" in cli.stderr
