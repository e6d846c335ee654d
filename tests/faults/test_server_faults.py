"""Faults during a live GRPO run on the CPU engine subprocess (the code path a notebook takes).

One run (`run`, module scope) goes through the faults below in file order; each test injects one
and checks that nothing was lost. The yardstick is an uninterrupted run of the same config and
seed (`reference`): every rollout request is seeded from (seed, step, group, sample, turn), so a
redone or resumed step must reproduce the reference's step (see `assert_same_step`).

In order (injected fault → what is checked):
  - none → the server's --host and its only listening socket are 127.0.0.1;
  - requests without the API key → 401 (the run itself sends the key on every request);
  - adapters the server cannot serve (rank 16 > 8, lm_head, only adapter_model.bin, a directory
    outside run_dir) → refused with the reason and the fix; nothing loaded;
  - SIGKILL of the server's process group once 3 of the 8 rollouts of step 2 are done → server
    restarted, step 2 redone, earlier adapters/optimizer state untouched, rows 1-2 = reference;
  - SIGKILL just before POST /load_lora_adapter of step 3 → restarted; only complete adapter
    directories (the whole safetensors file, under the version's final name) are ever loaded, and
    each is checksummed once its checkpoint is written; row 3 = reference;
  - SIGKILL just before unloading policy-step-3 in step 4 (policy-step-4 already loaded) →
    restarted, policy-step-4 loaded once on the new server (not twice: names are immutable);
  - ENOSPC midway through saving step 5 → AdapterSaveError, no policy-step-5, policy-step-4 still
    served, no row, trainer rolled back; the retried step 5 = reference;
  - SIGKILL during the reload of step 6 with max_restarts used up → ServerLostError with the
    cause, what to do and the log tail; step 6's adapter is on disk but has no row;
  - a fresh GRPORun(resume=True) → resumes after step 5 and its step 6 = reference.
"""
from __future__ import annotations

import asyncio
import errno
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from artsg_nb.engines import AdapterRankError, EngineError, SGLangClient
from artsg_nb.rl.lora import AdapterSaveError, AdapterVersion, load_version
from artsg_nb.run.session import GRPORun, RunConfig, ServerLostError
from scripted_tasks import ADDITION_WITH_SIGNAL

pytestmark = pytest.mark.faults

# The reward is scripted (member i of a group earns i % 2): every step updates and publishes
# policy-step-N, which the faults below are timed on, whatever the model samples.
CFG = RunConfig(task=ADDITION_WITH_SIGNAL, engine="cpu", group_size=4, groups_per_step=2, lora_rank=8, lora_alpha=16,
                seed=7, max_restarts=3, api_key="faults-suite-key", verbose=False)
STEPS = 6  # the reference run's length: the faulted run reaches step 6 through every fault below

# A redone or resumed step against the reference's. Every request is sampled with the same seed,
# so the sampled tokens, hence rewards and token counts, must be equal. What differs is the
# engine's float32 arithmetic: which requests share a decode batch (padding, batch size) and which
# prefixes hit the radix cache depend on timing, and move the server's logprobs by ~1e-7
# (measured: the IS ratio differs by up to 2e-7). A token could flip only if a uniform draw fell
# that close to a CDF boundary (p ~ 1e-6 per token). The server's logprobs enter the loss only
# through the IS correction (off here), and the trainer is deterministic on CPU for equal tokens:
# loss and adapter weights came out bitwise equal; the tolerances leave float32 rounding room.
LOSS_RTOL, WEIGHT_RTOL, WEIGHT_ATOL, IS_RATIO_ATOL = 1e-5, 1e-5, 1e-6, 1e-5


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir):
    """An uninterrupted run of STEPS steps; its server is stopped before the faulted run starts."""
    cfg = replace(CFG, model_path=str(model_dir), run_dir=str(tmp_path_factory.mktemp("reference")))
    with GRPORun(cfg) as run:
        asyncio.run(run.run(STEPS))
    return SimpleNamespace(run_dir=run.run_dir, rows=rows(run.run_dir))


@pytest.fixture(scope="module")
def run(reference, tmp_path_factory, model_dir):
    cfg = replace(CFG, model_path=str(model_dir), run_dir=str(tmp_path_factory.mktemp("faulted")))
    run = GRPORun(cfg).start()
    yield run
    run.stop()


def step(run) -> dict:
    return asyncio.run(run.step())


def served(run) -> list[str]:
    return sorted(asyncio.run(run.client.list_adapters()))


