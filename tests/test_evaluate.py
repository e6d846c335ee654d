"""Evaluation: run.evaluate on held-out seeds (greedy, and k samples for pass@k), a task's own
eval split through the duck-typed split() hook, eval_every putting eval columns on the history
row, and the eval curve in plot_reward. Evaluation never trains or changes the served adapter."""
import asyncio
from types import SimpleNamespace

import matplotlib
import pytest

matplotlib.use("Agg")

from artsg_nb.view import plots  # noqa: E402
from artsg_nb.rollout.evaluate import EVAL_SEED_BASE, eval_task_and_seeds  # noqa: E402
from artsg_nb.run.session import GRPORun, RunConfig  # noqa: E402


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    cfg = RunConfig(task="addition", engine="cpu", model_path=str(tiny_model_dir),
                    run_dir=str(tmp_path_factory.mktemp("eval") / "run"), group_size=4, groups_per_step=2,
                    verify_adapter=False, verbose=False, eval_every=2, eval_n=4, report_to=("tensorboard",))
    with GRPORun(cfg) as r:
        yield r


def test_greedy_eval_on_held_out_seeds_trains_nothing(run):
    asyncio.run(run.step())
    served, step, loaded = run.adapter, run.trainer.step, set(asyncio.run(run.client.list_adapters()))
    summary, df = asyncio.run(run.evaluate(n=5, return_samples=True))
    assert summary["n"] == 5 and summary["k"] == 1 and len(df) == 5 and summary["adapter"] == served
    assert (df["seed"] >= EVAL_SEED_BASE).all()
    assert summary["eval_reward_mean"] == pytest.approx(df["reward"].mean())
    assert summary["pass_at_k"] == pytest.approx((df["reward"] >= 1.0).mean())
    again = asyncio.run(run.evaluate(n=5))  # greedy: the same answers again
    assert again["eval_reward_mean"] == summary["eval_reward_mean"]
    assert (run.adapter, run.trainer.step) == (served, step)
    assert set(asyncio.run(run.client.list_adapters())) == loaded and len(run.history) == 1


def test_pass_at_k_with_samples(run):
    summary, df = asyncio.run(run.evaluate(n=3, k=4, greedy=False, return_samples=True))
    assert summary["k"] == 4 and len(df) == 12
    solved = df.groupby("seed")["reward"].max() >= 1.0
    assert summary["pass_at_k"] == pytest.approx(solved.mean())
    with pytest.raises(ValueError, match="greedy"):
        asyncio.run(run.evaluate(n=2, k=2))


def test_eval_every_puts_eval_columns_on_the_row_and_the_plot(run):
    rows = [asyncio.run(run.step()) for _ in range(2 - len(run.history) % 2)]  # up to an even step
    row = rows[-1]
    assert row["step"] % 2 == 0 and 0 <= row["eval_reward"] <= 1 and 0 <= row["eval_pass_at_k"] <= 1
    df = run.history.df
    assert df.loc[df["step"] % 2 == 1, "eval_reward"].isna().all()
    assert df.loc[df["step"] % 2 == 0, "eval_reward"].notna().all()
    labels = [line.get_label() for line in plots.plot_reward(df).get_lines()]
    assert "eval" in labels
    assert "eval" not in [line.get_label() for line in plots.plot_reward(df.drop(columns="eval_reward")).get_lines()]
    # The tracker got the eval column too (tensorboard event files in run_dir).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run.run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval_reward")] == [s for s in df["step"] if s % 2 == 0]


def test_a_task_with_an_eval_split_is_evaluated_on_its_rows():
    part = SimpleNamespace(name="addition", max_new_tokens=8)

    class Rows:
        max_new_tokens = 8

        def __len__(self):
            return 3

    class DatasetTask:  # as Task.from_dataset makes one: rows behind `source`, split() by name
        source = object()

        def split(self, name):
            assert name == "eval"
            return Rows()

    played, seeds = eval_task_and_seeds(DatasetTask(), "eval", None, default_n=16)
    assert isinstance(played, Rows) and seeds == [0, 1, 2]
    assert eval_task_and_seeds(DatasetTask(), "eval", 2, default_n=16)[1] == [0, 1]
    with pytest.raises(ValueError, match="has 3 rows"):
        eval_task_and_seeds(DatasetTask(), "eval", 5, default_n=16)
    # Without a split() method: held-out seeds from EVAL_SEED_BASE, disjoint from training's.
    assert eval_task_and_seeds(part, "eval", 2, default_n=16)[1] == [EVAL_SEED_BASE, EVAL_SEED_BASE + 1]
    with pytest.raises(ValueError, match="no splits"):
        eval_task_and_seeds(part, "train", 2, default_n=16)
