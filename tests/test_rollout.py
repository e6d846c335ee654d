"""rollout.py: token-exact trajectories, failures as data, truncation, submission schedules.

Unit tests use a scripted fake client and a small ChatML tokenizer built here (no server);
the integration tests at the bottom start the real CPU engine subprocess.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field, replace

import pytest

from artsg_nb.engines import Generation
from artsg_nb.rollout.chat_tokens import env_suffix_ids, render_ids, turn_end_text
from artsg_nb.rollout.groups import SCHEDULES, collect_groups
from artsg_nb.rollout.trajectory import Trajectory, rollout_stats

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chatml_tokenizer():
    """A byte-level BPE with ChatML specials, trained in ~0.1 s on arithmetic-like words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    rng = random.Random(0)
    words = ["what", "is", "the", "sum", "answer", "again", "plus", "equals", "wrong", "right"]
    tok.train_from_iterator([" ".join(rng.choice(words) + str(rng.randint(0, 99)) for _ in range(10))
                             for _ in range(300)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


# ------------------------------------------------------------------------------ fakes



@dataclass
class FakeParams:
    max_new_tokens: int = 8
    temperature: float = 1.0
    n: int = 1


class FakeClient:
    """Replies with scripted token ids (no eos unless `eos` is set); logs every request.

    The log keeps (event, request index, time) so tests can check the submission order.
    """

    def __init__(self, tokenizer, replies, eos=False, delay_s=0.01, fail_adapter=None, cleanup_s=0.0):
        self.tok, self.replies, self.eos, self.delay_s = tokenizer, replies, eos, delay_s
        self.cleanup_s = cleanup_s  # a request's own cleanup once it ends (an HTTP connection closing)
        self.fail_adapter = fail_adapter
        self.calls, self.events = [], []
        self.in_flight = self.peak_in_flight = 0
        self.eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, input_ids, params, adapter=None, on_first_token=None):
        i = len(self.calls)
        self.calls.append({"input_ids": list(input_ids), "n": params.n, "max_new": params.max_new_tokens,
                           "streamed": on_first_token is not None})
        self.events.append(("send", i, time.perf_counter()))
        if adapter == self.fail_adapter and adapter is not None:
            raise RuntimeError(f"400 unknown adapter {adapter}")
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            self.events.append(("first", i, time.perf_counter()))
            if on_first_token is not None:
                on_first_token()
            await asyncio.sleep(self.delay_s)
            return [self._gen(i, k, input_ids, params) for k in range(params.n)]
        finally:
            if self.cleanup_s:
                await asyncio.sleep(self.cleanup_s)
            self.in_flight -= 1

    def _gen(self, i, k, input_ids, params):
        text = self.replies[(i + k) % len(self.replies)]
        ids = self.tok.encode(text, add_special_tokens=False)[: params.max_new_tokens]
        finish = "length" if len(ids) == params.max_new_tokens else "stop"
        if self.eos and finish == "stop":
            ids = ids + [self.eos_id]
        lps = [-0.5 - 0.01 * j for j in range(len(ids))]
        return Generation(ids, lps, len(input_ids), len(input_ids) // 2, finish, self.tok.decode(
            ids, skip_special_tokens=True), e2e_s=0.0)


@dataclass
class StepResult:
    messages: list[dict]
    reward: float | None
    done: bool


@dataclass
class ScriptedEnv:
    turns: int
    reward: object = 1.0
    seed: int = 0
    played: int = 0
    replies: list[str] = field(default_factory=list)

    def reset(self):
        return [{"role": "system", "content": "answer sums"},
                {"role": "user", "content": f"what is {self.seed} plus 1"}]

    def step(self, reply):
        self.replies.append(reply)
        self.played += 1
        if self.played >= self.turns:
            if isinstance(self.reward, Exception):
                raise self.reward
            return StepResult([], self.reward, True)
        return StepResult([{"role": "user", "content": f"wrong, again {self.played}"}], None, False)


@dataclass
class ScriptedTask:
    turns: int = 1
    reward: object = 1.0
    max_turns: int = 5
    max_new_tokens: int = 8
    name: str = "scripted"

    def make_env(self, seed):
        return ScriptedEnv(self.turns, self.reward, seed)


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------------ tokenisation

