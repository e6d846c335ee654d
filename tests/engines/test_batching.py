"""Single-prompt /generate requests made in one event-loop tick go to SGLang as one batch request
(engines/batching.py): which requests go out, and that every caller gets its own answer back.

Checked on an httpx MockTransport that records each /generate body and answers each prompt with
tokens derived from it, so a sample handed to the wrong caller shows.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from artsg_nb import engines
from artsg_nb.engines import EngineError, SamplingParams
from artsg_nb.engines.errors import ServerUnavailableError
from waiting import wait_until_async


def answer(prompt: list[int], params: dict) -> dict:
    out = [prompt[0] + 1000, params.get("sampling_seed", 0) or 0][:max(0, params.get("max_new_tokens", 2))]
    return {"text": "", "output_ids": out,
            "meta_info": {"prompt_tokens": len(prompt), "cached_tokens": 0, "finish_reason": {"type": "length"},
                          "output_token_logprobs": [[-0.5, t, None] for t in out]}}


def recording_client(refuse_lists: bool = False, bad_prompt: int | None = None, engine: str = "sglang"):
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/server_info", "/get_server_info"):
            return httpx.Response(200, json={"version": "0.5.14"})
        body = json.loads(request.content)
        bodies.append(body)
        ids, params = body["input_ids"], body["sampling_params"]
        batch = bool(ids) and isinstance(ids[0], list)
        prompts, plist = (ids, params) if batch else ([ids], [params])
        if (batch and refuse_lists) or any(p[0] == bad_prompt for p in prompts):
            return httpx.Response(400, json={"error": {"message": "refused"}})
        answers = [answer(p, sp) for p, sp in zip(prompts, plist)]
        return httpx.Response(200, json=answers if batch else answers[0])

    client = engines.make_client(engine, "http://test", "base", transport=httpx.MockTransport(handler))
    return client, bodies


async def _groups(client, prompts, n, adapter="a"):
    return await asyncio.gather(*(client.generate(p, SamplingParams(max_new_tokens=2, n=n, seed=10 * i), adapter=adapter)
                                  for i, p in enumerate(prompts)))


def test_groups_of_one_tick_go_as_one_warm_up_batch_and_one_sample_batch():
    client, bodies = recording_client()
    prompts = [[1, 2], [3, 4, 5], [6]]
    results = asyncio.run(_groups(client, prompts, n=3))
    warm_up, samples = bodies  # 2 requests, where one per group each made 6
    assert warm_up["input_ids"] == prompts and warm_up["lora_path"] == "a" and not warm_up["return_logprob"]
    assert all(p["max_new_tokens"] == 0 for p in warm_up["sampling_params"])
    assert samples["input_ids"] == [p for p in prompts for _ in range(3)] and samples["return_logprob"]
    assert samples["lora_path"] == "a"
    for i, (prompt, gens) in enumerate(zip(prompts, results)):  # each caller got its own prompt's samples
        assert [g.output_ids for g in gens] == [[prompt[0] + 1000, 10 * i + j] for j in range(3)]


def test_plain_single_requests_go_alone():
    """An episode's next turn (n = 1) must not wait for other episodes' longer replies in a batch."""
    client, bodies = recording_client()
    out = asyncio.run(_groups(client, [[1], [2], [3]], n=1))
    assert sorted(json.dumps(b["input_ids"]) for b in bodies) == ["[1]", "[2]", "[3]"]
    assert [g[0].output_ids[0] for g in out] == [1001, 1002, 1003]


def test_requests_that_differ_in_more_than_their_prompt_are_not_mixed():
    client, bodies = recording_client()

    async def run():
        return await asyncio.gather(*(client.generate([p], SamplingParams(max_new_tokens=2, n=2), adapter=a)
                                      for p, a in ((1, "a"), (2, "b"), (3, "a"))))
    out = asyncio.run(run())
    warm_ups = {json.dumps(b["input_ids"]): b["lora_path"] for b in bodies if not b["return_logprob"]}
    samples = {json.dumps(b["input_ids"]): b["lora_path"] for b in bodies if b["return_logprob"]}
    assert warm_ups == {"[[1], [3]]": "a", "[2]": "b"}
    assert samples == {"[[1], [1], [3], [3]]": "a", "[[2], [2]]": "b"}
    assert [[g.output_ids[0] for g in gens] for gens in out] == [[1001] * 2, [1002] * 2, [1003] * 2]


def test_a_server_that_refuses_batches_gets_single_requests_from_then_on():
    client, bodies = recording_client(refuse_lists=True)
    out = asyncio.run(_groups(client, [[1], [2]], n=2))
    shapes = [json.dumps(b["input_ids"]) for b in bodies]
    assert shapes[0] == "[[1], [2]]"  # the warm-up batch, refused
    assert sorted(shapes[1:]) == ["[1]", "[1]", "[1]", "[2]", "[2]", "[2]"]  # then every request alone
    assert [[g.output_ids[0] for g in gens] for gens in out] == [[1001] * 2, [1002] * 2]


def test_a_refused_prompt_fails_only_its_own_request_and_batching_goes_on():
    client, bodies = recording_client(bad_prompt=2)

    async def run():
        first = await asyncio.gather(*(client.generate(p, SamplingParams(max_new_tokens=2, n=2), adapter="a")
                                       for p in ([1], [2], [3])), return_exceptions=True)
        second = await _groups(client, [[4], [5]], n=2)
        return first, second
    first, second = asyncio.run(run())
    assert isinstance(first[1], EngineError) and first[1].status == 400
    assert [g.output_ids[0] for g in first[0]] == [1001] * 2 and [g.output_ids[0] for g in first[2]] == [1003] * 2
    assert json.dumps(bodies[-1]["input_ids"]) == "[[4], [4], [5], [5]]"  # still batched
    assert [[g.output_ids[0] for g in gens] for gens in second] == [[1004] * 2, [1005] * 2]


def test_a_server_gone_fails_every_request_of_the_batch_with_its_error():
    def handler(request):
        raise httpx.ConnectError("connection refused", request=request)
    client = engines.make_client("sglang", "http://test", "base", transport=httpx.MockTransport(handler))
    client._n_problem = "the n > 1 reference bug"  # as /server_info would have said

    async def run():
        return await asyncio.gather(*(client.generate([i], SamplingParams(max_new_tokens=2, n=2), adapter="a")
                                      for i in (1, 2, 3)), return_exceptions=True)
    out = asyncio.run(run())
    assert all(isinstance(e, ServerUnavailableError) for e in out)


def slow_client(delay_s: float):
    """A server that answers each /generate after `delay_s`; `log` records requests started and
    finished (a cancelled request never finishes: its connection dropped)."""
    log = {"started": [], "finished": []}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/server_info", "/get_server_info"):
            return httpx.Response(200, json={"version": "0.5.14"})
        body = json.loads(request.content)
        log["started"].append(body["input_ids"])
        await asyncio.sleep(delay_s)
        log["finished"].append(body["input_ids"])
        ids = body["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        answers = [answer(p, sp) for p, sp in zip(ids if batch else [ids],
                                                  body["sampling_params"] if batch else [body["sampling_params"]])]
        return httpx.Response(200, json=answers if batch else answers[0])

    client = engines.make_client("sglang", "http://test", "base", transport=httpx.MockTransport(handler))
    client._n_problem = "the n > 1 reference bug"
    return client, log


def test_a_batch_whose_callers_are_all_cancelled_is_cancelled():
    client, log = slow_client(5.0)

    async def run():
        calls = [asyncio.ensure_future(client.generate([i], SamplingParams(max_new_tokens=2, n=2), adapter="a"))
                 for i in (1, 2, 3)]
        await wait_until_async(lambda: log["started"])  # the warm-up batch is in flight
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        # the batch's task ends on its own, before the loop's end would cancel what is left
        await wait_until_async(lambda: not client._batcher._tasks, timeout_s=5)
        return len(client._batcher._tasks)
    pending = asyncio.run(asyncio.wait_for(run(), 10))
    assert log["started"] == [[[1], [2], [3]]] and log["finished"] == []  # dropped, not run to its end
    assert pending == 0 and client.in_flight == 0


def test_a_cancelled_caller_leaves_the_others_their_answers_and_is_not_sent():
    client, log = slow_client(0.1)

    async def run():
        calls = [asyncio.ensure_future(client.generate([i], SamplingParams(max_new_tokens=2, n=2), adapter="a"))
                 for i in (1, 2, 3)]
        await asyncio.sleep(0)  # submitted? not yet: each call first runs to its warm-up
        calls[1].cancel()
        return await asyncio.gather(*calls, return_exceptions=True)
    out = asyncio.run(asyncio.wait_for(run(), 10))
    assert isinstance(out[1], asyncio.CancelledError)
    assert [g.output_ids[0] for g in out[0]] == [1001] * 2 and [g.output_ids[0] for g in out[2]] == [1003] * 2
    assert all([2] not in ids for ids in log["started"] if isinstance(ids[0], list))


@pytest.mark.parametrize("engine", ["sglang", "cpu"])
def test_without_batching_every_request_goes_alone(engine):
    client, bodies = recording_client(engine=engine)
    client.batch_requests = False
    client._n_problem = "the n > 1 reference bug"
    asyncio.run(_groups(client, [[1], [2]], n=2))
    assert all(not (b["input_ids"] and isinstance(b["input_ids"][0], list) and len({json.dumps(x) for x in b["input_ids"]}) > 1)
               for b in bodies)  # never two prompts in one request
