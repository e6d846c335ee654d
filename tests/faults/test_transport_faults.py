"""Faults of the HTTP transport: a kept-alive connection the server closes as a request goes out.

uvicorn closes a connection idle for timeout_keep_alive (5 s); a client that keeps connections
for as long (httpx's default keepalive_expiry is 5 s too) sometimes sends a request on a
connection the server is closing at that moment, and reads a reset (`ReadError`) or an empty
answer (`RemoteProtocolError`). A probe measured 22 of 960 requests (2.3 %) failing so: rollouts
were dropped, and the same error on a load or /metrics would restart a healthy server.

The race is made deterministic here by a tiny HTTP/1.1 server (`DroppingServer`) that answers the
first request on every connection and resets the connection (SO_LINGER 0 → RST, what the client
sees when the close wins the race) when a second request arrives on it; `serve_then_drop` serves
the second request first (the answer lost with the connection) — the worst case for a load.

In order (injected fault → what is checked):
  - a request on a connection reset under it → retried once on a new connection, answered;
  - a connection reset on every attempt → ServerUnavailableError (one retry, no loop);
  - a load served, its answer lost with the connection → the retried load's "already loaded"
    is success (loaded once, as asked), but the same answer to a first send stays an error;
  - the client's keep-alive expiry is well below uvicorn's 5 s, so the race is rare to begin with.
"""
from __future__ import annotations

import asyncio
import json
import socket
import struct

import pytest

from artsg_nb.engines import AdapterExistsError, SGLangClient, ServerUnavailableError
from artsg_nb.engines.base import KEEPALIVE_EXPIRY_S

pytestmark = pytest.mark.faults

UVICORN_KEEP_ALIVE_S = 5.0  # uvicorn's default timeout_keep_alive


class DroppingServer:
    """An HTTP/1.1 server keeping connections alive, resetting each one at its second request."""

    def __init__(self, drop_every_request: bool = False, serve_then_drop: bool = False):
        self.drop_every_request, self.serve_then_drop = drop_every_request, serve_then_drop
        self.adapters: dict[str, str] = {}
        self.received: list[str] = []  # paths of the requests that reached the server
        self.resets = 0

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer):
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                path = lines[0].split()[1]
                length = next((int(v) for k, _, v in (ln.partition(": ") for ln in lines[1:])
                               if k.lower() == "content-length"), 0)
                body = json.loads(await reader.readexactly(length)) if length else {}
                self.received.append(path)
                if served >= 1 or self.drop_every_request:
                    if self.serve_then_drop:
                        self._answer(path, body)  # served, but the answer never leaves
                    self._reset(writer)
                    return
                status, payload = self._answer(path, body)
                data = json.dumps(payload).encode()
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, len(data), data))
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()

    def _answer(self, path: str, body: dict) -> tuple[int, object]:
        if path == "/load_lora_adapter":
            if body["lora_name"] in self.adapters:
                return 400, {"success": False, "error_message": f"{body['lora_name']} is already loaded"}
            self.adapters[body["lora_name"]] = body["lora_path"]
            return 200, {"success": True}
        if path == "/v1/models":
            return 200, {"data": [{"id": "base", "root": "/m", "parent": None}]
                         + [{"id": n, "root": p, "parent": "base"} for n, p in self.adapters.items()]}
        return 200, {"text": "ok", "output_ids": [5], "meta_info": {
            "output_token_logprobs": [[-0.5, 5, None]], "prompt_tokens": 2, "finish_reason": {"type": "stop"}}}

    def _reset(self, writer) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.resets += 1
        writer.transport.abort()


def test_request_on_a_connection_reset_under_it_is_retried():
    async def go():
        async with DroppingServer() as server:
            client = SGLangClient(server.url, "base", max_connections=8)  # one pool
            first = await client.generate([1, 2])
            second = await client.generate([1, 2])  # reuses the kept-alive connection: reset
            await client.aclose()
            return server, first, second

    server, first, second = asyncio.run(go())
    assert server.resets == 1 and server.received == ["/generate"] * 3
    assert first[0].output_ids == second[0].output_ids == [5]


def test_a_connection_reset_every_time_is_unavailable_after_one_retry():
    async def go():
        async with DroppingServer(drop_every_request=True) as server:
            client = SGLangClient(server.url, "base", max_connections=8)  # one pool
            with pytest.raises(ServerUnavailableError, match="ReadError|RemoteProtocolError"):
                await client.generate([1, 2])
            await client.aclose()
            return server

    assert asyncio.run(go()).received == ["/generate"] * 2


def test_a_load_served_but_its_answer_lost_is_not_loaded_twice():
    async def go():
        async with DroppingServer(serve_then_drop=True) as server:
            client = SGLangClient(server.url, "base", max_connections=8)  # one pool
            await client.list_adapters()  # the kept-alive connection the load goes out on
            await client.load_adapter("policy-step-1", "/runs/a/policy-step-1")
            assert server.adapters == {"policy-step-1": "/runs/a/policy-step-1"}
            # "already loaded" to a load sent once is a real error (names are immutable)
            fresh = SGLangClient(server.url, "base")
            with pytest.raises(AdapterExistsError):
                await fresh.load_adapter("policy-step-1", "/runs/a/policy-step-1")
            await asyncio.gather(client.aclose(), fresh.aclose())
            return server

    server = asyncio.run(go())
    assert server.received.count("/load_lora_adapter") == 3 and server.resets >= 1


def test_keepalive_expiry_is_well_below_the_servers():
    client = SGLangClient("http://127.0.0.1:1", "base")
    assert client._limits.keepalive_expiry == KEEPALIVE_EXPIRY_S <= UVICORN_KEEP_ALIVE_S / 2
