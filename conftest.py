"""Session-wide pytest hooks for every suite of the repository (tests/ and notebooks/).

What it does: fails a test session that left processes running (below). It lives at the
repository's root so that the notebooks suite (tools/run_tests.sh runs `pytest --nbmake
notebooks` apart from tests/) is checked like the others; tests/conftest.py holds the fixtures.
"""
# Every process the tests start inherits ARTSG_TEST_SESSION (a fresh token per pytest run). At
# the end of the session, any process still alive with this run's token after a short grace (a
# server a test left running, the orphan of a killed child "kernel") is reported loudly, killed,
# and fails the session. Processes are found by that token, never by name: other users' servers are not ours.
# The hooks carry their own names (hookimpl specname), so another pytest_configure or
# pytest_sessionfinish in this file does not silently replace them. The faults suite's summary
# line is tests/faults/conftest.py's.
import os
import signal
import uuid

import psutil
import pytest

TEST_SESSION_VAR = "ARTSG_TEST_SESSION"
LEFTOVER_GRACE_S = 10.0  # servers never exit on their own; a `sleep 5` left by a timeout does


@pytest.hookimpl(specname="pytest_configure")
def pytest_configure_leftover_check(config):
    os.environ[TEST_SESSION_VAR] = uuid.uuid4().hex  # fresh, even under an outer pytest
    # A process (a test's stand-in kernel, a notebook's) that exits without stop() stops its
    # servers at once, as before the grace period existed; tests of the grace set their own.
    os.environ["ARTSG_SERVER_GRACE_S"] = "0"


@pytest.hookimpl(specname="pytest_sessionfinish")
def pytest_sessionfinish_leftover_check(session, exitstatus):
    leftovers = leftover_processes()
    if leftovers:  # a straggler that is about to exit (a timed-out helper's child) is not a leak
        _, alive = psutil.wait_procs([p for p, _ in leftovers], timeout=LEFTOVER_GRACE_S)
        leftovers = [(p, cmd) for p, cmd in leftovers if p in alive]
    if not leftovers:
        return
    say(session.config, "")  # end the progress line
    say(session.config, f"LEFTOVER PROCESSES started by this test session ({len(leftovers)}), now killed:", red=True)
    for p, cmd in leftovers:
        say(session.config, f"  pid {p.pid}: {' '.join(cmd)[:200]}", red=True)
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def leftover_processes() -> list:
    """(process, command line) of every live process that inherited this run's token."""
    token, me = os.environ.get(TEST_SESSION_VAR), os.getpid()
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != me and p.status() != psutil.STATUS_ZOMBIE and p.environ().get(TEST_SESSION_VAR) == token:
                found.append((p, p.cmdline()))
        except psutil.Error:
            continue
    return found


def say(config, line: str, **markup) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line, **markup)
    else:
        print(line, flush=True)
