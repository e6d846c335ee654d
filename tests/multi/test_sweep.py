"""A sweep on the CPU engine: several experiments on one server and one MultiTrainer.

Isolation: the server answers an experiment's adapter name with that experiment's weights (scored
by the trainer), never another's; a crash in one experiment's reward leaves the others stepping;
an experiment's first step draws the samples and rewards it draws run alone; each reload unloads
only the experiment's own old version. Bad input: a LoRA the runtime was not started for, and more
experiments than fit in memory, are refused before anything starts, with the numbers."""
import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest

from artsg_nb.multi.memory import TooManyExperimentsError, sweep_fit
from artsg_nb.multi.runtime import Sweep, SweepConfig
from artsg_nb.multi.trainer import LoraMismatchError, LoraSpec
from artsg_nb.run.config import RunConfig
from artsg_nb.rollout.samples import read_samples
from artsg_nb.tasks.registry import get_task


def alternating_reward(envs, trajectories):
    """Member i of a group earns i % 2: every group has signal, so every step updates and reloads."""
    return [float(i % 2) for i in range(len(trajectories))]


def broken_reward(envs, trajectories):
    raise ZeroDivisionError("the reward's own bug")


SIGNAL = replace(get_task("addition"), name="addition-signal", group_reward=alternating_reward)
BROKEN = replace(get_task("addition"), name="addition-broken", group_reward=broken_reward)


def _cfg(task=SIGNAL, **kw):
    return RunConfig(task=task, group_size=4, groups_per_step=2, max_new_tokens=8, verbose=False,
                     **{"learning_rate": 1e-2, "seed": 0, **kw})


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    exps = {"slow": _cfg(learning_rate=1e-3, seed=1), "fast": _cfg(learning_rate=5e-2, seed=2),
            "broken": _cfg(task=BROKEN, seed=3)}
    s = Sweep(SweepConfig(run_dir=str(tmp_path_factory.mktemp("sweep")), engine="cpu"), exps).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stepped(sweep):
    """Two steps of the sweep: one together (step), one each at its own pace (run)."""
    first = asyncio.run(sweep.step())
    table = asyncio.run(sweep.run(1))
    return SimpleNamespace(first=first, table=table)


def test_a_crash_in_one_experiments_reward_leaves_the_others_stepping(sweep, stepped):
    assert stepped.first["broken"] is None and stepped.first["slow"] is not None
    table = stepped.table
    assert table.loc["broken", "status"] == "failed"
    assert "ZeroDivisionError" in table.loc["broken", "error"] and "addition-broken" in table.loc["broken", "error"]
    assert list(table.loc[["slow", "fast"], "step"]) == [2, 2]
    assert list(table.loc[["slow", "fast"], "adapter"]) == ["slow-step-2", "fast-step-2"]
    assert table.loc[["slow", "fast"], "status"].eq("stepping").all()
    assert table.loc[["slow", "fast"], "trainer_share"].sum() == pytest.approx(1.0)
    for name in ("slow", "fast"):
        rows = sweep.experiments[name].history.rows
        assert [r["step"] for r in rows] == [1, 2] and all(r["experiment"] == name for r in rows)
        assert rows[0]["probe_mad"] is not None and rows[0]["probe_mad"] < 0.02  # its first reload, checked


def test_each_reload_unloads_only_the_experiments_own_old_version(sweep, stepped):
    held = asyncio.run(sweep.client.list_adapters())
    assert set(held) == {"slow-step-2", "fast-step-2", "broken-step-0"}


def test_the_server_has_room_for_every_experiments_adapter_in_one_batch(sweep):
    info = asyncio.run(sweep.client.server_info())
    assert info["max_loras_per_batch"] == 4 and info["max_lora_rank"] == 16  # 3 experiments and the base model


def test_the_server_answers_an_adapter_name_with_that_experiments_weights(sweep, stepped):
    ids = sweep.multi.tokenizer.encode("What is 3 + 4? The answer is 7, and 5 + 2 is 7 too.")
    served = {n: asyncio.run(sweep.client.score(ids, adapter=f"{n}-step-2")) for n in ("slow", "fast")}
    base = asyncio.run(sweep.client.score(ids))
    trained = {n: sweep.multi.score(n, ids) for n in ("slow", "fast")}

    def mad(a, b):
        return sum(abs(x - y) for x, y in zip(a, b)) / len(a)

    for mine, other in (("slow", "fast"), ("fast", "slow")):
        assert mad(served[mine], trained[mine]) < 0.02, f"{mine}'s name is not answered with {mine}'s weights"
        assert mad(served[mine], trained[other]) > 5 * mad(served[mine], trained[mine]), \
            f"{mine}'s name answers like {other}'s adapter"
    assert mad(served["fast"], base) > 0.02  # the adapter is applied, not the base model in its place