def test_model_segments_are_the_runs_of_model_tokens():
    mask = [0, 0, 1, 1, 0, 1, 0, 0, 1]
    traj = Trajectory(messages=[], token_ids=list(range(len(mask))), completion_mask=mask, logprobs=[0.0] * len(mask))
    assert traj.model_segments() == [(2, 4), (5, 6), (8, 9)]
    assert Trajectory(messages=[], token_ids=[1], completion_mask=[0], logprobs=[0.0]).model_segments() == []


def test_env_suffix_canonical_reply_uses_full_rendering(chatml_tokenizer):
    tok = chatml_tokenizer
    msgs = [{"role": "user", "content": "what is 3 plus 4"}]
    prompt = render_ids(tok, msgs, add_generation_prompt=True)
    reply = tok.encode("answer 7", add_special_tokens=False)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    convo = msgs + [{"role": "assistant", "content": "answer 7"}]
    new = [{"role": "user", "content": "wrong again"}]
    full = render_ids(tok, convo + new, add_generation_prompt=True)
    for output in (reply + [eos], reply):  # with and without the eos in the server output
        for reply_ids in (None, output):
            ids, fallback = env_suffix_ids(tok, prompt + output, convo, new, reply_ids)
            assert not fallback
            assert prompt + output + ids == full
    assert turn_end_text(tok, msgs) == "<|im_end|>\n"


def test_env_suffix_noncanonical_reply_falls_back_to_text(chatml_tokenizer):
    tok = chatml_tokenizer
    msgs = [{"role": "user", "content": "what is 3 plus 4"}]
    prompt = render_ids(tok, msgs, add_generation_prompt=True)
    chars = [tok.convert_tokens_to_ids(c) for c in "the"]  # not how BPE would split "the"
    assert tok.encode("the", add_special_tokens=False) != chars
    convo = msgs + [{"role": "assistant", "content": "the"}]
    new = [{"role": "user", "content": "wrong again"}]
    ids, fallback = env_suffix_ids(tok, prompt + chars, convo, new)
    assert fallback
    assert env_suffix_ids(tok, prompt + chars, convo, new, reply_ids=chars) == (ids, True)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert ids[0] == eos  # the closing token the server did not send
    full_text = tok.decode(render_ids(tok, convo + new, add_generation_prompt=True))
    assert tok.decode(prompt + chars + ids) == full_text


def test_multi_turn_tokens_mask_and_logprobs(chatml_tokenizer):
    tok = chatml_tokenizer
    replies = ["answer 4", "the sum is 4", "4"]
    client = FakeClient(tok, replies, eos=True)
    task = ScriptedTask(turns=3)
    [group] = run(collect_groups(client, task, tok, [3], 1, FakeParams(max_new_tokens=16),
                                 schedule="naive"))
    [t] = group.trajectories
    assert t.error is None and t.reward == 1.0 and t.turns == 3
    assert len(t.token_ids) == len(t.completion_mask) == len(t.logprobs)
    prompt = render_ids(tok, ScriptedEnv(3, seed=3).reset(), add_generation_prompt=True)
    assert t.token_ids[: t.prompt_len] == prompt and t.prompt_len == len(prompt)
    model_ids = [i for i, m in zip(t.token_ids, t.completion_mask) if m]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(model_ids, skip_special_tokens=True) == "".join(replies)
    assert model_ids.count(eos) == 3  # the server's eos is a model token (mask 1)
    # every later request is exactly the history so far, so the prefix cache can serve it
    assert client.calls[1]["input_ids"] == t.token_ids[: len(client.calls[1]["input_ids"])]
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.completion_mask) if not m)
    assert [lp for lp, m in zip(t.logprobs, t.completion_mask) if m][:2] == [-0.5, -0.51]
    assert t.prompt_tokens == sum(len(c["input_ids"]) for c in client.calls)
    assert t.finish_reasons == ["stop"] * 3
    assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "user", "assistant",
                                               "user", "assistant"]


def test_reply_without_eos_gets_closing_tokens_masked(chatml_tokenizer):
    tok = chatml_tokenizer
    client = FakeClient(tok, ["answer 4"], eos=False)
    [group] = run(collect_groups(client, ScriptedTask(turns=2), tok, [1], 1, FakeParams(16),
                                 schedule="naive"))
    [t] = group.trajectories
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    first_model_end = t.prompt_len + len(tok.encode("answer 4", add_special_tokens=False))
    assert t.token_ids[first_model_end] == eos and t.completion_mask[first_model_end] == 0
    assert t.logprobs[first_model_end] == 0.0


