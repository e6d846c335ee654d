"""Dataset tasks in TRL's shape (Task.from_dataset): rows walked epoch by epoch, a disjoint
train/eval split, TRL reward functions called once per group with TRL's keywords and summed with
their weights, and bad input (raising / None / NaN rewards, a missing column) recorded or refused
with a message that says what to do. Rollouts run against a scripted fake server."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import pytest
from trl.rewards import get_soft_overlong_punishment, think_format_reward

from artsg_nb.tasks.dataset import DatasetColumnError
from artsg_nb.engines import Generation
from artsg_nb.rollout.groups import collect_groups
from artsg_nb.rollout.trajectory import NoRewardError, require_rewards, rollout_stats
from artsg_nb.tasks.registry import StepResult, Task, get_task


@dataclass
class Params:
    max_new_tokens: int = 16
    temperature: float = 1.0
    n: int = 1


class ReplyClient:
    """Answers request i (and sample k of it) with replies[(i + k) % len]; no server."""

    def __init__(self, tokenizer, replies):
        self.tok, self.replies, self.calls = tokenizer, replies, 0

    async def generate(self, input_ids, params, adapter=None, on_first_token=None):
        i, self.calls = self.calls, self.calls + 1
        if on_first_token is not None:
            on_first_token()
        out = []
        for k in range(params.n):
            text = self.replies[(i + k) % len(self.replies)]
            ids = self.tok.encode(text, add_special_tokens=False)[: params.max_new_tokens]
            out.append(Generation(ids, [-0.5] * len(ids), len(input_ids), 0, "stop", self.tok.decode(ids), e2e_s=0.0))
        return out


def rows(n=10, chat=True):
    make = (lambda q: [{"role": "user", "content": q}]) if chat else (lambda q: q)
    return [{"prompt": make(f"What is {i} + 1?"), "answer": str(i + 1), "id": i} for i in range(n)]


def const(value):
    def reward(prompts, completions, **kw):
        return [value] * len(completions)
    reward.__name__ = f"const_{value}"
    return reward


def play(task, tok, replies, seeds, group_size=4):
    return asyncio.run(collect_groups(ReplyClient(tok, replies), task, tok, seeds, group_size, Params(),
                                      schedule="naive"))


# ------------------------------------------------------------------------------ rows and epochs

def test_steps_walk_a_seeded_permutation_epoch_after_epoch():
    task = Task.from_dataset(rows(10), reward_funcs=[const(1.0)])
    order = [task.make_env(s).row for step in range(1, 6) for s in task.group_seeds(7, step, 4)]  # 20 groups
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:]) == list(range(10))
    assert order[:10] != order[10:20], "each epoch should have its own order"
    again = [task.make_env(s).row for step in range(1, 6) for s in task.group_seeds(7, step, 4)]
    other = [task.make_env(s).row for step in range(1, 6) for s in task.group_seeds(8, step, 4)]
    assert again == order and other != order
    assert all(e.reset() == task.make_env(s).reset() for s in (3, 99) for e in [task.make_env(s)])


def test_split_is_disjoint_and_eval_task_serves_only_held_out_rows():
    task = Task.from_dataset(rows(20), reward_funcs=[const(1.0)], eval_fraction=0.25)
    train, held = task.source.splits["train"], task.source.splits["eval"]
    assert len(held) == 5 and not set(train) & set(held) and sorted(train + held) == list(range(20))
    ev = task.split("eval")
    assert ev.name == "dataset[eval]" and len(ev.source) == 5
    assert {ev.make_env(s).row for s in range(50)} == set(held)
    assert {task.make_env(s).row for s in range(200)} == set(train)
    explicit = Task.from_dataset(rows(20), reward_funcs=[const(1.0)], eval_rows=[0, 1, 2])
    assert explicit.split("eval").source.indices == [0, 1, 2] and 0 not in explicit.source.indices
    with pytest.raises(ValueError, match="only Task.from_dataset tasks have splits"):
        get_task("addition").split("eval")
    with pytest.raises(ValueError, match="eval_fraction= or eval_rows="):
        Task.from_dataset(rows(4), reward_funcs=[const(1.0)]).split("eval")


def test_missing_prompt_column_lists_the_columns_there_are():
    with pytest.raises(DatasetColumnError, match=r"no column 'question'.*'prompt', 'answer', 'id'"):
        Task.from_dataset(rows(3), prompt="question", reward_funcs=[const(1.0)])


def test_a_datasets_Dataset_works_like_a_list(tiny_tokenizer):
    import datasets

    task = Task.from_dataset(datasets.Dataset.from_list(rows(6)), reward_funcs=[think_format_reward],
                             system_prompt="Think first.")
    opening = task.make_env(0).reset()
    assert opening[0] == {"role": "system", "content": "Think first."} and opening[1]["role"] == "user"
    groups = play(task, tiny_tokenizer, ["<think>a</think>7"], [0, 1], group_size=2)
    assert [t.reward for g in groups for t in g.trajectories] == [1.0] * 4


# ------------------------------------------------------------------------------ TRL reward functions

def test_trl_reward_functions_verbatim_weighted_once_per_group(tiny_tokenizer):
    # think_format_reward reads chat completions, get_soft_overlong_punishment reads completion_ids:
    # both as TRL ships them, summed with TRL's weights.
    overlong = get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)
    task = Task.from_dataset(rows(4), reward_funcs=[think_format_reward, overlong], reward_weights=[2.0, 0.5])
    good, long_bad = "<think>x</think>5", "no think tags here at all, this reply runs long"
    groups = play(task, tiny_tokenizer, [good, long_bad], [0], group_size=4)
    trajs = groups[0].trajectories
    n_good = len(tiny_tokenizer.encode(good, add_special_tokens=False))
    expect_good = 2.0 + 0.5 * overlong(completion_ids=[[0] * n_good])[0]
    assert [t.reward for t in trajs] == pytest.approx([expect_good, -0.5, expect_good, -0.5])


def test_reward_kwargs_match_trl(tiny_tokenizer):
    calls = []

    def spy(prompts, completions, completion_ids, answer, id, trainer_state, log_extra, log_metric, **rest):
        calls.append(dict(prompts=prompts, completions=completions, ids=completion_ids, answer=answer, id=id,
                          step=trainer_state.global_step, rest=rest))
        log_metric("spy", 1.0)
        return [float(c == a) for c, a in zip(completions, answer)]

    text_task = Task.from_dataset(rows(3, chat=False), reward_funcs=[spy], dry_run=False)  # calls counted below
    [seed] = text_task.group_seeds(0, 3, 1)  # step 3: two optimizer steps done before it
    groups = play(text_task, tiny_tokenizer, ["3"], [seed], group_size=3)
    assert len(calls) == 1, "reward functions are called once per group"
    c = calls[0]
    row = text_task.make_env(seed).row
    assert c["prompts"] == [f"What is {row} + 1?"] * 3 and c["completions"] == ["3"] * 3
    assert c["answer"] == [str(row + 1)] * 3 and c["id"] == [row] * 3 and c["rest"] == {} and c["step"] == 2
    assert all(ids == tiny_tokenizer.encode("3", add_special_tokens=False) for ids in c["ids"])
    assert [t.reward for t in groups[0].trajectories] == [float(row == 2)] * 3
    assert text_task.source.logged == {"spy": [1.0]}
    chat_task = Task.from_dataset(rows(3), reward_funcs=[spy], dry_run=False)
    play(chat_task, tiny_tokenizer, ["3"], [0], group_size=2)
    assert calls[1]["completions"] == [[{"role": "assistant", "content": "3"}]] * 2
    assert calls[1]["prompts"][0] == [{"role": "user", "content": f"What is {chat_task.make_env(0).row} + 1?"}]


def test_async_reward_functions_and_async_envs_are_awaited(tiny_tokenizer):
    async def slow_reward(prompts, completions, **kw):
        await asyncio.to_thread(int)  # a real suspension: the loop runs others until the thread answers
        return [0.25] * len(completions)

    class AsyncEnv:
        async def reset(self):
            await asyncio.to_thread(int)
            return [{"role": "user", "content": "say 5"}]

        async def step(self, reply):
            await asyncio.to_thread(int)  # e.g. a tool that calls an API
            return StepResult([], float(reply.strip() == "5"), True)

    groups = play(Task.from_dataset(rows(2), reward_funcs=[slow_reward]), tiny_tokenizer, ["x"], [0], 2)
    assert [t.reward for t in groups[0].trajectories] == [0.25, 0.25]
    env_task = Task("say5", "async env", max_turns=1, max_new_tokens=4, factory=lambda seed: AsyncEnv())
    groups = play(env_task, tiny_tokenizer, ["5", "6"], [0], 2)
    assert [t.reward for t in groups[0].trajectories] == [1.0, 0.0]


# ------------------------------------------------------------------------------ bad rewards

def test_none_and_nan_skip_a_function_but_a_sample_no_function_scores_has_no_reward(tiny_tokenizer):
    def sometimes(prompts, completions, **kw):
        return [None if "none" in c[0]["content"] else math.nan if "nan" in c[0]["content"] else 1.0
                for c in completions]

    def only_nan(prompts, completions, **kw):
        return [None if "nan" in c[0]["content"] else 0.5 for c in completions]

    task = Task.from_dataset(rows(2), reward_funcs=[sometimes, only_nan], reward_weights=[1.0, 2.0])
    groups = play(task, tiny_tokenizer, ["ok", "none", "nan"], [0], group_size=3)
    ok, none, nan = groups[0].trajectories
    assert (ok.reward, none.reward) == (2.0, 1.0) and ok.valid and none.valid  # TRL's nansum
    assert nan.reward is None and not nan.valid and nan.error is None
    assert "every reward function returned None or NaN" in nan.reward_error
    assert rollout_stats(groups)["reward_errors"] == 1 and rollout_stats(groups)["failed"] == 0
    require_rewards(groups)  # some completions are scored: training goes on


@pytest.mark.parametrize("bad", ["raises", "short"])
def test_a_failing_reward_function_is_recorded_on_every_member(tiny_tokenizer, bad):
    def broken(prompts, completions, **kw):
        if bad == "raises":
            raise KeyError("solution")
        return [1.0]

    # dry_run=False: a function that always raises is refused when built (test_reward_function_checks);
    # one that raises on some completions only gets here
    task = Task.from_dataset(rows(2), reward_funcs=[const(1.0), broken], dry_run=False)
    groups = play(task, tiny_tokenizer, ["a"], [0, 1], group_size=3)
    trajs = [t for g in groups for t in g.trajectories]
    assert all(t.reward is None and not t.valid and "'broken'" in t.reward_error for t in trajs)
    assert ("KeyError" if bad == "raises" else "returned 1 rewards for 3") in trajs[0].reward_error
    with pytest.raises(NoRewardError, match=r"none of the 6 completions got a reward: .*'broken'"):
        require_rewards(groups)


def test_all_none_rewards_say_so(tiny_tokenizer):
    task = Task.from_dataset(rows(2), reward_funcs=[const(None)])
    groups = play(task, tiny_tokenizer, ["a"], [0], group_size=2)
    with pytest.raises(NoRewardError, match="returned None or NaN.*returns None where it does not apply"):
        require_rewards(groups)
