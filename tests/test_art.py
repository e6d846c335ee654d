"""artsg_nb.art: ART's trajectories as token-exact ones, and SGLangBackend training a real
art.TrainableModel through the CPU engine with a rollout written the way ART's docs write one."""
import asyncio
import subprocess
import sys

import pytest

art = pytest.importorskip("art")

from openai import AsyncOpenAI  # noqa: E402
from openai.types.chat.chat_completion import Choice  # noqa: E402

from artsg_nb.art import ArtVersionError, SGLangBackend, UnsupportedTrajectory  # noqa: E402
from artsg_nb.art.convert import to_groups, to_trajectory  # noqa: E402
from artsg_nb.rl.lora import version_steps  # noqa: E402
from artsg_nb.run.config import RunConfig  # noqa: E402
from artsg_nb.tasks.registry import get_task  # noqa: E402


def test_import_artsg_nb_does_not_import_art():
    code = "import sys, artsg_nb, artsg_nb.run.session; print('art' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def _choice(tokenizer, ids, content=None, logprob=-0.5, **extra):
    """A Choice as SGLang's chat route returns it (logprob entries name each token by its text)."""
    entries = [{"token": tokenizer.decode([i]), "logprob": logprob, "bytes": None, "top_logprobs": []} for i in ids]
    return Choice.model_validate({
        "index": 0, "finish_reason": "stop", "logprobs": {"content": entries},
        "message": {"role": "assistant", "content": content if content is not None else tokenizer.decode(ids)},
        **extra})


def _meta(ids, logprob=-0.5):
    """SGLang's meta_info of a chat choice asked with return_meta_info and logprobs."""
    return {"id": "x", "output_token_logprobs": [[logprob, i, None] for i in ids]}


def test_a_single_turn_trajectory_is_the_prompt_then_the_servers_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = tok.encode("5", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    traj = art.Trajectory(messages_and_choices=[*messages, _choice(tok, reply, "5")], reward=1.0)
    ours = to_trajectory(traj, tok, "policy-step-0")
    prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    assert ours.token_ids == prompt + reply and ours.prompt_len == len(prompt)
    assert ours.completion_mask == [0] * len(prompt) + [1] * len(reply)
    assert ours.logprobs[len(prompt):] == [-0.5] * len(reply) and ours.reward == 1.0 and ours.valid


def test_server_token_ids_are_used_as_sent_and_multi_turn_keeps_env_messages(tiny_tokenizer):
    tok = tiny_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    first, second = [100, 200, end], [300, 301]  # ids the text lookup could not give: the server's are used
    messages = [{"role": "user", "content": "hi"}]
    c1 = _choice(tok, first, "x", meta_info=_meta(first), prompt_token_ids=[1, 2, 3])  # SGLang's fields
    c2 = _choice(tok, second, "y", token_ids=second)  # vLLM's
    traj = art.Trajectory(messages_and_choices=[*messages, c1, {"role": "user", "content": "again"}, c2,
                                                {"role": "user", "content": "ignored: after the last reply"}],
                          reward=0.5)
    ours = to_trajectory(traj, tok, None)
    assert ours.token_ids[:3] == [1, 2, 3] and ours.token_ids[3:6] == first
    env = tok.encode("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert ours.token_ids[6:] == env + second, "the template's <|im_end|> after the reply is the model's own"
    assert ours.completion_mask == [0] * 3 + [1] * 3 + [0] * len(env) + [1] * 2
    assert ours.turns == 2 and ours.messages[-1] == {"role": "assistant", "content": "y"}


def test_unscoreable_trajectories_are_errors_naming_the_trajectory(tiny_tokenizer):
    tok = tiny_tokenizer
    messages = [{"role": "user", "content": "hi"}]
    five = tok.encode("5", add_special_tokens=False)
    good = art.Trajectory(messages_and_choices=[*messages, _choice(tok, five)], reward=1.0)
    no_logprobs = _choice(tok, five).model_copy(update={"logprobs": None})
    bad = art.Trajectory(messages_and_choices=[*messages, no_logprobs], reward=0.0)
    with pytest.raises(UnsupportedTrajectory, match=r"group 1, trajectory 1, reply 0 .*no logprobs.*logprobs=True"):
        to_groups([art.TrajectoryGroup([good, good]), art.TrajectoryGroup([good, bad])], tok, None)
    tool = _choice(tok, five).model_copy(deep=True)
    tool.message.tool_calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(UnsupportedTrajectory, match="trajectory 0, reply 0 .*tool calls"):
        to_groups([art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*messages, tool], reward=1.0)])], tok, None)
    with pytest.raises(UnsupportedTrajectory, match="no Choice"):
        to_trajectory(art.Trajectory(messages_and_choices=[*messages, {"role": "assistant", "content": "x"}]), tok, None)


