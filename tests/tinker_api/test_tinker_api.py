"""artsg_nb.tinker: the real `tinker` client trains and samples through the local server — a
MultiTrainer on the tiny model and the CPU engine — and a request the server cannot serve is an
error that names what it can."""
import math
import os

import pytest

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")  # the client would report its own events to our server

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from tinker import types  # noqa: E402

from artsg_nb.serving.server import ServerConfig, start_server  # noqa: E402
from artsg_nb.tinker import TinkerServer, TinkerService  # noqa: E402
from artsg_nb.multi.losses import Datum  # noqa: E402
from artsg_nb.multi.trainer import LoraSpec, MultiTrainer  # noqa: E402
from artsg_nb.tinker.wire import fwdbwd_from_proto, fwdbwd_output_proto, sample_response_proto  # noqa: E402


# ---- the wire formats, against the client's own converters ------------------------------------
def test_a_forward_backward_body_reads_back_as_the_client_wrote_it():
    from tinker.proto.request_conv import forward_backward_request_to_proto

    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "logprobs": [0.0, -0.5, -1.25],
                                        "advantages": [0.0, 1.0, 1.0]})
    request = types.ForwardBackwardRequest(model_id="m", seq_id=3, forward_backward_input=types.ForwardBackwardInput(
        data=[datum], loss_fn="importance_sampling"))
    req = fwdbwd_from_proto(forward_backward_request_to_proto(request).SerializeToString())
    assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == ("m", 3, "importance_sampling", False)
    assert req.data == [Datum(input_tokens=[5, 6, 7], target_tokens=[6, 7, 8], weights=[1.0, 1.0, 1.0],
                              advantages=[0.0, 1.0, 1.0], logprobs=[0.0, -0.5, -1.25])]


def test_results_read_back_with_the_clients_deserializers():
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    out = deserialize_forward_backward_output(fwdbwd_output_proto({"logprobs": [[-1.0, -2.0], [-0.5]]}, 2,
                                                                  {"loss:sum": 3.5}))
    assert [d["logprobs"].tolist() for d in out.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert out.metrics == {"loss:sum": 3.5}
    resp = deserialize_sample_response(sample_response_proto([("stop", [4, 2], [-0.25, -1.5]), ("length", [9], [-3.0])],
                                                             [None, -2.0]))
    assert [(s.stop_reason, s.tokens, s.logprobs) for s in resp.sequences] == [
        ("stop", [4, 2], [-0.25, -1.5]), ("length", [9], [-3.0])]
    assert resp.prompt_logprobs == [None, -2.0]


class _Trainer:
    """The trainer calls a session's lifecycle makes, recorded."""

    lora = LoraSpec(rank=16)

    def __init__(self):
        self.added, self.removed = [], []

    def add(self, name, lora, learning_rate, seed):
        self.added.append(name)

    def remove(self, name):
        self.removed.append(name)


def test_a_session_that_stops_sending_is_finished_and_its_models_removed(tmp_path):
    """A client that dies without closing (no heartbeats) does not hold its adapters forever; a
    session that keeps sending heartbeats stays."""
    from waiting import wait_until

    trainer = _Trainer()
    service = TinkerService(trainer, sampler=None, base_model="base", root=tmp_path)
    with TinkerServer(service, session_idle_s=1.0) as api, \
            httpx.Client(base_url=api.base_url, headers={"X-API-Key": api.api_key}, timeout=30) as http:
        def new_model() -> tuple[str, str]:
            session = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "t"}).json()["session_id"]
            body = {"session_id": session, "base_model": "base", "lora_config": {"rank": 4}}
            request_id = http.post("/api/v1/create_model", json=body).json()["request_id"]
            result = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
            return session, result["model_id"]

        (dead, dead_model), (live, live_model) = new_model(), new_model()
        wait_until(lambda: http.post("/api/v1/session_heartbeat", json={"session_id": live}).status_code == 200
                   and trainer.removed, timeout_s=30, what="the silent session's model removed")
        assert trainer.added == [dead_model, live_model] and trainer.removed == [dead_model]
        assert http.post("/api/v1/session_heartbeat", json={"session_id": dead}).status_code == 404
        assert http.post("/api/v1/session_heartbeat", json={"session_id": live}).status_code == 200


