"""The health watchdog's two rules, on fakes: no /health answer for hang_timeout_s, and /health
answering while requests in flight make no progress (a wedged scheduler: SGLang's /health can keep
answering then). Progress is the engine's per-round token counter read from /metrics."""
from __future__ import annotations

import asyncio

from artsg_nb.run.watchdog import HealthWatchdog


class FakeServer:
    def __init__(self):
        self.kills = 0

    def alive(self):
        return self.kills == 0

    def stopped(self):
        return False

    def kill(self):
        self.kills += 1


class FakeClient:
    engine = "sglang"

    def __init__(self, healthy=True, in_flight=0, moving=False):
        self.healthy, self.in_flight, self.moving, self.tokens = healthy, in_flight, moving, 0

    async def health(self, timeout_s=None):
        return self.healthy

    counter = True

    async def metrics_text(self):
        if self.moving:
            self.tokens += 7
        if not self.counter:  # e.g. vLLM --disable-log-stats: only the cache counters
            return "sglang:prompt_tokens_total 10\n"
        return f'sglang:realtime_tokens_total{{mode="decode"}} {self.tokens}\n'


def watch(client, seconds=1.0, hang_timeout_s=0.3, stall_timeout_s=0.3) -> FakeServer:
    server = FakeServer()
    dog = HealthWatchdog(lambda: server, lambda: client, hang_timeout_s, stall_timeout_s)

    async def go():
        dog.start()
        await asyncio.sleep(seconds)
        await dog.stop()
    asyncio.run(go())
    return server


def test_a_server_that_stops_answering_health_is_killed():
    assert watch(FakeClient(healthy=False)).kills == 1


def test_requests_in_flight_without_progress_get_the_server_killed_while_health_answers():
    assert watch(FakeClient(in_flight=3)).kills == 1


def test_requests_that_make_progress_are_left_alone_however_long_they_take():
    assert watch(FakeClient(in_flight=3, moving=True)).kills == 0


def test_the_stall_limit_is_its_own_and_longer_by_default():
    assert watch(FakeClient(in_flight=3), stall_timeout_s=5.0).kills == 0
    assert HealthWatchdog(None, None, 60.0).stall_timeout_s == 300.0


def test_a_server_without_the_progress_counter_is_judged_by_health_alone():
    client = FakeClient(in_flight=3)
    client.counter = False
    assert watch(client).kills == 0


def test_a_fleet_reports_its_workers_progress_summed():
    """FleetClient.metrics_text carries the progress counter (before: only the cache counters,
    which read as no progress and got every busy fleet killed)."""
    import asyncio as aio
    from types import SimpleNamespace

    from artsg_nb.serving.fleet import FleetClient
    from artsg_nb.serving.metrics import progress_tokens

    class Worker:
        def __init__(self, tokens):
            self.tokens = tokens

        async def metrics_text(self):
            return (f"sglang:prompt_tokens_total 5\nsglang:cached_tokens_total 1\n"
                    f'sglang:realtime_tokens_total{{mode="decode"}} {self.tokens}\n')

    servers = [object(), object()]
    fleet = SimpleNamespace(servers=servers, record=lambda server, counters: counters)
    client = FleetClient(fleet, SimpleNamespace(engine="sglang"), [Worker(3), Worker(4)])
    assert progress_tokens(aio.run(client.metrics_text()), "sglang") == 7


def test_an_idle_server_is_left_alone():
    assert watch(FakeClient(in_flight=0)).kills == 0
