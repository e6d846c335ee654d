"""The health watchdog's two rules, on fakes: no /health answer for hang_timeout_s, and /health
answering while requests in flight make no progress (a wedged scheduler: SGLang's /health can keep
answering then). Progress is the engine's per-round token counter read from /metrics."""
from __future__ import annotations

import asyncio

from artsg_nb.watchdog import HealthWatchdog


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

    async def metrics_text(self):
        if self.moving:
            self.tokens += 7
        return f'sglang:realtime_tokens_total{{mode="decode"}} {self.tokens}\n'


def watch(client, seconds=1.0, hang_timeout_s=0.3) -> FakeServer:
    server = FakeServer()
    dog = HealthWatchdog(lambda: server, lambda: client, hang_timeout_s)

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


def test_an_idle_server_is_left_alone():
    assert watch(FakeClient(in_flight=0)).kills == 0