# ---- the client against the local runtime -------------------------------------------------------
@pytest.fixture(scope="module")
def runtime(tiny_model_dir, tmp_path_factory):
    """One CPU engine, one trainer and the Tinker API over both, for the module's tests."""
    root = tmp_path_factory.mktemp("tinker")
    server = start_server(ServerConfig(engine="cpu", model_path=str(tiny_model_dir), run_dir=str(root / "engine"),
                                       max_lora_rank=16, max_loras_per_batch=8))
    trainer = MultiTrainer(str(tiny_model_dir), lora=LoraSpec(rank=16), device="cpu", max_grad_norm=math.inf)
    service = TinkerService(trainer, server.client(), base_model=str(tiny_model_dir), root=root / "checkpoints",
                            aliases=("tiny",))
    try:
        with TinkerServer(service) as api:
            yield api, trainer, service
    finally:
        server.stop()


@pytest.fixture
def client(runtime):
    api = runtime[0]
    service_client = tinker.ServiceClient(base_url=api.base_url, api_key=api.api_key)
    yield service_client
    service_client.close("success").result(60)


def _prompt(tok, text: str) -> list[int]:
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok.encode(chat, add_special_tokens=False)


def _sft_datum(prompt: list[int], completion: list[int]) -> types.Datum:
    tokens = prompt + completion
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def test_training_changes_the_adapter_and_sampling_serves_the_saved_one(client, runtime):
    _, trainer, _ = runtime
    tc = client.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    tok = tc.get_tokenizer()
    prompt = _prompt(tok, "What is 2 + 3?")
    answer = tok.encode("5", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    datum = _sft_datum(prompt, answer)
    base_path = tc.save_weights_for_sampler(name="before").result().path
    losses = []
    for _ in range(5):
        fb = tc.forward_backward([datum], "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fb.result().metrics["loss:sum"])
        assert "grad_norm" in step.result().metrics
    losses.append(tc.forward([datum], "cross_entropy").result().metrics["loss:sum"])  # no update
    assert losses[-1] < losses[0] - 0.5, f"the answer's loss should fall: {losses}"
    assert trainer.step_of(tc.model_id) == 5

    path = tc.save_weights_for_sampler(name="after").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/after"
    sampler = client.create_sampling_client(model_path=path).result()
    resp = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3,
                          sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)).result()
    assert len(resp.sequences) == 3 and all(s.tokens and len(s.logprobs) == len(s.tokens) for s in resp.sequences)
    # The server samples from the trained adapter: its logprobs are the trainer's, not the base model's.
    full = prompt + answer
    served = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    before = client.create_sampling_client(model_path=base_path).result().compute_logprobs(
        types.ModelInput.from_ints(full)).result()
    ours = trainer.score(tc.model_id, full)
    assert served[0] is None and np.allclose(served[1:], ours, atol=2e-3)
    assert sum(served[-len(answer):]) > sum(before[-len(answer):]) + 0.5, "the 'after' adapter prefers the answer"
    seq = resp.sequences[0]
    np.testing.assert_allclose(seq.logprobs, trainer.score(tc.model_id, prompt + seq.tokens)[-len(seq.tokens):],
                               atol=2e-3)


def test_two_training_clients_train_their_own_adapter(client, runtime):
    _, trainer, service = runtime
    a = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    b = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    tok = a.get_tokenizer()
    prompt = _prompt(tok, "What is 1 + 1?")
    datum = _sft_datum(prompt, tok.encode("2", add_special_tokens=False))
    b_before = trainer.score(b.model_id, prompt)
    for _ in range(2):
        a.forward_backward([datum], "cross_entropy").result()
        a.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert trainer.score(b.model_id, prompt) == b_before, "b's adapter moved when a trained"
    assert trainer.score(a.model_id, prompt) != b_before
    b_sampler = b.save_weights_and_get_sampling_client().result()
    lp = b_sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    np.testing.assert_allclose(lp[1:], b_before, atol=2e-3)
    assert {m for m in (a.model_id, b.model_id)} <= set(service.models)


def test_a_custom_loss_runs_client_side_on_forward_and_a_weighted_cross_entropy(client, runtime):
    """forward_backward_custom (what ART's Tinker backend trains with): the client differentiates its
    own loss of the forward pass's logprobs and sends the gradient as cross_entropy weights."""
    import torch

    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    tok = tc.get_tokenizer()
    datum = _sft_datum(_prompt(tok, "What is 4 + 4?"), tok.encode("8", add_special_tokens=False))
    weights = torch.tensor(datum.loss_fn_inputs["weights"].data)

    def doubled_nll(data, logprobs_list):
        loss = sum(-2.0 * (lp * weights).sum() for lp in logprobs_list)
        return loss, {"doubled:sum": loss.detach().item()}

    plain = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    out = tc.forward_backward_custom([datum], doubled_nll).result()
    assert out.metrics["loss:sum"] == pytest.approx(2 * plain, rel=1e-4)
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(2 * plain, rel=1e-4), "weights = -dC/dlogp = 2w"
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert tc.forward([datum], "cross_entropy").result().metrics["loss:sum"] < plain