def test_first_step_samples_and_rewards_equal_the_experiment_run_alone(sweep, stepped):
    sweep.add("slow-alone", _cfg(learning_rate=1e-3, seed=1))
    rows = asyncio.run(sweep.step(names=["slow-alone"]))
    assert rows["slow-alone"]["step"] == 1
    together = read_samples(sweep.experiments["slow"].run_dir, 1)
    alone = read_samples(sweep.experiments["slow-alone"].run_dir, 1)
    cols = ["group", "completion", "reward"] if "group" in together else ["completion", "reward"]
    assert len(together) == 8
    assert together[cols].equals(alone[cols])
    assert rows["slow-alone"]["reward_mean"] == sweep.experiments["slow"].history.rows[0]["reward_mean"]
    asyncio.run(sweep.remove("slow-alone"))
    assert not any(n.startswith("slow-alone") for n in asyncio.run(sweep.client.list_adapters()))


@pytest.mark.parametrize("name", ["lr.1", "a-step-1", "default", ""])
def test_a_name_that_cannot_prefix_served_adapters_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="experiment name"):
        Sweep(SweepConfig(run_dir=str(tmp_path)), {name: _cfg()})


def test_a_lora_the_runtime_was_not_started_for_is_refused_before_anything_starts(tmp_path):
    s = Sweep(SweepConfig(run_dir=str(tmp_path), engine="cpu", lora=LoraSpec(rank=8)),
              {"a": _cfg(lora_rank=8), "wide": _cfg(lora_rank=16)})
    with pytest.raises(LoraMismatchError, match=r"'wide' asks for a LoRA of rank 16 .* started with rank 8"):
        s.start()
    assert s.server is None and s.multi is None


def test_more_experiments_than_fit_are_refused_up_front_with_the_numbers(tmp_path, tiny_model_dir, monkeypatch):
    fit = sweep_fit(tiny_model_dir, 4, 16, available_bytes=10**9)
    assert fit.fits() and fit.most >= 4
    small = sweep_fit(tiny_model_dir, 4, 16, available_bytes=int((fit.shared_gib + 2.5 * fit.per_experiment_gib) * 2**30))
    assert not small.fits() and small.most == 2
    with pytest.raises(TooManyExperimentsError, match=r"4 experiments need [\d.]+ GiB of CPU memory.*Try: at most 2"):
        small.check()
    gpu = sweep_fit(tiny_model_dir, 4, 16, gpu_total_bytes=80 * 2**30)
    assert gpu.where == "GPU" and gpu.fits()
    busy = sweep_fit(tiny_model_dir, 4, 16, gpu_total_bytes=80 * 2**30, available_bytes=30 * 2**30)
    assert not busy.fits() and "GiB free on the GPU" in busy.describe()  # the server's share alone is 36 GiB

    import artsg_nb.multi.memory as memory
    free = int((fit.shared_gib + 1.5 * fit.per_experiment_gib) * 2**30)
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: SimpleNamespace(available=free))
    s = Sweep(SweepConfig(run_dir=str(tmp_path), engine="cpu"), {"a": _cfg(), "b": _cfg(seed=1)})
    with pytest.raises(TooManyExperimentsError, match=r"refused before starting anything: 2 experiments.*at most 1"):
        s.start()
    assert s.server is None and s.multi is None


