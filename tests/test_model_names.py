"""A model name that is no directory, no model artsg_nb builds and no hub model this machine can
have is refused at once with the closest names (issue 50): before, `model_path="smollm2-135m"`
waited ~52 s on an unreachable hub, then showed a transformers traceback."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

from artsg_nb.models.pretrained import ModelNameError, built_model_dir, check_model_name, hub_unreachable


@pytest.fixture
def closed_hub(monkeypatch):
    """The hub at a local port nobody listens on: unreachable at once, whatever this machine's network."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    return port


def test_a_near_miss_of_a_built_name_is_refused_with_the_name(closed_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    t0 = time.monotonic()
    with pytest.raises(ModelNameError) as err:
        built_model_dir("smollm2-135m")
    assert time.monotonic() - t0 < 5
    msg = str(err.value)
    assert "Did you mean 'smollm2-135m-instruct'" in msg and f"127.0.0.1:{closed_hub}" in msg
    assert "python -m artsg_nb.models --list" in msg


def test_offline_variable_is_named_and_the_cache_is_enough(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_unreachable() == "HF_HUB_OFFLINE is set"
    with pytest.raises(ModelNameError, match="HF_HUB_OFFLINE is set"):
        check_model_name("Qwen/Qwen2.5-0.5B-Instruct")
    (tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "abc").mkdir(parents=True)
    check_model_name("Qwen/Qwen2.5-0.5B-Instruct")  # in the local hub cache: the engine can load it
    with pytest.raises(ModelNameError, match=r"Did you mean 'Qwen/Qwen2.5-0.5B-Instruct'"):
        check_model_name("Qwen/Qwen2.5-0.5B-Instruc")


def test_paths_and_a_reachable_hub_are_left_to_their_own_checks(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_model_name(str(tmp_path / "missing"))  # a path: server.check_model_path says what a model dir holds
    check_model_name("./relative/model")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    with socket.socket() as listener:  # a hub that accepts connections
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listener.getsockname()[1]}")
        assert hub_unreachable() is None
        check_model_name("org/any-name")


def test_a_run_with_the_near_miss_fails_before_any_server(closed_hub, tmp_path, monkeypatch):
    from artsg_nb.run.session import GRPORun, RunConfig
    from artsg_nb.serving.procs import STATE_DIR_VAR

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv(STATE_DIR_VAR, str(tmp_path / "records"))
    cfg = RunConfig(engine="cpu", model_path="smollm2-135m", run_dir=str(tmp_path / "run"), verbose=False)
    t0 = time.monotonic()
    with pytest.raises(ModelNameError, match="Did you mean 'smollm2-135m-instruct'"):
        with GRPORun(cfg) as run:
            asyncio.run(run.step())
    assert time.monotonic() - t0 < 10
    assert not list((tmp_path / "run").glob("*.log")) and not list((tmp_path / "records").glob("*.json"))