# ------------------------------------------------------------------------------ failures

@pytest.mark.parametrize("reward", [ValueError("reward fn broke"), None, float("nan")])
def test_bad_reward_is_recorded_not_raised(chatml_tokenizer, reward):
    client = FakeClient(chatml_tokenizer, ["answer 4"])
    groups = run(collect_groups(client, ScriptedTask(reward=reward), chatml_tokenizer, [0, 1], 3,
                                FakeParams()))
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 6 and all(t.error and not t.valid for t in trajs)
    assert all(sum(t.completion_mask) > 0 for t in trajs)  # the tokens are still there to inspect
    assert rollout_stats(groups)["failed"] == 6


def test_request_failure_is_recorded(chatml_tokenizer):
    client = FakeClient(chatml_tokenizer, ["answer 4"], fail_adapter="nope")
    groups = run(collect_groups(client, ScriptedTask(), chatml_tokenizer, [0], 4, FakeParams(),
                                adapter="nope"))
    assert all("unknown adapter" in t.error for t in groups[0].trajectories)
    assert groups[0].valid == []


def test_truncation_clamps_requests_and_cuts_episodes(chatml_tokenizer):
    tok = chatml_tokenizer
    task = ScriptedTask(turns=3)
    prompt_len = len(render_ids(tok, ScriptedEnv(3).reset(), add_generation_prompt=True))
    budget = prompt_len + 12
    client = FakeClient(tok, ["the sum is right again plus 4"], eos=True)
    [group] = run(collect_groups(client, task, tok, [0], 2, FakeParams(max_new_tokens=8),
                                 max_seq_tokens=budget))
    for t in group.trajectories:
        assert t.truncated and len(t.token_ids) <= budget and t.error is None
        assert t.reward == 0.0  # truncation_reward: cut before the env finished
    assert all(c["max_new"] <= budget - len(c["input_ids"]) for c in client.calls)
    assert rollout_stats([group])["truncated"] == 2
    [group] = run(collect_groups(FakeClient(tok, ["4"]), task, tok, [0], 1, FakeParams(),
                                 max_seq_tokens=prompt_len))
    assert "no room" in group.trajectories[0].error


# ------------------------------------------------------------------------------ schedules

def _times(client, event):
    return {i: t for e, i, t in client.events if e == event}


def test_prefix_schedule_releases_followers_at_leader_first_token(chatml_tokenizer):
    client = FakeClient(chatml_tokenizer, ["4"], delay_s=0.02)
    groups = run(collect_groups(client, ScriptedTask(), chatml_tokenizer, [0, 1], 4, FakeParams(),
                                schedule="prefix"))
    assert all(len(g.valid) == 4 for g in groups)
    sends, firsts = _times(client, "send"), _times(client, "first")
    leaders = [i for i, c in enumerate(client.calls) if c["streamed"]]
    assert len(leaders) == 2 and leaders == [0, 1]  # both groups' leaders go out first, together
    for i, c in enumerate(client.calls):
        if i not in leaders:
            leader = next(j for j in leaders if client.calls[j]["input_ids"] == c["input_ids"])
            assert sends[i] >= firsts[leader]


def test_prefix_sync_waits_for_every_leader(chatml_tokenizer):
    client = FakeClient(chatml_tokenizer, ["4"], delay_s=0.02)
    run(collect_groups(client, ScriptedTask(), chatml_tokenizer, [0, 1, 2], 3, FakeParams(),
                       schedule="prefix_sync"))
    sends, firsts = _times(client, "send"), _times(client, "first")
    leaders = [i for i, c in enumerate(client.calls) if c["streamed"]]
    followers = [i for i in sends if i not in leaders]
    assert len(leaders) == 3 and len(followers) == 6
    assert min(sends[i] for i in followers) >= max(firsts[j] for j in leaders)


