"""Tasks: rewards on hand-made replies, determinism per seed, episodes that always end, registry."""
import random

import pytest

from artsg_nb.tasks import registry as tasks
from artsg_nb.tasks.registry import UnknownTaskError, addition_reward, get_task, list_tasks, play, shop_reward

GARBAGE = ["", " ", "\n\n", "seven", "7 apples", "7.0", "<|im_end|>", "¿7?", "\x00\x01", "9" * 50, "price",
           "price  ", "price fig fig", "PRICE", "-", "--3", "٣", "🙂", "price 🙂"]


@pytest.mark.parametrize("reply,reward", [
    ("7", 1.0), (" 7\n", 1.0), ("8", 0.4), ("6", 0.4), ("9", 0.3), ("12", 0.0), ("-7", 0.0), ("007", 1.0),
])
def test_addition_reward_on_numbers(reply, reward):
    assert addition_reward(reply, 7) == pytest.approx(reward)


@pytest.mark.parametrize("reply", GARBAGE + [None])
def test_rewards_are_zero_on_garbage_and_never_raise(reply):
    assert addition_reward(reply, 7) == 0.0
    env = get_task("price_lookup").make_env(0)
    env.reset()
    result = env.step(reply)
    assert result.reward is None or result.reward == 0.0


def test_addition_env():
    env = get_task("addition").make_env(3)
    (msg,) = env.reset()
    assert msg["role"] == "user" and msg["content"] == f"What is {env.a} + {env.b}?"
    result = env.step(str(env.answer))
    assert (result.messages, result.reward, result.done) == ([], 1.0, True)


def _price_env(seed=5):
    env = get_task("price_lookup").make_env(seed)
    return env, env.reset(), str(env.prices[env.item])


def test_price_lookup_best_episode():
    env, opening, price = _price_env()
    assert [m["role"] for m in opening] == ["system", "user"]
    assert opening[1]["content"] == f"How much is a {env.item}?"
    tool = env.step(f"price {env.item}")
    assert not tool.done and tool.reward is None
    assert tool.messages == [{"role": "tool", "content": f"{env.item} costs {price}."}]
    assert env.step(price).reward == 1.0


def test_price_lookup_partial_credit():
    env, _, price = _price_env()
    env.step(f"Price {env.item.upper()}")  # case does not matter
    env.step(f"price {env.item}")
    assert env.step(price).reward == pytest.approx(0.9)  # one extra tool call
    env, _, price = _price_env()
    env.step(f"price {env.item}")
    assert env.step(str(int(price) % 9 + 1)).reward == 0.2  # looked up, answered wrong
    env, _, price = _price_env()
    assert env.step(str(int(price) % 9 + 1)).reward == 0.0  # guessed wrong without looking


def test_price_lookup_unknown_item_and_chatter():
    env, _, _ = _price_env()
    assert env.step("price durian").messages == [{"role": "tool", "content": "The shop has no durian."}]
    nudge = env.step("let me think")
    assert nudge.messages[0]["role"] == "user" and not nudge.done
    last = env.step("no idea")
    assert last.done and last.reward == 0.0 and last.messages == []


@pytest.mark.parametrize("name", [t.name for t in list_tasks()])
def test_same_seed_same_prompt_and_reset_restarts(name):
    task = get_task(name)
    first = task.make_env(42).reset()
    assert task.make_env(42).reset() == first
    env = task.make_env(42)
    env.reset()
    env.step("1")
    assert env.reset() == first
    episodes = {str(play(task.make_env(seed), lambda _m: "5", task.max_turns)) for seed in range(20)}
    assert len(episodes) > 5, "seeds should give different episodes"


@pytest.mark.parametrize("name", [t.name for t in list_tasks()])
def test_episodes_end_within_max_turns_whatever_the_replies(name):
    task = get_task(name)
    rng = random.Random(0)
    replies = GARBAGE + ["1", "5", "price apple", "price kiwi", "Price mango"]
    for seed in range(50):
        _, reward = play(task.make_env(seed), lambda _m: rng.choice(replies), task.max_turns)
        assert 0.0 <= reward <= 1.0


def test_shop_reward_is_pure():
    assert shop_reward(6, 6, ["pear"], "pear") == 1.0
    assert shop_reward(6, 6, [], "pear") == 1.0  # a lucky guess is still right
    assert shop_reward(None, 6, ["fig"], "pear") == 0.0


def test_guess_number_episode():
    env = get_task("guess_number").make_env(1)
    system, opening = env.reset()
    assert system["role"] == "system" and opening["content"] == "I picked a number between 1 and 9. Your guess?"
    low = env.secret - 1 if env.secret > 1 else None
    if low:
        assert env.step(str(low)).messages[0]["content"] == f"Higher. It is between {env.secret} and 9."
    assert env.step("what?").messages[0]["content"].startswith("Not a number.")
    assert env.step(str(env.secret)).reward == pytest.approx(0.8 if low else 0.9)
    assert tasks.guess_reward([None, None, None, None], 5) == 0.0
    assert tasks.guess_reward([2, 3, 4, 9], 5) == pytest.approx(0.3 * (1 - 4 / 9))


