"""An ART model as one experiment of a sweep (SGLangBackend(sweep=...)): on the CPU engine, an
art.TrainableModel trains through the sweep's server and MultiTrainer while the sweep's own
experiment steps beside it; each is served under its own adapter names; the sweep never steps the
ART model; closing the backend takes it out and the sweep goes on. Bad input: another base model or
a LoRA the sweep was not started for is refused naming both, and nothing is attached."""
import asyncio
from dataclasses import replace

import pytest

art = pytest.importorskip("art")

from openai import AsyncOpenAI  # noqa: E402

from artsg_nb.art import SGLangBackend  # noqa: E402
from artsg_nb.art.runs import BaseModelMismatchError  # noqa: E402
from artsg_nb.multi.runtime import Sweep, SweepConfig  # noqa: E402
from artsg_nb.multi.trainer import LoraMismatchError  # noqa: E402
from artsg_nb.run.config import RunConfig  # noqa: E402
from artsg_nb.tasks.registry import get_task  # noqa: E402

TASK = get_task("addition")


def alternating_reward(envs, trajectories):
    """Member i of a group earns i % 2: every step has signal, so every step updates and reloads."""
    return [float(i % 2) for i in range(len(trajectories))]


SIGNAL = replace(TASK, name="addition-signal", group_reward=alternating_reward)


async def art_group(model, scenario: int, size: int = 4) -> art.TrajectoryGroup:
    """ART's rollout shape against the model's served adapter; member i's reward is i % 2."""
    messages = TASK.make_env(scenario).reset()
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    trajectories = []
    for i in range(size):
        completion = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                          max_tokens=8, logprobs=True)
        trajectories.append(art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=i % 2))
    return art.TrajectoryGroup(trajectories)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    own = RunConfig(task=SIGNAL, group_size=4, groups_per_step=2, max_new_tokens=8, verbose=False, seed=1)
    s = Sweep(SweepConfig(run_dir=str(tmp_path_factory.mktemp("sweep")), engine="cpu"), {"own": own}).start()
    yield s
    s.stop()


@pytest.mark.slow
def test_an_art_model_trains_as_one_experiment_beside_the_sweeps_own(sweep, tmp_path):
    async def main():
        backend = SGLangBackend(path=str(tmp_path / ".art"), sweep=sweep,
                                config=RunConfig(learning_rate=1e-2, seed=2, verbose=False))
        model = art.TrainableModel(name="adder", project="p", base_model=sweep.model_dir)
        await model.register(backend)
        served = sweep.client.served_model
        assert model.get_inference_name() == f"{served}:adder-step-0"
        assert model.inference_base_url == f"{sweep.client.base_url}/v1"
        results, rates = [], []
        train_step = sweep.multi.train_step

        def recording(name, groups):  # the learning rate each of the ART model's updates ran at
            if name == "adder":
                rates.append(sweep.multi.learning_rate_of(name))
            return train_step(name, groups)

        sweep.multi.train_step = recording
        for i in range(2):  # the ART model's step and the sweep's own step, at the same time
            async def art_step():
                groups = [await art_group(model, 100 * i + s) for s in range(2)]
                return await backend.train(model, groups, learning_rate=5e-2)
            result, rows = await asyncio.gather(art_step(), sweep.step())
            results.append(result)
            assert set(rows) == {"own"}, "the sweep steps only its own experiments"
            assert result.step == i + 1 and model.get_inference_name() == f"{served}:adder-step-{i + 1}"
            held = set(await sweep.client.list_adapters())
            assert {"adder-step-%d" % (i + 1), "own-step-%d" % (i + 1)} <= held, held
            assert not {f"adder-step-{i}", f"own-step-{i}"} & held, "each reload unloads its own old version"
        assert results[0].metrics["probe_mad"] < 0.02, "the served adapter is not the ART model's trained one"
        assert results[-1].checkpoint_path == str(sweep.run_dir / "adder" / "adapters" / "policy-step-2")
        del sweep.multi.train_step
        assert rates == [5e-2, 5e-2], "the call's learning rate is the one its update runs at"
        assert sweep.multi.learning_rate_of("adder") == 1e-2, "one call's learning rate is taken back after it"
        with pytest.raises(ValueError, match="attached experiments are trained by their owner"):
            await sweep.step(names=["adder"])
        with pytest.raises(ValueError, match="train_on is for experiments attached"):
            await sweep.train_on("own", [])
        table = sweep.table()
        assert table.loc["adder", "status"] == "external" and table.loc["adder", "step"] == 2
        assert table.loc["own", "step"] == 2 and table.loc["own", "status"] == "stepping"
        # an older step under a lease: its own name, never the other experiment's
        async with backend.exact_adapter_lease(model, 1):
            assert model.get_inference_name() == f"{served}:adder-step-1-lease"
            assert "adder-step-1-lease" in await sweep.client.list_adapters()
        await backend.close()  # the model leaves; the sweep goes on
        held = await sweep.client.list_adapters()
        assert not [a for a in held if a.startswith("adder-")] and "adder" not in sweep.experiments
        assert (await sweep.step())["own"]["step"] == 3

    asyncio.run(main())


def test_another_base_model_or_a_lora_the_sweep_has_no_room_for_is_refused_naming_both(sweep, tmp_path,
                                                                                       tiny_model_dir):
    other = tmp_path / "other-model"
    other.mkdir()

    async def register(name, base_model, config=RunConfig(verbose=False)):
        backend = SGLangBackend(path=str(tmp_path / ".art"), sweep=sweep, config=config)
        await art.TrainableModel(name=name, project="p", base_model=base_model).register(backend)

    with pytest.raises(BaseModelMismatchError, match=rf"'{other}'.*not the sweep's base model \({sweep.model_dir}\)"):
        asyncio.run(register("elsewhere", str(other)))
    big = sweep.cfg.lora.rank * 2
    with pytest.raises(LoraMismatchError, match=rf"{big}.*{sweep.cfg.lora.rank}"):
        asyncio.run(register("wide", sweep.model_dir, RunConfig(lora_rank=big, verbose=False)))
    assert not {"elsewhere", "wide"} & set(sweep.experiments), "a refused model is not attached"
