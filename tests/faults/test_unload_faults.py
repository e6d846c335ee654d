"""SGLang 0.5.14's stuck adapter unload (sglang#36894), reproduced on the CPU engine, and what a run
does about it.

The CPU engine's opt-in faults (`--fault`, cpu_engine/engine.py FAULTS) reproduce the two shapes of
the hang seen on the H200: `lora-n-counter` miscounts an adapter's references for every prompt sent
with n > 1 under it, as SGLang's tokenizer manager does, so unloading that adapter waits forever;
`stuck-unload` makes an unload never answer. In both, /health keeps answering 200, so the health
watchdog alone never fires. Checked:
  - the emulation bites: native n > 1 under an adapter, then its unload → no answer, and the
    client's admin timeout turns that into AdminTimeoutError naming the operation within seconds;
  - the client never sends native n > 1 under an adapter to such a server: the same n samples go
    as a warm-up plus one balanced batch, the unload answers at once, and every sample hit the
    prefix cache the warm-up filled;
  - a run on the default schedule ("auto" → "n") completes its steps and reloads on that server
    (before: the first unload hung until the 600 s request timeout);
  - a run whose unload hangs once is restarted within admin_timeout_s, the step redone, nothing
    lost (history 1, 2, 3; the newest adapter served).
Rewards come from a scripted reward (scripted_tasks.ADDITION_WITH_SIGNAL), so every step has a
signal, whatever the tiny model samples.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from artsg_nb.engines import SamplingParams
from artsg_nb.engines.errors import AdminTimeoutError
from artsg_nb.serving.server import ServerConfig, start_server
from artsg_nb.run.session import GRPORun, RunConfig
from lora_files import make_adapter
from scripted_tasks import ADDITION_WITH_SIGNAL

pytestmark = pytest.mark.faults

CFG = RunConfig(task=ADDITION_WITH_SIGNAL, engine="cpu", group_size=3, groups_per_step=2, lora_rank=8, lora_alpha=16, seed=3,
                max_new_tokens=4, verbose=False)


def fault_args(*faults: str, marker=None) -> tuple[str, ...]:
    args = tuple(a for f in faults for a in ("--fault", f))
    return args + (("--fault-marker", str(marker)) if marker else ())


def run_steps(run: GRPORun, n: int, timeout_s: float = 120.0) -> list[dict]:
    async def steps():
        return [await run.step() for _ in range(n)]
    return asyncio.run(asyncio.wait_for(steps(), timeout=timeout_s))


@pytest.fixture
def counter_server(tmp_path, tiny_model_dir):
    cfg = ServerConfig(engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path), max_lora_rank=8,
                       extra_args=fault_args("lora-n-counter"), admin_timeout_s=3.0)
    server = start_server(cfg)
    yield server
    server.stop()


def _adapter(tmp_path, tiny_model_dir) -> SimpleNamespace:
    """An adapter with non-zero B on disk, under a run-like name (tests/lora_files.py builds it)."""
    return SimpleNamespace(name="policy-step-1", path=make_adapter(tiny_model_dir, tmp_path / "policy-step-1"))


def test_native_n_under_an_adapter_wedges_the_unload(counter_server, tmp_path, tiny_model_dir):
    """The fault is real: forced native n > 1, the unload never answers, AdminTimeoutError says so."""
    version = _adapter(tmp_path, tiny_model_dir)
    client = counter_server.client()
    client.lora_n_problem = lambda info: None  # pretend the server is safe: native n goes out

    async def go():
        await client.load_adapter(version.name, str(version.path))
        gens = await client.generate([1, 5, 9, 4], SamplingParams(max_new_tokens=2, n=3), adapter=version.name)
        assert len(gens) == 3
        t0 = time.monotonic()
        with pytest.raises(AdminTimeoutError, match=f"unload adapter {version.name} within 3 s") as err:
            await client.unload_adapter(version.name)
        assert err.value.operation == f"unload adapter {version.name}"
        return time.monotonic() - t0
    assert asyncio.run(go()) < 10
    assert counter_server.alive() and "Start unload Lora adapter" in counter_server.log_tail(50)


def test_n_samples_go_balanced_and_the_unload_answers(counter_server, tmp_path, tiny_model_dir):
    version = _adapter(tmp_path, tiny_model_dir)
    client = counter_server.client()

    async def go():
        assert "sglang#36894" in await client.native_n_problem()
        await client.load_adapter(version.name, str(version.path))
        prompt = list(range(3, 40))
        gens = await client.generate(prompt, SamplingParams(max_new_tokens=3, n=4, seed=7, ignore_eos=True),
                                     adapter=version.name)
        await asyncio.wait_for(client.unload_adapter(version.name), timeout=5)
        return gens
    gens = asyncio.run(go())
    assert len(gens) == 4 and all(len(g.output_ids) == 3 for g in gens)
    # The warm-up cached the prompt: each of the n samples reused it (all but the last token).
    assert all(g.cached_tokens >= 36 for g in gens), [g.cached_tokens for g in gens]


def test_default_schedule_runs_on_a_server_with_the_counter_bug(tmp_path, tiny_model_dir):
    cfg = replace(CFG, model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"),
                  server_args=fault_args("lora-n-counter"))
    with GRPORun(cfg) as run:
        rows = run_steps(run, 3)
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert not any(r.get("update_skipped") for r in rows)
        assert run.restarts == 0 and run.adapter == "policy-step-3"
        assert "fault: unload" not in run.server.log_tail(400)


def test_a_stuck_unload_restarts_the_server_and_redoes_the_step(tmp_path, tiny_model_dir):
    cfg = replace(CFG, model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"), admin_timeout_s=4.0,
                  server_args=fault_args("stuck-unload", marker=tmp_path / "fired"))
    with GRPORun(cfg) as run:
        t0 = time.monotonic()
        rows = run_steps(run, 3)
        elapsed_s = time.monotonic() - t0
        assert (tmp_path / "fired").exists()  # the unload did hang once
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert list(run.history.df["step"]) == [1, 2, 3]
        assert run.restarts == 1 and run.adapter == "policy-step-3"
        assert elapsed_s < 4.0 + 60  # the admin timeout, one CPU engine restart, three small steps