@pytest.mark.parametrize("schedule,requests", [("naive", 8), ("n", 2), ("prefix_n", 4), ("prefix", 8)])
def test_schedule_request_counts(chatml_tokenizer, schedule, requests):
    client = FakeClient(chatml_tokenizer, ["4", "5", "6"])
    groups = run(collect_groups(client, ScriptedTask(), chatml_tokenizer, [0, 1], 4, FakeParams(),
                                schedule=schedule))
    assert len(client.calls) == requests
    assert [len(g.valid) for g in groups] == [4, 4]
    assert sum(c["n"] for c in client.calls) == 8


def test_schedules_are_listed_and_checked(chatml_tokenizer):
    assert set(SCHEDULES) == {"naive", "prefix", "prefix_sync", "prefix_n", "n"}
    with pytest.raises(ValueError, match="unknown schedule"):
        run(collect_groups(FakeClient(chatml_tokenizer, ["4"]), ScriptedTask(), chatml_tokenizer,
                           [0], 2, FakeParams(), schedule="eager"))


def test_concurrency_bounds_requests_in_flight(chatml_tokenizer):
    client = FakeClient(chatml_tokenizer, ["4"], delay_s=0.01)
    run(collect_groups(client, ScriptedTask(), chatml_tokenizer, [0, 1, 2], 4, FakeParams(),
                       schedule="naive", concurrency=3))
    assert len(client.calls) == 12 and client.peak_in_flight == 3


@pytest.mark.parametrize("turns", [1, 2, 3])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_rollout_cancelled_before_its_members_start_leaves_no_request_or_coroutine(chatml_tokenizer, schedule,
                                                                                      turns):
    # stop() during a step cancels its rollouts, possibly in the loop turn where the groups were
    # just submitted: an n-sample request left running, or a member's first turn never awaited
    # ("coroutine '_pick' was never awaited" in CI), is work and a warning outliving the step
    import gc
    import warnings

    client = FakeClient(chatml_tokenizer, ["4"], delay_s=0.05, cleanup_s=0.05)

    async def go():
        collect = asyncio.ensure_future(collect_groups(client, ScriptedTask(), chatml_tokenizer, [0, 1], 4,
                                                       FakeParams(), schedule=schedule))
        for _ in range(turns):  # 2: the groups are submitted, their members not started yet
            await asyncio.sleep(0)
        collect.cancel()
        await asyncio.wait([collect])
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        left = run(go())
        gc.collect()
    assert left == []  # asyncio.run would cancel them at its end; inside a step they would run on
    assert client.in_flight == 0  # and every request had ended, its cleanup too, when the rollout returned
    assert not [str(w.message) for w in caught if "never awaited" in str(w.message)]


# ------------------------------------------------------------------------------ CPU engine

@pytest.fixture(scope="module")
def cpu_engine(tmp_path_factory, tiny_model_dir):
    """(client factory, tokenizer) of a real CPU engine subprocess serving the tiny model."""
    from transformers import AutoTokenizer

    from artsg_nb.serving.server import ServerConfig, start_server

    model = str(tiny_model_dir)
    server = start_server(ServerConfig(engine="cpu", model_path=model,
                                       run_dir=tmp_path_factory.mktemp("rollout-engine")))
    yield server, AutoTokenizer.from_pretrained(model)
    server.stop()


def _collect(server, *args, **kwargs):
    async def go():
        async with server.client() as client:
            return await collect_groups(client, *args, **kwargs)
    return run(go())


def _params(task, **kw):
    from artsg_nb.engines import SamplingParams

    return SamplingParams(max_new_tokens=task.max_new_tokens, **kw)


def test_engine_single_turn_groups(cpu_engine):
    from artsg_nb.tasks.registry import get_task

    server, tok = cpu_engine
    task = get_task("addition")
    groups = _collect(server, task, tok, [1, 2], 4, _params(task))
    assert [g.seed for g in groups] == [1, 2]
    for g in groups:
        assert len(g.valid) == 4
        prompts = {tuple(t.token_ids[: t.prompt_len]) for t in g.trajectories}
        assert len(prompts) == 1  # one seed, one opening prompt
        for t in g.trajectories:
            model_ids = [i for i, m in zip(t.token_ids, t.completion_mask) if m]
            assert t.turns == 1 and len(model_ids) == len(t.token_ids) - t.prompt_len
            assert tok.decode(model_ids, skip_special_tokens=True) == t.messages[-1]["content"]
            assert t.prompt_tokens == t.prompt_len and 0 <= t.cached_tokens < t.prompt_len


