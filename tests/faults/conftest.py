"""The faults suite's fixtures and summary line (tests/faults/: server death, kernel restart,
bad configuration).

What it does: `faults` — a fixture of injection helpers bound to the test's monkeypatch: crash a
server the way the OOM killer would (`kill_server`), at a precise moment of a run
(`kill_before(cls, method, run, when)`, `kill_after_replies(run, k)`), snapshot files
(`file_digests`, `history_steps`), write adapter directories a server must refuse (`write_lora`).
Every module here gets its own server-record directory (`private_server_records`, autouse), so the
orphan reaper that every start runs sees only servers these tests started. `make test-faults`
runs `pytest -m faults`; its last line reads `faults: N injected, N survived, 0 lost` (injected =
faults tests that ran, survived = passed, lost = failed or errored), printed after pytest's own
summary line. No test lives here.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from artsg_nb.serving.procs import STATE_DIR_VAR

_outcomes: dict[str, str] = {}  # nodeid → "survived" | "skipped" | "lost"
_WORST = {"survived": 0, "skipped": 1, "lost": 2}  # a test's worst phase decides its outcome


@pytest.hookimpl(specname="pytest_runtest_logreport")
def pytest_runtest_logreport_faults_suite(report):
    if "faults" not in report.keywords:
        return
    if report.failed:
        outcome = "lost"
    elif report.skipped:
        outcome = "skipped"
    elif report.when == "call":
        outcome = "survived"
    else:
        return
    old = _outcomes.get(report.nodeid, "survived")
    _outcomes[report.nodeid] = max(old, outcome, key=_WORST.get)


@pytest.hookimpl(specname="pytest_unconfigure")
def pytest_unconfigure_faults_suite(config):
    ran = [o for o in _outcomes.values() if o != "skipped"]
    if not ran:
        return
    line = f"faults: {len(ran)} injected, {ran.count('survived')} survived, {ran.count('lost')} lost"
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    reporter.write_line(line) if reporter is not None else print(line, flush=True)


@pytest.fixture(scope="session")
def fault_engine() -> str:
    """The engine the engine-agnostic fault tests (loop faults, keys, adoption) run against: the CPU
    engine here; on the GPU host ARTSG_TEST_ENGINES=sglang runs them against real SGLang."""
    return os.environ.get("ARTSG_TEST_ENGINES", "cpu").split(",")[0].strip() or "cpu"


@pytest.fixture
def faults(monkeypatch) -> SimpleNamespace:
    """The injection helpers below, the patching ones bound to this test's monkeypatch."""
    return SimpleNamespace(kill_server=kill_server, kill_before=partial(kill_before, monkeypatch),
                           kill_after_replies=partial(kill_after_replies, monkeypatch), file_digests=file_digests,
                           history_steps=history_steps, write_lora=write_lora)


def kill_server(server) -> None:
    """SIGKILL the server's whole process group (no cleanup runs, as in a crash) and reap it."""
    os.killpg(server.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)


def kill_before(monkeypatch, cls, method: str, run, when) -> SimpleNamespace:
    """Patch `cls.method` (an async client method) so that the first call for which
    `when(call_number, *args)` is true SIGKILLs the run's current server, then goes ahead (and
    finds no server). Returns the record: `.fired`, `.killed_pid`, `.calls` (all calls' args)."""
    original = getattr(cls, method)
    state = SimpleNamespace(fired=False, killed_pid=None, calls=[])

    async def wrapper(self, *args, **kwargs):
        state.calls.append(args)
        if not state.fired and when(len(state.calls), *args):
            state.fired, state.killed_pid = True, run.server.pid
            kill_server(run.server)
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, wrapper)
    return state


def kill_after_replies(monkeypatch, run, k: int) -> SimpleNamespace:
    """Wrap the run's task so that the k-th reply an env receives SIGKILLs the server: k rollouts
    of the step are finished, the others in flight or queued. Returns `.fired`, `.killed_pid`,
    `.replies` (replies received so far, in every attempt)."""
    state = SimpleNamespace(fired=False, killed_pid=None, replies=0)
    make_env = run.task.make_env

    def factory(seed):
        env = make_env(seed)
        reply_to = env.step

        def step(reply):
            state.replies += 1
            if not state.fired and state.replies == k:
                state.fired, state.killed_pid = True, run.server.pid
                kill_server(run.server)
            return reply_to(reply)

        env.step = step
        return env

    monkeypatch.setattr(run, "task", replace(run.task, factory=factory))
    return state


def file_digests(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def history_steps(run_dir: Path) -> list[int]:
    """Steps of the rows in <run_dir>/history.jsonl, as written on disk."""
    lines = (Path(run_dir) / "history.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


def write_lora(path: Path, model_dir: Path, rank: int, modules: list[str], pickle_only: bool = False) -> Path:
    """A PEFT-format LoRA directory (layer 0 only) of `rank` on `modules`: what a trainer with other
    settings would save. `pickle_only` writes adapter_model.bin instead of safetensors."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = {"q_proj": (cfg["hidden_size"], cfg["hidden_size"]), "lm_head": (cfg["hidden_size"], cfg["vocab_size"])}
    prefix = {"q_proj": "base_model.model.model.layers.0.self_attn.q_proj", "lm_head": "base_model.model.lm_head"}
    tensors = {}
    for m in modules:
        d_in, d_out = shapes[m]
        tensors[f"{prefix[m]}.lora_A.weight"] = torch.zeros(rank, d_in)
        tensors[f"{prefix[m]}.lora_B.weight"] = torch.zeros(d_out, rank)
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": modules, "base_model_name_or_path": str(model_dir), "lora_dropout": 0.0, "bias": "none"}))
    if pickle_only:
        torch.save(tensors, path / "adapter_model.bin")
    else:
        save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.fixture(scope="module", autouse=True)
def private_server_records(tmp_path_factory):
    """Server records go to a directory of the module's own (not the user's ~/.cache), so the
    orphan reaper run by every start sees only servers these tests started."""
    old = os.environ.get(STATE_DIR_VAR)
    path = os.environ[STATE_DIR_VAR] = str(tmp_path_factory.mktemp("server-records"))
    yield Path(path)
    if old is None:
        os.environ.pop(STATE_DIR_VAR)
    else:
        os.environ[STATE_DIR_VAR] = old