def test_requests_it_cannot_serve_say_what_is_supported(client, runtime):
    api = runtime[0]
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    datum = _sft_datum([1, 2, 3], [4])
    with pytest.raises(tinker.BadRequestError,
                       match="loss_fn='ppo' is not supported.*cross_entropy, importance_sampling"):
        tc.forward_backward([datum], "ppo").result(60)
    with pytest.raises(tinker.BadRequestError, match="needs loss_fn_inputs.*missing \\['advantages', 'logprobs'\\]"):
        tc.forward_backward([datum], "importance_sampling").result(60)
    sampler = client.create_sampling_client(base_model="tiny").result()
    with pytest.raises(tinker.BadRequestError, match="top_k.*supported: num_samples, max_tokens"):
        sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2, top_k=5)).result(60)
    with pytest.raises(Exception, match="base_model 'Qwen/Qwen3-8B' is not served here"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    with pytest.raises(Exception, match="rank 32 > the runtime's 16"):
        client.create_lora_training_client(base_model="tiny", rank=32).result()
    with httpx.Client(base_url=api.base_url, timeout=30) as http:
        wrong = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "x"}, headers={"X-API-Key": "no"})
        assert wrong.status_code == 401
        other = http.post("/api/v1/copy_weights", json={}, headers={"X-API-Key": api.api_key})
        assert other.status_code == 404 and "supported under /api/v1: create_session" in other.json()["detail"]


@pytest.mark.slow
def test_the_cookbook_rl_loop_runs_against_the_local_runtime(runtime, tiny_model_dir, capsys, monkeypatch):
    """The cookbook's RL loop, small (rl_loop.py), for 10 steps: every step samples from the
    adapter the step before trained, and the reward of the addition task rises."""
    from artsg_nb.tinker.rl_loop import main

    api, trainer, service = runtime
    steps, saved = [], set(service.checkpoints)
    optim_step = trainer.optim_step
    monkeypatch.setattr(trainer, "optim_step", lambda name, **kw: steps.append(name) or optim_step(name, **kw))
    rows = main(["--base-url", api.base_url, "--api-key", api.api_key, "--base-model", str(tiny_model_dir),
                 "--steps", "10", "--groups", "4", "--group-size", "6", "--learning-rate", "3e-3"])
    assert [r["step"] for r in rows] == list(range(10))
    [model_id] = {c.model_id for k, c in service.checkpoints.items() if k not in saved}
    trained = sum(r["datums"] > 0 for r in rows)
    assert steps == [model_id] * trained and trained >= 8, f"steps without signal: {rows}"
    assert len(set(service.checkpoints) - saved) == 10, "one sampler checkpoint per step"
    first, late = rows[0]["reward"], sum(r["reward"] for r in rows[-3:]) / 3
    assert late >= first + 0.15, f"reward should rise: {[round(r['reward'], 3) for r in rows]}"
    assert "step 9 | reward" in capsys.readouterr().out
    assert model_id not in service.models and model_id not in trainer.names, \
        "closing the client removes its model from the trainer"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_python_m_artsg_nb_tinker_serves_until_sigterm(tmp_path):
    """The command the README gives: it prints base_url and api_key, a client trains and samples,
    SIGTERM stops the API and the engine it started."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "artsg_nb.tinker", "--engine", "cpu", "--port", "0",
                             "--api-key", "tml-test", "--run-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:  # ends when the process does (pytest-timeout bounds a hang)
            lines.append(line)
            if line.startswith("Tinker API:"):
                break
        assert lines and lines[-1].startswith("Tinker API:"), "".join(lines[-20:])
        _, base_url, _, api_key, _, base_model = lines[-1].split()[2:]
        service_client = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        tc = service_client.create_lora_training_client(base_model=base_model, rank=8).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        resp = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, types.SamplingParams(max_tokens=3)).result()
        assert len(resp.sequences) == 2
        service_client.close("success").result(60)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    assert (tmp_path / "checkpoints").is_dir()
    assert (tmp_path / "server" / "cpu.log").exists()
    assert not list(tmp_path.glob("server/*.server.json")), "the engine's pid record is left: was it stopped?"