def test_engine_multi_turn_tokens_are_the_servers(cpu_engine):
    from artsg_nb.tasks.registry import get_task

    server, tok = cpu_engine
    task = get_task("guess_number")
    groups = _collect(server, task, tok, [5], 3, _params(task))
    trajs = groups[0].trajectories
    assert all(t.error is None for t in trajs) and max(t.turns for t in trajs) > 1
    t = max(trajs, key=lambda t: t.turns)
    replies = [m["content"] for m in t.messages if m["role"] == "assistant"]
    model_ids = [i for i, m in zip(t.token_ids, t.completion_mask) if m]
    assert tok.decode(model_ids, skip_special_tokens=True) == "".join(replies)
    assert t.cached_tokens > 0  # later turns extend the cached history

    async def score():
        async with server.client() as client:
            return await client.score(t.token_ids)
    scored = run(score())  # log p(token_i | tokens_<i), re-computed by the server in one prefill
    for i, m in enumerate(t.completion_mask):
        if m:
            assert t.logprobs[i] == pytest.approx(scored[i - 1], abs=2e-3)
        else:
            assert t.logprobs[i] == 0.0


class _FlakyTask:
    """Wraps a task; every other env's reward function raises."""

    def __init__(self, task):
        self.task, self.made, self.max_turns = task, 0, task.max_turns

    def make_env(self, seed):
        env = self.task.make_env(seed)
        self.made += 1
        if self.made % 2 == 0:
            env.step = lambda reply: (_ for _ in ()).throw(ZeroDivisionError("reward fn bug"))
        return env


def test_engine_failures_are_recorded(cpu_engine):
    from artsg_nb.tasks.registry import get_task

    server, tok = cpu_engine
    task = get_task("addition")
    [group] = _collect(server, _FlakyTask(task), tok, [3], 4, _params(task))
    assert len(group.valid) == 2
    assert [t.error for t in group.trajectories if t.error] == [
        "EnvError: env.step of task '_FlakyTask' raised ZeroDivisionError: reward fn bug"] * 2  # named as the env's
    groups = _collect(server, task, tok, [3], 2, _params(task), adapter="no-such-adapter")
    errors = [t.error for t in groups[0].trajectories]
    assert all(e and "no-such-adapter" in e for e in errors) and groups[0].valid == []


class _NeverDone:
    """guess_number's prompt, but no reply ends the episode (a right first guess would, 1 in 9)."""

    def __init__(self, seed: int):
        from artsg_nb.tasks.registry import get_task
        self.prompt = get_task("guess_number").make_env(seed).reset()

    def reset(self):
        return self.prompt

    def step(self, reply: str):
        from artsg_nb.tasks.registry import StepResult
        return StepResult(messages=[{"role": "user", "content": "Again."}], reward=None, done=False)


def test_engine_truncation(cpu_engine):
    from artsg_nb.tasks.registry import get_task

    server, tok = cpu_engine
    task = replace(get_task("guess_number"), factory=_NeverDone)
    prompt_len = len(render_ids(tok, task.make_env(0).reset(), add_generation_prompt=True))
    budget = prompt_len + 12
    groups = _collect(server, task, tok, [0], 2, _params(task, ignore_eos=True), max_seq_tokens=budget)
    for t in groups[0].trajectories:
        assert t.truncated and len(t.token_ids) <= budget and t.reward == 0.0


def test_engine_prefix_schedule_hit_rate(cpu_engine):
    """The CPU engine runs one prefill at a time (each finished prefill is in the radix cache
    before the next starts), so even "naive" reaches the theoretical hit rate there; on SGLang,
    which batches identical prompts into one prefill, only the prefix schedules do."""
    from artsg_nb.serving.metrics import theoretical_hit_rate
    from artsg_nb.tasks.registry import get_task

    server, tok = cpu_engine
    task = get_task("addition")
    rates = {}
    for schedule in ("naive", "prefix", "n"):
        async def go():
            async with server.client() as client:
                await client.flush_cache()
                return await collect_groups(client, task, tok, [7, 8], 4, _params(task), schedule=schedule)
        groups = run(go())
        rates[schedule] = rollout_stats(groups)["hit_rate"]
        assert rates[schedule] >= 0.98 * theoretical_hit_rate(groups), rates
    assert rates["prefix"] >= rates["naive"] - 0.02, rates