def test_a_token_string_several_tokens_decode_to_needs_the_ids_or_the_resolver(tiny_tokenizer):
    tok = tiny_tokenizer
    same = [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"]
    assert len(same) > 1, "the tiny tokenizer has byte tokens that decode to U+FFFD alone"
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, _choice(tok, [same[1]])])
    with pytest.raises(UnsupportedTrajectory, match="return_meta_info"):
        to_trajectory(traj, tok, None)
    [group] = to_groups([art.TrajectoryGroup([traj, traj])], tok, None)  # left out, as failed rollouts are
    assert [t.error.startswith("AmbiguousTokens") for t in group.trajectories] == [True, True]
    asked = []
    ours = to_trajectory(traj, tok, None, resolve=lambda prefix, cands, lp, where: asked.append(cands) or same[1])
    assert ours.token_ids[-1] == same[1] and asked == [same]


def test_register_refuses_an_untested_art_version(monkeypatch, tmp_path):
    import artsg_nb.art.backend as backend_module

    monkeypatch.setattr(backend_module, "version", lambda name: "0.4.0")
    model = art.TrainableModel(name="m", project="p", base_model="unused")
    with pytest.raises(ArtVersionError, match=r"openpipe-art 0.4.0 .* tested with 0.5.18.*pip install openpipe-art==0.5.18"):
        asyncio.run(model.register(SGLangBackend(path=str(tmp_path))))


def test_the_managed_client_asks_for_token_ids_only_where_the_server_accepts_them():
    """SGLang refuses return_meta_info / return_prompt_token_ids on a streamed request, and a
    request without logprobs trains nothing: only a plain one with logprobs asks for ids."""
    from artsg_nb.art.backend import _AskingForTokenIds
    from artsg_nb.engines.sglang import SPEC

    sent = []

    class Completions:
        async def create(self, **kwargs):
            sent.append(kwargs.get("extra_body"))

    class Client:
        chat = type("Chat", (), {"completions": Completions(), "other": 1})()

        def with_options(self, **kwargs):
            return self

    client = _AskingForTokenIds(Client(), SPEC.chat_token_ids)
    for kwargs in ({"logprobs": True}, {"logprobs": True, "stream": True}, {},
                   {"logprobs": True, "extra_body": {"top_k": 5}}):
        asyncio.run(client.with_options(timeout=1).chat.completions.create(model="m", messages=[], **kwargs))
    ids = {"return_meta_info": True, "return_prompt_token_ids": True}
    assert sent == [ids, None, None, {**ids, "top_k": 5}] and client.chat.other == 1


class _AdapterClient:
    """The engine client calls a lease makes, recorded; the adapters it holds."""

    served_model = "base"

    def __init__(self):
        self.loaded, self.calls = set(), []

    async def load_adapter(self, name, path):
        assert name not in self.loaded, f"{name} loaded twice"
        self.loaded.add(name)
        self.calls.append(("load", name, path))

    async def unload_adapter(self, name):
        self.loaded.remove(name)
        self.calls.append(("unload", name))


def _registered(tmp_path, steps: int):
    """A backend with model "m" registered on a stand-in run whose newest step is `steps`."""
    from types import SimpleNamespace

    from artsg_nb.art.leases import AdapterLeases

    for step in range(steps + 1):
        folder = tmp_path / "adapters" / f"policy-step-{step}"
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"")
    client = _AdapterClient()
    backend = SGLangBackend(path=str(tmp_path))
    backend._runs["m"] = SimpleNamespace(run_dir=tmp_path, client=client, adapter=f"policy-step-{steps}", step=steps,
                                         adapter_prefix="policy")
    backend._leases["m"] = AdapterLeases(tmp_path)
    model = art.TrainableModel(name="m", project="p", base_model="unused")
    model._backend = backend
    return backend, model, client


def test_an_exact_adapter_lease_serves_its_step_to_its_holders_until_the_last_leaves(tmp_path):
    """ART 0.5.23's Backend.exact_adapter_lease: the older step's adapter is loaded under a name of
    its own while held, get_inference_name() names it only inside the lease (a concurrent task
    outside sees the newest), two holders share one load, and the last one out unloads it."""
    backend, model, client = _registered(tmp_path, steps=3)

    async def main():
        inside, outside = asyncio.Event(), asyncio.Event()
        names = {}

        async def holder(key):
            async with backend.exact_adapter_lease(model, 1):
                names[key] = (model.get_inference_name(), model.get_inference_name(step=1))
                inside.set()
                await outside.wait()
            names[key + " after"] = model.get_inference_name()

        async def bystander():
            await inside.wait()
            names["bystander"] = model.get_inference_name()
            with pytest.raises(ValueError, match="exact_adapter_lease"):
                model.get_inference_name(step=1)
            outside.set()

        await asyncio.gather(holder("a"), holder("b"), bystander())
        return names

    names = asyncio.run(main())
    assert names["a"] == names["b"] == ("base:policy-step-1-lease", "base:policy-step-1-lease")
    assert names["bystander"] == names["a after"] == "base:policy-step-3"
    assert [c[:2] for c in client.calls] == [("load", "policy-step-1-lease"), ("unload", "policy-step-1-lease")]
    assert client.calls[0][2] == str((tmp_path / "adapters" / "policy-step-1").resolve())