def test_unknown_task_lists_known_names():
    with pytest.raises(UnknownTaskError) as e:
        get_task("chess")
    assert isinstance(e.value, ValueError)
    for task in list_tasks():
        assert task.name in str(e.value)


def test_registry():
    names = [t.name for t in list_tasks()]
    assert names == ["addition", "price_lookup", "guess_number", "addition_chat"]
    assert get_task("addition").max_turns == 1 and get_task("price_lookup").max_turns == 3
    assert get_task("guess_number").max_turns == 4
    assert all(t.max_new_tokens > 0 and t.description for t in list_tasks())


def test_pretraining_corpus_is_deterministic_and_clean_teachers_are_right():
    assert tasks.pretraining_corpus(6, seed=1) == tasks.pretraining_corpus(6, seed=1)
    assert tasks.pretraining_corpus(6, seed=1) != tasks.pretraining_corpus(6, seed=2)
    corpus = tasks.pretraining_corpus(40, seed=0, mix=["price_lookup"], noise=0.0)
    assert all([m["role"] for m in conv][2:] == ["assistant", "tool", "assistant"] for conv in corpus)
    rng = random.Random(0)
    for task in [t for t in list_tasks() if t.teacher is not None]:
        env = task.make_env(7)
        teacher = task.teacher
        best = 1.0 if task.name != "guess_number" else 0.7  # binary search may need all 4 guesses
        assert play(env, lambda _m: teacher(env, rng, 0.0), task.max_turns)[1] >= best


def test_shared_system_prompts_outweigh_the_questions(tiny_tokenizer):
    # guess_number's long prompt is the caching demo; price_lookup's is short enough for the tiny
    # model to copy the asked item behind it (tasks.py), yet still most of turn 1's prompt.
    for name, lo, hi in [("price_lookup", 40, 80), ("guess_number", 100, 300)]:
        system, question = get_task(name).make_env(0).reset()
        assert lo <= len(tiny_tokenizer.encode(system["content"])) <= hi
        assert len(tiny_tokenizer.encode(question["content"])) < 16
    (addition,) = get_task("addition").make_env(0).reset()
    assert len(tiny_tokenizer.encode(addition["content"])) < 12


def test_addition_chat_reads_the_replys_last_number():
    from artsg_nb.tasks.chat import addition_chat_reward
    env = get_task("addition_chat").make_env(3)
    a, b, total = env.a, env.b, env.answer
    assert env.step(f"{a} + {b} = {total}.").reward == 1.0
    assert env.step(f"The sum of {a} and {b} is {total}").reward == 1.0
    assert env.step(f"{total} is wrong, it is {total + 1}").reward == pytest.approx(0.4)  # the last one counts
    assert env.step(f"{total}, as {a} + {b} makes").reward == 1.0  # the restated question is set aside
    assert env.step(f"{b} + {a} = {total}").reward == 1.0
    # cut off before the answer: the operands are the question's, not a guess (b is near a + b here)
    assert tasks.addition_reward(str(b), total) > 0
    assert env.step(f"{a} + {b} =").reward == 0.0
    assert env.step(f"The sum of {a} and {b} is").reward == 0.0
    assert env.step("I do not know.").reward == 0.0
    assert env.step("٣").reward == 0.0  # ASCII digits only
    assert addition_chat_reward(None, 2, 3) == 0.0
    # an operand that is the answer still counts: alone, or after the restated question
    assert addition_chat_reward("4", 0, 4) == 1.0
    assert addition_chat_reward("0 + 4 = 4", 0, 4) == 1.0
    assert addition_chat_reward("0 + 4 =", 0, 4) == 0.0
    # a question restated twice, and cut off: neither restatement is an answer
    assert env.step(f"{a} + {b} = {a} + {b}").reward == 0.0
    assert env.step(f"{a} + {b}? Well, {b} + {a}").reward == 0.0
    assert addition_chat_reward("3 + 4 = 3 + 4 = 7", 3, 4) == 1.0
    # the prompts are addition's: a benchmark on either task asks the same questions
    assert get_task("addition_chat").make_env(11).reset() == get_task("addition").make_env(11).reset()
    assert get_task("addition_chat").teacher is None  # not in the tiny model's pretraining


def test_the_tiny_models_recipe_file_holds_only_the_pretraining_tasks():
    """addition_chat lives outside registry.py (which the tiny model's build recipe hashes), and
    the pretraining corpus is the same with it registered."""
    from pathlib import Path
    assert "addition_chat" not in Path(tasks.__file__).read_text()
    assert [t.name for t in list_tasks() if t.teacher is not None] == ["addition", "price_lookup", "guess_number"]
    assert tasks.pretraining_corpus(9, seed=3) == tasks.pretraining_corpus(9, seed=3, mix=["addition", "price_lookup",
                                                                                          "guess_number"])
