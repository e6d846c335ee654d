"""Single-prompt /generate requests made in one event-loop tick, sent as one batch request.

Why: a GRPO step's rollouts are many small requests made at the same moment — every group's
warm-up, then every group's samples; every episode's next turn. Sent one by one, each pays its own
HTTP round trip, and the server's scheduler meets them as they trickle in. Measured on an H100
(SmolLM2-135M, 16 groups x 8 samples, 8 new tokens, 2026-12-06,
benchmarks/results/20261206-h100-batch-shapes-smollm2-2c9ada6.json): the client's per-group
requests (32 of them) took 0.240 s, the same work as two batch requests 0.161 s.

What it does: `submit(payload)` queues one single-prompt /generate payload and returns a future of
its answer (one sample object). When the tick ends, the queued payloads that agree on everything
but their prompt and sampling parameters (the adapter, whether logprobs are returned) go out as
one request: `input_ids` and `sampling_params` become per-prompt lists and the answer list comes
back in order. A payload alone goes out unchanged. A batch the server answers with an error status
is sent again one payload at a time, so each refusal reaches the request that caused it; when it
was a refusal (4xx, or an answer that is no list of one object per prompt) and every one of them
is then answered, the batch shape itself was refused and batching stops for this batcher (a server
that takes no per-prompt lists, such as sglang-router 0.3, is asked one request at a time from
then on). A batch that gets no answer (the server is gone, a timeout) fails each of its requests
with that error. A caller cancelled before the flush is not sent; a batch whose callers are all
cancelled is cancelled (its connection drops, and the server aborts the work).

What it does not do: streamed requests, n > 1 (the caller sends those itself), or decide whether a
server takes batches (engines/sglang.py does).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable

from .errors import EngineError, ServerUnavailableError

log = logging.getLogger(__name__)

PER_PROMPT = ("input_ids", "sampling_params")
"""The payload fields a batch request takes as one list entry per prompt."""


def batch_payload(payloads: list[dict]) -> dict:
    """Single-prompt payloads that agree on everything but PER_PROMPT, as one batch request's
    payload (answered by a list, in the same order)."""
    return {**payloads[0], **{k: [p[k] for p in payloads] for k in PER_PROMPT}}


class GenerateBatcher:
    """Coalesces the single-prompt payloads submitted in one event-loop tick (module docstring).
    `send(payload)` posts one /generate payload and returns its parsed answer. Bound to the loop it
    was made in."""

    def __init__(self, send: Callable[[dict], Awaitable[Any]], max_batch: int = 1024):
        self.send, self.max_batch = send, max_batch
        self.loop = asyncio.get_running_loop()
        self.enabled = True
        self._queued: dict[str, list[tuple[dict, asyncio.Future]]] = {}
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task] = set()  # the loop holds tasks weakly: these hold them

    def submit(self, payload: dict) -> asyncio.Future:
        """Queue one single-prompt payload; the future resolves to its answer object."""
        future = self.loop.create_future()
        if not self.enabled:
            self._spawn(self._one(payload, future), [future])
            return future
        key = json.dumps({k: v for k, v in payload.items() if k not in PER_PROMPT}, sort_keys=True, default=str)
        self._queued.setdefault(key, []).append((payload, future))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)  # after every callback already ready in this tick
        return future

    def _flush(self) -> None:
        self._flush_scheduled = False
        queued, self._queued = self._queued, {}
        for items in queued.values():
            items = [(p, f) for p, f in items if not f.done()]  # a caller cancelled before the send
            for i in range(0, len(items), self.max_batch):
                chunk = items[i:i + self.max_batch]
                self._spawn(self._batch(chunk), [f for _, f in chunk])

    def _spawn(self, coro, futures: list[asyncio.Future]) -> None:
        """Run `coro` (the request of `futures`) as a task of its own, cancelled once every one of
        its callers is: the connection drops and the server aborts the work, as it does for a
        cancelled single request."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_retrieve)

        def caller_done(_: asyncio.Future) -> None:
            if not task.done() and all(f.cancelled() for f in futures):
                task.cancel()
        for future in futures:
            future.add_done_callback(caller_done)

    async def _batch(self, items: list[tuple[dict, asyncio.Future]]) -> None:
        if len(items) == 1:
            await self._one(*items[0])
            return
        payload = batch_payload([p for p, _ in items])
        try:
            answers = await self.send(payload)
            if not isinstance(answers, list) or len(answers) != len(items):
                raise EngineError(f"a batch of {len(items)} prompts was answered with "
                                  f"{len(answers) if isinstance(answers, list) else 'one object'}", body=answers)
        except ServerUnavailableError as e:
            _fail([f for _, f in items], e)
            return
        except EngineError as e:  # the server answered, but not this batch: each request on its own
            refusal = e.status is None or 400 <= e.status < 500  # not a server error (5xx)
            was_enabled = self.enabled
            self.enabled = not refusal and was_enabled  # what callers submit meanwhile goes alone
            sent = await asyncio.gather(*(self._one(p, f) for p, f in items))
            if refusal and was_enabled:
                if all(sent):  # no prompt of it was refused on its own: the shape itself was
                    log.info("/generate refused a batch of %d prompts that it takes one by one (%s); sending "
                             "requests one at a time from now on", len(items), e)
                else:  # a prompt of it was refused: batching goes on
                    self.enabled = True
            return
        except BaseException as e:
            _fail([f for _, f in items], e)
            raise
        for (_, future), answer in zip(items, answers):
            if not future.done():
                future.set_result(answer)

    async def _one(self, payload: dict, future: asyncio.Future) -> bool:
        """Send one payload alone; whether it was answered."""
        try:
            answer = await self.send(payload)
        except BaseException as e:
            _fail([future], e)
            if not isinstance(e, Exception):
                raise
            return False
        if not future.done():
            future.set_result(answer)
        return True


def _fail(futures: list[asyncio.Future], error: BaseException) -> None:
    for future in futures:
        if not future.done():
            if isinstance(error, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(error)


def _retrieve(task: asyncio.Task) -> None:
    """A batch task's own exception (cancellation at shutdown) is not an unhandled error: its
    requests' futures carry what failed."""
    if not task.cancelled():
        task.exception()