def rows(run_dir: Path) -> dict[int, dict]:
    lines = (Path(run_dir) / "history.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def adapter_weights(run_dir: Path, n: int) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "adapters" / f"policy-step-{n}" / "adapter_model.safetensors"))


def assert_same_step(run_dir: Path, reference, n: int) -> None:
    row, ref = rows(run_dir)[n], reference.rows[n]
    for key in ("reward_mean", "reward_std", "tokens", "completion_tokens", "failed_rollouts"):
        assert row[key] == ref[key], f"step {n}: {key} {row[key]} != {ref[key]} (uninterrupted run)"
    assert row["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL, abs=1e-8), f"step {n}: loss"
    assert row["is_raw_ratio_mean"] == pytest.approx(ref["is_raw_ratio_mean"], abs=IS_RATIO_ATOL), f"step {n}: server logprobs"
    mine, theirs = adapter_weights(run_dir, n), adapter_weights(reference.run_dir, n)
    assert mine.keys() == theirs.keys()
    for key in mine:
        torch.testing.assert_close(mine[key], theirs[key], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=f"step {n}: {key}")


def record_loads(monkeypatch) -> list[str]:
    """Names the server is asked to load; each directory is checked, at that moment, to hold a
    complete adapter under the version's final name (its checksum may still be on the way: the
    checkpoint writer seals a version off the reload's path; `assert_sealed`)."""
    original, names = SGLangClient.load_adapter, []

    async def checked(self, name, path):
        assert Path(path).name == name, f"{path} is not the final folder of {name}"
        load_file(str(Path(path) / "adapter_model.safetensors"))  # raises unless the whole file is there
        names.append(name)
        return await original(self, name, path)

    monkeypatch.setattr(SGLangClient, "load_adapter", checked)
    return names


def assert_sealed(run, names: list[str]) -> None:
    """Every loaded version is checksummed and its checksum matches, once the checkpoint writer is done."""
    run.trainer.wait_for_checkpoint()
    for name in set(names):
        load_version(run.run_dir / "adapters", int(name.rsplit("-", 1)[1]))  # raises unless sealed and intact


# ---- security defaults on the live server --------------------------------------------------------
def test_server_listens_on_loopback_only(run):
    cmd = run.server.record.command
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    sockets = [c for c in psutil.Process(run.server.pid).net_connections(kind="inet")
               if c.status == psutil.CONN_LISTEN]
    assert [(c.laddr.ip, c.laddr.port) for c in sockets] == [("127.0.0.1", run.server.port)]


def test_requests_need_the_api_key(run):
    """Without the key: 401. The run itself sends it on every request (all the steps below)."""
    url, key = run.server.url, CFG.api_key
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.post(f"{url}/generate", json={"input_ids": [1, 2]}).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    cmd = run.server.record.command  # the key goes by environment: not in the record's command
    assert "--api-key" not in cmd and key not in json.dumps(cmd)


def test_adapters_the_server_cannot_serve_are_refused(run, model_dir, faults):
    bad = run.run_dir / "refused"
    before = served(run)
    with pytest.raises(AdapterRankError) as err:  # the server runs --max-lora-rank 8
        asyncio.run(run.client.load_adapter("r16", str(faults.write_lora(bad / "r16", model_dir, 16, ["q_proj"]))))
    assert "LoRA rank 16" in str(err.value) and "exceeds --max-lora-rank 8" in str(err.value)
    assert "Restart the server with --max-lora-rank" in str(err.value)  # the client's fix
    with pytest.raises(AdapterRankError, match=r"targets modules \['lm_head'\]"):
        asyncio.run(run.client.load_adapter("head", str(faults.write_lora(bad / "head", model_dir, 8, ["lm_head"]))))
    pickle_dir = faults.write_lora(bad / "pickle", model_dir, 8, ["q_proj"], pickle_only=True)
    with pytest.raises(EngineError, match=r"only a pickle adapter_model.bin.*safetensors only") as err:
        asyncio.run(run.client.load_adapter("pickle", str(pickle_dir)))
    assert type(err.value) is EngineError and err.value.status == 400
    outside = AdapterVersion("policy-step-99", run.run_dir.parent / "elsewhere", 99, "0" * 64)
    with pytest.raises(ValueError, match="outside the run directory"):
        asyncio.run(run.publisher.publish(outside))  # refused before any request
    assert served(run) == before


# ---- the server dies mid-step ----------------------------------------------------------------------
def test_server_killed_during_rollouts_restarts_and_redoes_the_step(run, reference, monkeypatch, faults):
    step(run)  # step 1, undisturbed
    before = faults.file_digests(run.run_dir / "adapters")  # policy-step-0/1: adapter, optimizer, step, RNG
    attempts = []
    rollouts = run.source.rollouts

    async def counted(n):
        attempts.append(n)
        return await rollouts(n)

    monkeypatch.setattr(run.source, "rollouts", counted)
    # One request at a time: group 2's goes out as group 1's answer comes in, before group 1's
    # episodes take their replies, so the kill at the 3rd reply always finds it unanswered. With
    # both in flight, a loaded machine could have read group 2's answer first: nothing failed.
    monkeypatch.setattr(run.source, "cfg", replace(run.cfg, concurrency=1))
    kill = faults.kill_after_replies(run, 3)  # 3 of the 8 rollouts done, the other group's in flight

    row = step(run)
    assert kill.fired and run.server.alive() and run.server.pid != kill.killed_pid
    assert attempts == [2, 2] and row["step"] == 2 and row["restarts"] == run.restarts == 1
    assert row["failed_rollouts"] == 0 and kill.replies >= 3 + 8  # all 8 played on the new server
    assert faults.history_steps(run.run_dir) == [1, 2]
    after = faults.file_digests(run.run_dir / "adapters")
    assert {k: after.get(k) for k in before} == before
    assert served(run) == ["policy-step-2"]
    assert_same_step(run.run_dir, reference, 1)
    assert_same_step(run.run_dir, reference, 2)


def test_server_killed_during_adapter_reload(run, reference, monkeypatch, faults):
    loads = record_loads(monkeypatch)
    kill = faults.kill_before(SGLangClient, "load_adapter", run, lambda _, name, path: name == "policy-step-3")

    row = step(run)
    assert kill.fired and run.server.alive() and row["restarts"] == run.restarts == 2
    # the new server gets the newest published adapter back, then the one just trained
    assert loads == ["policy-step-3", "policy-step-2", "policy-step-3"]
    assert_sealed(run, loads)
    assert served(run) == ["policy-step-3"] and faults.history_steps(run.run_dir) == [1, 2, 3]
    assert_same_step(run.run_dir, reference, 3)


def test_server_killed_while_unloading_the_previous_adapter(run, reference, monkeypatch, faults):
    loads = record_loads(monkeypatch)
    kill = faults.kill_before(SGLangClient, "unload_adapter", run, lambda _, name: name == "policy-step-3")

    row = step(run)
    assert kill.fired and run.server.alive() and row["restarts"] == run.restarts == 3
    assert loads == ["policy-step-4", "policy-step-4"]  # the old server, then the new one: once each
    assert_sealed(run, loads)
    assert served(run) == ["policy-step-4"] and faults.history_steps(run.run_dir) == [1, 2, 3, 4]
    assert_same_step(run.run_dir, reference, 4)


def test_disk_full_while_saving_keeps_the_served_adapter(run, reference, monkeypatch, faults):
    def disk_full(path):
        Path(path).mkdir(parents=True)
        (Path(path) / "adapter_model.safetensors").write_bytes(b"\0" * 4096)  # half written
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run.trainer, "save_adapter", disk_full)
    with pytest.raises(AdapterSaveError, match="No space left on device.*previous adapter is still served"):
        step(run)
    adapters = run.run_dir / "adapters"
    assert sorted(p.name for p in adapters.iterdir()) == [f"policy-step-{n}" for n in range(5)]
    assert served(run) == ["policy-step-4"] and faults.history_steps(run.run_dir) == [1, 2, 3, 4] and len(run.history) == 4
    # the update was rolled back with its adapter: the trainer is the served policy-step-4
    from peft import get_peft_model_state_dict

    assert run.trainer.step == 4
    trained, saved = get_peft_model_state_dict(run.trainer.model), adapter_weights(run.run_dir, 4)
    assert all(torch.equal(trained[k], saved[k]) for k in saved)

    monkeypatch.undo()  # space again: the same step runs as if nothing happened
    assert step(run)["step"] == 5
    assert_same_step(run.run_dir, reference, 5)


def test_restarts_exhausted_raise_server_lost(run, monkeypatch, faults):
    assert run.restarts == run.cfg.max_restarts == 3
    kill = faults.kill_before(SGLangClient, "load_adapter", run, lambda _, name, path: name == "policy-step-6")
    with pytest.raises(ServerLostError) as err:
        step(run)
    msg = str(err.value)
    assert "cpu server was killed by SIGKILL" in msg and "all 3 restarts allowed by max_restarts are used" in msg
    assert "resume=True" in msg and str(run.run_dir) in msg
    assert f"Last 20 lines of {run.server.log_path}" in msg and run.server.log_tail(20) in msg
    assert not run.server.alive() and run.server.pid == kill.killed_pid  # no further restart
    assert faults.history_steps(run.run_dir) == [1, 2, 3, 4, 5]
    assert (run.run_dir / "adapters" / "policy-step-6" / "trainer" / "trainer_state.json").exists()  # saved, no row
    run.stop()


def test_resume_continues_like_an_uninterrupted_run(run, reference, faults):
    with GRPORun(replace(run.cfg, resume=True)) as resumed:
        # policy-step-6 has no history row: the step did not complete, so it is redone
        assert resumed.trainer.step == 5 and len(resumed.history) == 5
        row = step(resumed)
        assert row["step"] == 6 and row["restarts"] == 0 and served(resumed) == ["policy-step-6"]
    assert faults.history_steps(run.run_dir) == [1, 2, 3, 4, 5, 6]
    assert_same_step(run.run_dir, reference, 6)
