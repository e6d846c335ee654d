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


def test_single_requests_of_one_tick_are_one_batch_and_other_ticks_their_own():
    client, bodies = recording_client()

    async def run():
        first = await _groups(client, [[1], [2], [3], [4]], n=1)
        second = await _groups(client, [[5]], n=1)
        return first, second
    first, second = asyncio.run(run())
    assert [b["input_ids"] for b in bodies] == [[[1], [2], [3], [4]], [5]]  # a lone request goes as it is
    assert [g[0].output_ids[0] for g in first] == [1001, 1002, 1003, 1004] and second[0][0].output_ids[0] == 1005


def test_requests_that_differ_in_more_than_their_prompt_are_not_mixed():
    client, bodies = recording_client()

    async def run():
        return await asyncio.gather(client.generate([1], SamplingParams(max_new_tokens=2), adapter="a"),
                                    client.generate([2], SamplingParams(max_new_tokens=2), adapter="b"),
                                    client.generate([3], SamplingParams(max_new_tokens=2), adapter="a"))
    out = asyncio.run(run())
    assert sorted(json.dumps(b["input_ids"]) for b in bodies) == ["[2]", "[[1], [3]]"]
    assert {json.dumps(b["input_ids"]): b["lora_path"] for b in bodies} == {"[[1], [3]]": "a", "[2]": "b"}
    assert [g[0].output_ids[0] for g in out] == [1001, 1002, 1003]


def test_a_server_that_refuses_batches_gets_single_requests_from_then_on():
    client, bodies = recording_client(refuse_lists=True)

    async def run():
        first = await _groups(client, [[1], [2]], n=1)
        second = await _groups(client, [[3], [4]], n=1)
        return first, second
    first, second = asyncio.run(run())
    assert [b["input_ids"] for b in bodies] == [[[1], [2]], [1], [2], [3], [4]]
    assert [g[0].output_ids[0] for g in first + second] == [1001, 1002, 1003, 1004]


def test_a_refused_prompt_fails_only_its_own_request_and_batching_goes_on():
    client, bodies = recording_client(bad_prompt=2)

    async def run():
        first = await asyncio.gather(*(client.generate(p, SamplingParams(max_new_tokens=2), adapter="a")
                                       for p in ([1], [2], [3])), return_exceptions=True)
        second = await _groups(client, [[4], [5]], n=1)
        return first, second
    first, second = asyncio.run(run())
    assert isinstance(first[1], EngineError) and first[1].status == 400
    assert first[0][0].output_ids[0] == 1001 and first[2][0].output_ids[0] == 1003
    assert [b["input_ids"] for b in bodies][-1] == [[4], [5]]  # still batched
    assert [g[0].output_ids[0] for g in second] == [1004, 1005]


def test_a_server_gone_fails_every_request_of_the_batch_with_its_error():
    def handler(request):
        raise httpx.ConnectError("connection refused", request=request)
    client = engines.make_client("sglang", "http://test", "base", transport=httpx.MockTransport(handler))

    async def run():
        return await asyncio.gather(*(client.generate([i], SamplingParams(max_new_tokens=2)) for i in (1, 2, 3)),
                                    return_exceptions=True)
    out = asyncio.run(run())
    assert all(isinstance(e, ServerUnavailableError) for e in out)


@pytest.mark.parametrize("engine", ["sglang", "cpu"])
def test_without_batching_every_request_goes_alone(engine):
    client, bodies = recording_client(engine=engine)
    client.batch_requests = False
    asyncio.run(_groups(client, [[1], [2]], n=1))
    assert [b["input_ids"] for b in bodies] == [[1], [2]]
