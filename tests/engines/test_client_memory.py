"""Releasing the server's memory around training, the way a one-GPU notebook runs it: one GRPORun
with release_memory=True on the CPU engine (started with --enable-memory-saver) serves every test.

What SGLang does, with file:line, is in artsg_nb/client_memory.py; the request shapes against the
recorded SGLang bodies are in test_client_contract.py; the answers without --enable-memory-saver
in cpu_engine/test_cpu_engine.py.
"""
import asyncio
import traceback
import weakref

import httpx
import pytest

from artsg_nb.engines import EngineError, MemorySaverError, SamplingParams
from artsg_nb.run.config import resolve_release as _resolve_release
from artsg_nb.run.session import GRPORun, RunConfig

PROMPT = [5, 17, 33, 101, 250, 7, 9, 64, 300, 12, 45, 88]


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    cfg = RunConfig(task="addition", engine="cpu", model_path=str(tiny_model_dir),
                    run_dir=str(tmp_path_factory.mktemp("memory") / "run"), group_size=2, groups_per_step=2,
                    verbose=False, release_memory=True)
    with GRPORun(cfg) as run:
        yield run


def generate_status(run, route="/generate") -> int:
    """Status of one raw request (sync, so it also works from inside trainer.train_step)."""
    body = ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}} if route == "/generate" else
            {"model": run.server.config.model_path, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    return httpx.post(run.server.url + route, json=body, timeout=60, headers=auth(run)).status_code


def auth(run) -> dict:
    """The server's key (every server requires one by default)."""
    return {"Authorization": f"Bearer {run.server.api_key}"}


def test_steps_release_while_training_and_record_the_times(run, monkeypatch):
    seen = []
    train_step = run.trainer.train_step

    def spying(groups):  # what the server does while the trainer runs
        seen.append((generate_status(run), run.client.released_tags))
        return train_step(groups)

    monkeypatch.setattr(run.trainer, "train_step", spying)
    row = asyncio.run(run.step())
    assert seen == [(400, ("kv_cache", "cuda_graph"))], "the server should refuse to generate while released"
    assert row["release_s"] > 0 and row["resume_s"] > 0 and row["failed_rollouts"] == 0
    df = run.history.df
    assert df["release_s"].notna().all() and df["resume_s"].notna().all()
    assert "release" in run.history.format_row(row) and "resume" in run.history.format_row(row)
    assert run.client.released_tags == () and run.plan.release_server_memory and run.server.config.enable_memory_saver
    groups, _ = asyncio.run(run.source.rollouts(2))  # the next step's rollouts, on the resumed memory
    assert all(t.error is None and t.reward is not None for g in groups for t in g.trajectories)


def test_release_waits_until_running_requests_finish(run):
    async def scenario():
        client = run.client
        started = asyncio.Event()
        long = asyncio.create_task(client.generate(  # ~0.4 s of decoding on 2 cores; the release follows in ms
            PROMPT, SamplingParams(max_new_tokens=1000, temperature=0.0, ignore_eos=True), on_first_token=started))
        await started.wait()  # running (the engine's refusal of a raw release: test_cpu_engine.py)
        assert not long.done(), "the request ended before the release was asked: nothing to wait for"
        try:
            await client.release_memory(idle_timeout_s=60)  # sent while running, the engine would answer 400
        finally:
            gens = await asyncio.wait_for(long, 30)  # the server finished it; its last chunk may still be in flight
            await client.resume_memory()
        assert len(gens[0].output_ids) == 1000, "the release cut the running request short"

    asyncio.run(scenario())


def test_refusals_leave_the_server_serving(run):
    async def scenario():
        client = run.client
        with pytest.raises(MemorySaverError, match="--enable-weights-cpu-backup"):
            await client.release_memory(("kv_cache", "weights"))
        assert await client.resume_memory() == 0.0  # nothing released: nothing sent
        await client.release_memory()
        with pytest.raises(EngineError, match="already released"):
            await client.release_memory()
        assert generate_status(run, "/v1/chat/completions") == 400
        await client.resume_memory()
        assert len(await client.generate(PROMPT, SamplingParams(max_new_tokens=3))) == 1

    asyncio.run(scenario())


def test_failed_training_takes_the_memory_back(run, monkeypatch):
    def out_of_memory(groups):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(run.trainer, "train_step", out_of_memory)
    step = run.trainer.step
    with pytest.raises(RuntimeError, match="simulated"):
        asyncio.run(run.step())
    assert run.client.released_tags == () and generate_status(run) == 200
    assert run.trainer.step == step and len(run.history) == 1  # nothing recorded; step() can run again


def test_a_failed_updates_tensors_are_freed_before_the_server_takes_its_memory_back(run, monkeypatch):
    """At 14B on an H100 the failed update's activations, still held by its traceback's frames, left
    the resuming server no memory: it died, and its restart too. They are gone before the resume."""
    class Activations:  # stands for the update's tensors
        pass

    held = []

    def out_of_memory(groups):
        activations = Activations()  # noqa: F841 — a local of the failing frame, as the update's tensors are
        held.append(weakref.ref(activations))
        raise RuntimeError("CUDA out of memory (simulated)")

    alive_at_resume = []
    release_cached = run.trainer.release_cached_memory

    def spying_release():
        alive_at_resume.append(held[-1]() is not None)
        release_cached()

    monkeypatch.setattr(run.trainer, "train_step", out_of_memory)
    monkeypatch.setattr(run.trainer, "release_cached_memory", spying_release)
    with pytest.raises(RuntimeError, match="simulated") as raised:
        asyncio.run(run.step())
    assert alive_at_resume == [False], "the failed update's tensors were still held when the server resumed"
    assert "out_of_memory" in "".join(traceback.format_tb(raised.value.__traceback__)), "the traceback keeps its lines"
    assert run.client.released_tags == () and generate_status(run) == 200


def test_release_memory_option():
    cfg = RunConfig(release_memory="auto")
    assert _resolve_release(cfg, "colocated").on and not _resolve_release(cfg, "cpu").on
    assert not _resolve_release(cfg, "split").on
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        _resolve_release(RunConfig(release_memory="yes"), "colocated")
    with pytest.raises(ValueError, match="kv_cache"):
        _resolve_release(RunConfig(release_memory=True, release_tags=("kvcache",)), "colocated")
