"""Faults of the GRPO loop the server-death suite does not try: a second death during the restart,
deaths and failures after the update, a hung server, crash leftovers and corrupt checkpoints.

One run on the CPU engine (`run`, module scope, small steps) goes through the faults below in
file order; each injects one and checks that nothing was lost — no step trained on rollouts of
another policy, no gap in history, no error that does not say which file and what to do.

In order (injected fault → what is checked):
  - half-written `.tmp-policy-step-*` directories left by a crash (one old, one being written)
    → the old one is removed at start, the fresh one left alone;
  - SIGKILL during the rollouts of step 1, then SIGKILL again while the restart republishes
    policy-step-0 → a second restart (not an error: restarts are left), policy-step-0 loaded on
    it, and every rollout of step 1 sampled under policy-step-0 (before: the publisher forgot
    the version, and the step was trained on base-model samples, recorded as a normal row; with
    policy-step-0 = base the samples agree, so the adapter of each request is what is checked);
  - the session forgets what the server should serve → no rollout runs, AdapterMismatchError;
  - SIGKILL while the served adapter of step 2 is verified (`score`) → restart, verified again,
    row 2 written (before: the error escaped and history went on [1, 3]);
  - the history write of step 3 fails after its adapter was saved → the error goes up, and the
    next step() writes row 3 before step 4 (before: [1, 2, 4]);
  - SIGSTOP of the server mid-rollout of step 5 → the watchdog kills it after hang_timeout_s,
    the step is redone on a restarted server within seconds (before: blocked for the 600 s
    request timeout);
  - a checkpoint whose optimizer.safetensors is garbage ("header too large") or whose
    trainer_state.json is not UTF-8 → CheckpointError naming the file and what to do, and the
    trainer untouched.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from artsg_nb.engines import SGLangClient
from artsg_nb.rl.lora import AdapterMismatchError
from artsg_nb.run.session import GRPORun, RunConfig
from artsg_nb.rl.trainer import CheckpointError
from scripted_tasks import ADDITION_WITH_SIGNAL

pytestmark = pytest.mark.faults

# The reward is scripted (member i of a group earns i % 2): every step updates and publishes
# policy-step-N, which the faults below are timed on, whatever the model samples.
CFG = RunConfig(task=ADDITION_WITH_SIGNAL, engine="cpu", group_size=2, groups_per_step=2, lora_rank=8, lora_alpha=16,
                seed=11, max_restarts=10, hang_timeout_s=3.0, verbose=False, verify_every=1)
STALE, FRESH = ".tmp-policy-step-3-0dead000", ".tmp-policy-step-4-0live000"


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir, fault_engine):
    run_dir = tmp_path_factory.mktemp("loop")
    for name in (STALE, FRESH):  # what a save killed midway leaves behind (a crash of an earlier kernel)
        (run_dir / "adapters" / name).mkdir(parents=True)
        (run_dir / "adapters" / name / "adapter_model.safetensors").write_bytes(b"\0" * 1024)
    old = time.time() - 3600
    for p in (run_dir / "adapters" / STALE, run_dir / "adapters" / STALE / "adapter_model.safetensors"):
        os.utime(p, (old, old))
    run = GRPORun(replace(CFG, engine=fault_engine, model_path=str(tiny_model_dir), run_dir=str(run_dir))).start()
    yield run
    run.stop()


def step(run) -> dict:
    """One step, bounded by what it may take: a step here can restart the server twice, and a
    real SGLang start takes 50-120 s (CUDA graphs, kernels) where the CPU engine's takes ~5."""
    return asyncio.run(asyncio.wait_for(run.step(), timeout=120 if run.cfg.engine == "cpu" else 420))


def record_generate(monkeypatch) -> list:
    """The adapter of every generate request, in order."""
    original, adapters = SGLangClient.generate, []

    async def recorded(self, input_ids, params=None, adapter=None, **kwargs):
        adapters.append(adapter)
        return await original(self, input_ids, params, adapter=adapter, **kwargs)

    monkeypatch.setattr(SGLangClient, "generate", recorded)
    return adapters


def test_stale_half_written_adapters_are_removed_at_start(run):
    left = sorted(p.name for p in (run.run_dir / "adapters").glob(".tmp-*"))
    assert left == [FRESH]  # the one being written (recent) is not touched