def test_a_step_that_fails_after_its_update_is_undone_and_redone_after_retry(sweep, stepped, monkeypatch):
    exp = sweep.experiments["fast"]
    before, ids = exp.step_count, exp.multi.tokenizer.encode("What is 2 + 2? 4.")
    refuse = SimpleNamespace(calls=0)
    publish = exp.publisher.publish

    async def refused_once(version):
        refuse.calls += 1
        if refuse.calls == 1:
            raise RuntimeError("the load was refused")
        return await publish(version)

    monkeypatch.setattr(exp.publisher, "publish", refused_once)
    assert asyncio.run(sweep.step(names=["fast"])) == {"fast": None}
    assert exp.status == "failed" and "the load was refused" in exp.error
    assert exp.step_count == before and exp.adapter == f"fast-step-{before}"  # the update undone
    served = asyncio.run(sweep.client.score(ids, adapter=exp.adapter))
    assert sum(abs(a - b) for a, b in zip(served, sweep.multi.score("fast", ids))) / len(ids) < 0.02
    assert asyncio.run(sweep.step(names=["fast"])) == {}  # a failed experiment takes no step
    sweep.retry("fast")
    rows = asyncio.run(sweep.step(names=["fast"]))
    assert rows["fast"]["step"] == before + 1 and exp.adapter == f"fast-step-{before + 1}"
    assert [r["step"] for r in exp.history.rows][-2:] == [before, before + 1]


def test_a_rollback_keeps_the_experiments_learning_rate_not_the_one_its_checkpoint_was_saved_at(sweep, stepped,
                                                                                                  monkeypatch):
    """A checkpoint saved while one call's learning rate was on (an attached ART model's
    backend.train(learning_rate=...)) holds that rate; a step undone back to it keeps the experiment's own."""
    exp = sweep.experiments["slow"]
    own, served = sweep.multi.learning_rate_of("slow"), exp.publisher.current
    with sweep.multi.using("slow") as trainer:  # the served version's checkpoint, as if saved under a call's rate
        for group in trainer.optimizer.param_groups:
            group["lr"] = own * 7
        trainer.save_checkpoint(served.path, wait=True)
        for group in trainer.optimizer.param_groups:
            group["lr"] = own

    async def refused(version):
        raise RuntimeError("the load was refused")

    monkeypatch.setattr(exp.publisher, "publish", refused)
    assert asyncio.run(sweep.step(names=["slow"])) == {"slow": None}  # updated, then undone
    sweep.retry("slow")
    assert sweep.multi.step_of("slow") == served.step
    assert sweep.multi.learning_rate_of("slow") == own


def test_a_server_lost_mid_rollouts_is_restarted_and_every_experiment_steps_on(sweep, stepped, monkeypatch):
    """The server is SIGKILLed as `slow` opens the episodes of its second group, so that group's
    request goes to a dead server whatever became of the first (it used to be killed at the 3rd
    reply, after which all of slow's replies could already be in: then nothing of slow failed). One
    restart serves both experiments (each one's newest version loaded again) and both steps complete."""
    import os
    import signal

    exp = sweep.experiments["slow"]
    opened, make_env = [], exp.source.task.make_env
    per_step = exp.cfg.groups_per_step * exp.cfg.group_size

    def factory(seed):
        opened.append(seed)
        if len(opened) == exp.cfg.group_size + 1:  # the first episode of the second group
            os.killpg(sweep.server.pid, signal.SIGKILL)
            sweep.server.proc.wait(timeout=30)
        return make_env(seed)

    monkeypatch.setattr(exp.source, "task", replace(exp.source.task, factory=factory))
    before, steps = sweep.server.pid, {n: sweep.experiments[n].step_count for n in ("slow", "fast")}
    rows = asyncio.run(sweep.step())
    assert sweep.restarts == 1 and sweep.server.pid != before
    assert {n: rows[n]["step"] for n in steps} == {n: s + 1 for n, s in steps.items()}, sweep.table()["error"]
    assert len(opened) > per_step, "slow's rollouts were not redone after the restart"
    held = set(asyncio.run(sweep.client.list_adapters()))
    assert held >= {f"{n}-step-{s + 1}" for n, s in steps.items()} and not held & {f"{n}-step-{s}" for n, s in steps.items()}


def test_a_rerun_start_cell_stops_the_earlier_sweep_of_its_run_dir(tmp_path):
    first = Sweep(SweepConfig(run_dir=str(tmp_path), engine="cpu"), {"a": _cfg()}).start()
    try:
        second = Sweep(SweepConfig(run_dir=str(tmp_path), engine="cpu"), {"a": _cfg()}).start()
        try:
            assert not first.server.alive() and not first._lock.held
            assert asyncio.run(second.step())["a"]["step"] == 1
        finally:
            second.stop()
    finally:
        first.stop()
