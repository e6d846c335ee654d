"""The health watchdog sees a hung router (num_servers > 1).

A Fleet of two workers that answer, in front of them a router process (a real process in its own
group, standing in for sglang-router, which the CPU host lacks) that is SIGSTOPped: the fleet
says it is stopped (the watchdog's check), and kill() SIGKILLs the router, not the healthy
workers, so restart() starts only a new router (before: stopped() looked only at the workers, and
a step behind a stopped router stayed blocked). FleetClient.health asks the router too.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

from artsg_nb.serving.fleet import Fleet, FleetClient
from artsg_nb.serving.router import Router
from waiting import LIVES_UNTIL_KILLED, poll_until


class Worker:
    def __init__(self):
        self.killed = False

    def stopped(self):
        return False

    def kill(self):
        self.killed = True


class Health:
    engine = "cpu"

    def __init__(self, ok):
        self.ok = ok

    async def health(self, timeout_s=30.0):
        return self.ok


def test_a_stopped_router_is_seen_and_killed_alone(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", LIVES_UNTIL_KILLED], start_new_session=True)
    try:
        fleet = object.__new__(Fleet)
        fleet.servers = [Worker(), Worker()]
        fleet.router = Router(workers=[], run_dir=tmp_path, proc=proc)
        assert not fleet.stopped()
        os.kill(proc.pid, signal.SIGSTOP)
        poll_until(fleet.router.stopped, timeout_s=5, poll_s=0.05)
        assert fleet.stopped()
        fleet.kill()
        assert proc.poll() is not None and not any(w.killed for w in fleet.servers)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_fleet_health_includes_the_router():
    client = FleetClient(SimpleNamespace(), Health(False), [Health(True), Health(True)])
    assert asyncio.run(client.health()) is False
    client = FleetClient(SimpleNamespace(), Health(True), [Health(True), Health(True)])
    assert asyncio.run(client.health()) is True