def test_second_death_during_the_restart_keeps_the_adapter(run, monkeypatch, faults):
    adapters = record_generate(monkeypatch)
    rollout_kill = faults.kill_after_replies(run, 1)
    # load 1 is step 1's first publish of policy-step-0; load 2 the republish after the first death
    republish_kill = faults.kill_before(SGLangClient, "load_adapter", run, lambda n, name, path: n == 2)

    row = step(run)
    assert rollout_kill.fired and republish_kill.fired and run.server.alive()
    assert row["step"] == 1 and row["restarts"] == run.restarts == 2  # the second death took a restart too
    assert [c[0] for c in republish_kill.calls] == ["policy-step-0"] * 3 + ["policy-step-1"]
    assert adapters and set(adapters) == {"policy-step-0"}, "step 1 sampled from another policy than policy-step-0"
    assert faults.history_steps(run.run_dir) == [1]


def test_rollouts_never_run_under_another_adapter_than_the_trainers(run, monkeypatch):
    adapters = record_generate(monkeypatch)
    served = run.publisher.served
    monkeypatch.setattr(run.publisher, "served", [])  # the session lost track of the served version
    with pytest.raises(AdapterMismatchError, match="expects rollouts from policy-step-1.*no rollout was run"):
        step(run)
    assert adapters == [] and run.trainer.step == 1
    run.publisher.served = served


def test_server_killed_while_verifying_the_reload(run, faults):
    restarts = run.restarts
    kill = faults.kill_before(SGLangClient, "score", run, lambda n, *args: n == 1)
    row = step(run)
    assert kill.fired and run.server.alive() and row["step"] == 2 and run.restarts == restarts + 1
    assert len(kill.calls) == 2 and row["probe_mad"] is not None  # verified again on the new server
    assert faults.history_steps(run.run_dir) == [1, 2]


def test_failed_history_write_leaves_no_gap(run, monkeypatch, faults):
    append = run.history.append

    def disk_full(row):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run.history, "append", disk_full)
    with pytest.raises(OSError, match="No space left"):
        step(run)  # step 3 trained, saved and served; its row not written
    assert faults.history_steps(run.run_dir) == [1, 2] and run.trainer.step == 3
    monkeypatch.setattr(run.history, "append", append)
    row = step(run)
    assert row["step"] == 4 and faults.history_steps(run.run_dir) == [1, 2, 3, 4]


def test_hung_server_is_killed_and_the_step_redone(run, monkeypatch, fault_engine):
    restarts, stopped = run.restarts, {}
    make_env = run.task.make_env

    def factory(seed):  # the first reply of the step SIGSTOPs the server: it hangs, alive
        env = make_env(seed)
        reply_to = env.step

        def step_env(reply):
            if not stopped:
                stopped["pid"] = run.server.pid
                os.killpg(run.server.pid, signal.SIGSTOP)
            return reply_to(reply)

        env.step = step_env
        return env

    monkeypatch.setattr(run, "task", replace(run.task, factory=factory))
    t0 = time.monotonic()
    row = step(run)
    took = time.monotonic() - t0
    assert stopped and run.server.pid != stopped["pid"] and run.server.alive()
    assert run.watchdog.fired == 1 and row["step"] == 5 and run.restarts == restarts + 1
    restart_s = 60 if fault_engine == "cpu" else 300  # a GPU server's start: CUDA graphs, kernels
    assert row["failed_rollouts"] == 0 and took < restart_s  # hang_timeout_s 3 s + a restart, not 600 s
    with pytest.raises(ProcessLookupError):
        os.kill(stopped["pid"], 0)


@pytest.mark.parametrize("file, garbage", [("optimizer.safetensors", b"\xff" * 16),  # "header too large"
                                           ("trainer_state.json", b"\xff\xfe{")])  # UnicodeDecodeError
def test_corrupt_checkpoint_names_the_file(run, tmp_path, file, garbage):
    copy = tmp_path / "policy-step-2"
    shutil.copytree(run.run_dir / "adapters" / "policy-step-2", copy)
    (copy / "trainer" / file).write_bytes(garbage)
    step_before = run.trainer.step
    with pytest.raises(CheckpointError) as err:
        run.trainer.load_checkpoint(copy)
    msg = str(err.value)
    assert str(copy / "trainer" / file) in msg and "corrupt" in msg and "resume" in msg and f"move {copy}" in msg
    assert run.trainer.step == step_before
