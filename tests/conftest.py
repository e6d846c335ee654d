"""Shared pytest fixtures and hooks.

What it does: the tiny model the tests run against (the build shipped in the repository,
artsg_nb/models/shipped/tiny-s0-p800, so every machine tests the same weights; ARTSG_TINY_MODEL points
at another, e.g. one built with another seed to check that tests do not lean on its samples),
skipping of tests marked `gpu` where no NVIDIA GPU is visible (markers are declared in
pyproject.toml), and the faults suite's hooks (below, owned by that suite).

What it does not do: start servers or touch the network. A fixture used by one test file belongs
in that file.
"""
import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The shipped tiny model (tiny_model.default_model_dir(); ARTSG_TINY_MODEL points at another)."""
    if os.environ.get("ARTSG_TINY_MODEL"):
        return Path(os.environ["ARTSG_TINY_MODEL"])
    from artsg_nb.models.tiny import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@functools.cache
def nvidia_gpu_missing() -> str | None:
    """Why no NVIDIA GPU is usable here, or None when `nvidia-smi -L` lists one."""
    if shutil.which("nvidia-smi") is None:
        return "needs an NVIDIA GPU: nvidia-smi is not on PATH; run on the GPU host"
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"needs an NVIDIA GPU: `nvidia-smi -L` failed ({e}); run on the GPU host"
    if out.returncode != 0 or "GPU" not in out.stdout:
        detail = (out.stderr or out.stdout).strip()[:200]
        return f"needs an NVIDIA GPU: `nvidia-smi -L` lists none (rc={out.returncode}: {detail}); run on the GPU host"
    return None


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped, with the reason, where no NVIDIA GPU answers nvidia-smi."""
    gpu_tests = [item for item in items if "gpu" in item.keywords]
    reason = nvidia_gpu_missing() if gpu_tests else None
    for item in gpu_tests if reason else []:
        item.add_marker(pytest.mark.skip(reason=reason))


# ---- leftover processes -------------------------------------------------------------------------
# Every process the tests start inherits ARTSG_TEST_SESSION (a fresh token per pytest run). At
# the end of the session, any process still alive with this run's token after a short grace (a
# server a test left running, the orphan of a killed child "kernel") is reported loudly, killed,
# and fails the session. Processes are found by that token, never by name: other users' servers are not ours.
# The hooks carry their own names (hookimpl specname), so another pytest_configure or
# pytest_sessionfinish in this file does not silently replace them. The faults suite's summary
# line is tests/faults/conftest.py's.
import os as _os
import signal as _signal
import uuid as _uuid

import psutil as _psutil
import pytest as _pytest

TEST_SESSION_VAR = "ARTSG_TEST_SESSION"
LEFTOVER_GRACE_S = 10.0  # servers never exit on their own; a `sleep 5` left by a timeout does


@_pytest.hookimpl(specname="pytest_configure")
def pytest_configure_leftover_check(config):
    _os.environ[TEST_SESSION_VAR] = _uuid.uuid4().hex  # fresh, even under an outer pytest


@_pytest.hookimpl(specname="pytest_sessionfinish")
def pytest_sessionfinish_leftover_check(session, exitstatus):
    leftovers = leftover_processes()
    if leftovers:  # a straggler that is about to exit (a timed-out helper's child) is not a leak
        _, alive = _psutil.wait_procs([p for p, _ in leftovers], timeout=LEFTOVER_GRACE_S)
        leftovers = [(p, cmd) for p, cmd in leftovers if p in alive]
    if not leftovers:
        return
    say(session.config, "")  # end the progress line
    say(session.config, f"LEFTOVER PROCESSES started by this test session ({len(leftovers)}), now killed:", red=True)
    for p, cmd in leftovers:
        say(session.config, f"  pid {p.pid}: {' '.join(cmd)[:200]}", red=True)
        try:
            p.send_signal(_signal.SIGKILL)
        except _psutil.Error:
            pass
    session.exitstatus = _pytest.ExitCode.TESTS_FAILED


def leftover_processes() -> list:
    """(process, command line) of every live process that inherited this run's token."""
    token, me = _os.environ.get(TEST_SESSION_VAR), _os.getpid()
    found = []
    for p in _psutil.process_iter():
        try:
            if p.pid != me and p.status() != _psutil.STATUS_ZOMBIE and p.environ().get(TEST_SESSION_VAR) == token:
                found.append((p, p.cmdline()))
        except _psutil.Error:
            continue
    return found


def say(config, line: str, **markup) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line, **markup)
    else:
        print(line, flush=True)