def test_a_leased_step_keeps_its_files_and_a_step_without_files_is_refused(tmp_path):
    backend, model, client = _registered(tmp_path, steps=3)
    backend._runs["m"].served_step = 3
    backend._runs["m"].wait_for_checkpoint = lambda: None

    async def main():
        async with backend.exact_adapter_lease(model, 1):
            await backend._delete_checkpoint_files(model, steps_to_keep=[])
            assert (tmp_path / "adapters" / "policy-step-1").exists(), "a leased step's adapter was deleted"
        assert not (tmp_path / "adapters" / "policy-step-2").exists()
        with pytest.raises(ValueError, match=r"step 2 has no saved adapter .* \[1, 3\]"):
            async with backend.exact_adapter_lease(model, 2):
                pass
        with pytest.raises(ValueError, match=r"step 7 of 'm' does not exist \(its steps: 0..3\)"):
            async with backend.exact_adapter_lease(model, 7):
                pass

    asyncio.run(main())
    assert client.loaded == set()


TASK = get_task("addition")  # the tiny model's pretraining leaves a habit GRPO removes in a few steps


async def rollout(model: art.TrainableModel, scenario: int) -> art.Trajectory:
    """ART's rollout shape: the model's base URL, key and inference name, the Choice appended."""
    env = TASK.make_env(scenario)
    messages = env.reset()
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    completion = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                      max_tokens=TASK.max_new_tokens, logprobs=True)
    choice = completion.choices[0]
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=env.step(choice.message.content or "").reward)


@pytest.mark.slow
def test_sglang_backend_trains_an_art_model_and_serves_the_trained_adapter(tiny_model_dir, tmp_path):
    steps, groups_per_step, group_size = 5, 8, 8

    async def main():
        backend = SGLangBackend(path=str(tmp_path / ".art"), config=RunConfig(engine="cpu", verbose=False, verify_every=1))
        model = art.TrainableModel(name="adder", project="art-test", base_model=str(tiny_model_dir))
        await model.register(backend)
        try:
            served = backend.run(model).client.served_model
            assert model.get_inference_name() == f"{served}:policy-step-0"
            rewards, results = [], []
            for i in range(await model.get_step(), steps):
                groups = await art.gather_trajectory_groups(
                    (art.TrajectoryGroup(rollout(model, 1000 * i + s) for _ in range(group_size))
                     for s in range(groups_per_step)), pbar_desc=None)
                result = await backend.train(model, groups, learning_rate=3e-3)
                await model.log(groups, metrics=result.metrics, step=result.step, split="train")
                rewards.append(sum(t.reward for g in groups for t in g.trajectories) / (groups_per_step * group_size))
                results.append(result)
                # The adapter just trained is the one served, and the one the next rollouts ask for.
                run = backend.run(model)
                assert result.step == i + 1 and model.get_inference_name() == f"{served}:{run.adapter}"
                assert set(await run.client.list_adapters()) == {run.adapter}
                if not result.metrics.get("update_skipped"):  # a step without signal keeps the adapter
                    assert run.adapter == f"policy-step-{i + 1}"
                    assert result.metrics["probe_mad"] < 0.02, "the served adapter is not the trained one"
            with pytest.raises(ValueError, match="only the newest adapter"):
                model.get_inference_name(step=1)
            # An older step served under a lease (ART 0.5.23's exact_adapter_lease), then unloaded.
            run = backend.run(model)
            old = min(version_steps(run.run_dir / "adapters"))
            async with backend.exact_adapter_lease(model, old):
                assert model.get_inference_name() == f"{served}:policy-step-{old}-lease"
                assert set(await run.client.list_adapters()) == {run.adapter, f"policy-step-{old}-lease"}
                leased = await rollout(model, 7)
                assert leased.messages_and_choices[-1].logprobs is not None
            assert set(await run.client.list_adapters()) == {run.adapter}
            # ART's managed client asks the server for token ids: the trajectory uses them as sent.
            messages = TASK.make_env(7).reset()
            completion = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=TASK.max_new_tokens, logprobs=True)
            choice = completion.choices[0]
            ids = [t[1] for t in choice.model_extra["meta_info"]["output_token_logprobs"]]
            ours = to_trajectory(art.Trajectory(messages_and_choices=[*messages, choice]), backend.run(model).trainer.tokenizer, None)
            assert ours.token_ids == choice.model_extra["prompt_token_ids"] + ids
            return rewards, results
        finally:
            await backend.close()

    rewards, results = asyncio.run(main())
    first, late = rewards[0], sum(rewards[-3:]) / 3
    assert late >= first + 0.15, f"reward should rise: {[round(r, 3) for r in rewards]}"
    assert results[-1].checkpoint_path.endswith("artsg_nb/adapters/policy-step-5")
    history = tmp_path / ".art" / "art-test" / "models" / "adder" / "history.jsonl"
    assert len(history.read_text().splitlines()) == steps, "model.log wrote ART's own history beside our run"
