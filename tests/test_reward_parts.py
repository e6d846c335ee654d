"""Reading what the model does (issue 50 item 4): a dataset task's reward functions each on its own
(per completion in the rollouts file, per step as TRL's `rewards/<fn>/mean|std` history columns,
one line each in a plot panel), pass@1 from a named success function instead of the weighted sum,
and RunConfig.print_samples' short block of completions under each step's line."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import matplotlib
import pytest

matplotlib.use("Agg")

from artsg_nb.engines import Generation  # noqa: E402
from artsg_nb.rollout.evaluate import evaluate  # noqa: E402
from artsg_nb.rollout.groups import collect_groups  # noqa: E402
from artsg_nb.rollout.samples import read_samples, samples_block, write_rollouts  # noqa: E402
from artsg_nb.run.config_checks import ConfigError  # noqa: E402
from artsg_nb.run.history import COLUMNS, History  # noqa: E402
from artsg_nb.run.row import step_row  # noqa: E402
from artsg_nb.run.session import GRPORun, RunConfig  # noqa: E402
from artsg_nb.tasks.registry import Task  # noqa: E402
from artsg_nb.view.plots import panels  # noqa: E402
from artsg_nb.view.plots.sample_cards import sample_cards  # noqa: E402

from test_dataset_tasks import ReplyClient  # noqa: E402  (a client that answers without a server)

SHORT, LONG = "2", "The answer is 2, because one plus one is two, as everyone knows."


@dataclass
class Params:
    max_new_tokens: int = 64
    temperature: float = 1.0
    n: int = 1


def accuracy(prompts, completions, answer, **kw):
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]


def brevity(prompts, completions, **kw):
    """-0.5 for a reply longer than 10 characters: a correct but long answer sums to 0.5."""
    return [-0.5 if len(c) > 10 else 0.0 for c in completions]


def rows(n=4):
    return [{"prompt": "What is 1 + 1?", "answer": "2"} for _ in range(n)]


def play(task, tok, replies, seeds=(0,), group_size=4):
    return asyncio.run(collect_groups(ReplyClient(tok, replies), task, tok, list(seeds), group_size, Params(),
                                      schedule="naive"))


def test_each_reward_functions_part_is_saved_per_completion_and_shown(tiny_tokenizer, tmp_path):
    task = Task.from_dataset(rows(), reward_funcs=[accuracy, brevity])
    groups = play(task, tiny_tokenizer, [SHORT, LONG])
    write_rollouts(tmp_path, 1, groups)
    df = read_samples(tmp_path, 1)
    assert list(df["reward"]) == [1.0, 0.5, 1.0, 0.5]
    assert list(df["reward_parts"]) == [{"accuracy": 1.0, "brevity": 0.0}, {"accuracy": 1.0, "brevity": -0.5}] * 2
    assert "reward 0.500 (accuracy 1.000, brevity -0.500)" in str(sample_cards(df, k=4))


def test_history_row_has_trls_per_function_columns(tiny_tokenizer, tmp_path):
    task = Task.from_dataset(rows(), reward_funcs=[accuracy, brevity])
    groups = play(task, tiny_tokenizer, [SHORT, LONG, LONG, LONG])
    row = step_row(1, "policy-step-1", groups, {}).as_dict()
    assert row["rewards/accuracy/mean"] == 1.0 and row["rewards/accuracy/std"] == 0.0
    assert row["rewards/brevity/mean"] == pytest.approx(-0.375)
    assert row["rewards/brevity/std"] == pytest.approx((3 * 0.125 ** 2 + 0.375 ** 2) ** 0.5 / 3 ** 0.5)
    assert not any(c.startswith("rewards/") for c in COLUMNS), "named by the task: not part of the fixed schema"
    history = History(tmp_path)
    history.append(row)
    assert History.load(tmp_path).df["rewards/brevity/mean"].tolist() == [pytest.approx(-0.375)]
    single = Task.from_dataset(rows(), reward_funcs=accuracy)  # one function still has its column
    assert "rewards/accuracy/mean" in step_row(1, None, play(single, tiny_tokenizer, [SHORT]), {}).as_dict()


def test_reward_functions_panel_draws_one_line_per_function(tiny_tokenizer, tmp_path):
    task = Task.from_dataset(rows(), reward_funcs=[accuracy, brevity])
    history = History(tmp_path)
    for step, replies in enumerate(([LONG], [SHORT, LONG], [SHORT]), 1):
        history.append(step_row(step, None, play(task, tiny_tokenizer, replies), {}).as_dict())
    df = history.df
    assert panels.training_panels(df)[:2] == ["reward", "reward_parts"]
    ax = panels.plot_reward_parts(df)
    assert sorted(line.get_label() for line in ax.lines) == ["accuracy", "brevity"]
    brevity_line = next(line for line in ax.lines if line.get_label() == "brevity")
    assert list(brevity_line.get_ydata()) == [-0.5, -0.25, 0.0]
    plain = df.drop(columns=[c for c in df.columns if c.startswith("rewards/")])
    assert "reward_parts" not in panels.training_panels(plain)


def test_pass_at_1_counts_a_named_success_function_not_the_weighted_sum(tiny_tokenizer):
    def run_eval(task):
        return asyncio.run(evaluate(ReplyClient(tiny_tokenizer, [LONG]), task, tiny_tokenizer, None, n=2,
                                    max_new_tokens=64)).summary

    split = dict(reward_funcs=[accuracy, brevity], eval_rows=[0, 1])
    weighted = run_eval(Task.from_dataset(rows(), **split))
    assert weighted["eval_reward_mean"] == 0.5 and weighted["pass_at_k"] == 0.0  # correct, but long
    by_name = run_eval(Task.from_dataset(rows(), success="accuracy", **split))
    assert by_name["pass_at_k"] == 1.0 and by_name["eval_reward_mean"] == 0.5
    strict = run_eval(Task.from_dataset(rows(), success=lambda prompts, completions, **kw: [
        float(c.strip() == "2") for c in completions], **split))  # a function not among the rewards
    assert strict["pass_at_k"] == 0.0 and strict["eval_reward_mean"] == 0.5
    with pytest.raises(ValueError, match="names no reward function.*'accuracy', 'brevity'"):
        Task.from_dataset(rows(), success="acc", **split)


def test_samples_block_is_one_short_line_per_completion(tiny_tokenizer):
    task = Task.from_dataset(rows(), reward_funcs=[accuracy, brevity])
    groups = play(task, tiny_tokenizer, [LONG * 5, SHORT], seeds=(0, 1), group_size=2)
    block = samples_block(groups, 3, step=4).splitlines()
    assert block[0] == "  samples of step 4:" and len(block) == 4
    assert block[1].startswith("  g0.0 reward 0.50 (accuracy 1.00, brevity -0.50) | stop | 'The answer")
    assert block[2].startswith("  g1.0 ") and block[3].startswith("  g0.1 reward 1.00")
    assert all(len(line) < 260 for line in block) and "…" in block[1]
    with pytest.raises(ConfigError, match="print_samples"):
        RunConfig(print_samples=-1)


def test_a_run_prints_k_samples_under_each_step_line(tiny_model_dir, tmp_path, capsys):
    task = Task.from_dataset(rows(8), reward_funcs=[accuracy, brevity], max_new_tokens=8)
    cfg = RunConfig(task=task, engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"),
                    group_size=2, groups_per_step=2, verify_adapter=False, print_samples=2)
    with GRPORun(cfg) as run:
        asyncio.run(run.step())
        row = run.history.last
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("step 1 |"))
    assert lines[at + 1] == "  samples of step 1:" and lines[at + 2].startswith("  g0.0 reward ")
    assert lines[at + 3].startswith("  g1.0 reward ") and "(accuracy " in lines[at + 2]
    assert {"rewards/accuracy/mean", "rewards/brevity/mean"} <= set(row)
    assert "reward_parts" in read_samples(tmp_path / "run", 1).columns
