"""Bring your own task: a Task defined in a module the project has never seen trains through
`python -m artsg_nb.train --task module:ATTR` and through `RunConfig(task=obj)`; task specs that
do not resolve say which part failed; config.json records an importable spec; registering a task
without a teacher leaves the tiny model's pretraining alone; learning_rate None follows the model;
the CLI is generated from RunConfig and GRPOConfig."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import artsg_nb
from artsg_nb.tasks import registry as tasks
from artsg_nb.run.config import RunConfig, config_record, learning_rate
from artsg_nb.serving.server import ModelPathError
from artsg_nb.run.session import GRPORun
from artsg_nb.tasks.registry import Task, TaskImportError, UnknownTaskError, register_task, resolve_task
from artsg_nb.train import main, parse_args

ROOT = Path(__file__).resolve().parents[1]

MODULE = '''
"""A user's tasks, in a module artsg_nb has never seen."""
import asyncio
from trl.rewards import think_format_reward
from artsg_nb import StepResult, Task


class SayDigit:
    def __init__(self, seed):
        self.digit = seed % 10

    async def reset(self):  # async: a real env may call an API
        return [{"role": "user", "content": f"What is {self.digit} + 0?"}]

    async def step(self, reply):
        await asyncio.sleep(0)
        return StepResult([], 1.0 if reply.strip() == str(self.digit) else 0.0, True)


task = Task("say_digit", "repeat a digit", max_turns=1, max_new_tokens=4, factory=SayDigit)


def exact(prompts, completions, answer, **kwargs):
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]


sums = Task.from_dataset([{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
                          for a in range(4) for b in range(4)],
                         reward_funcs=[think_format_reward, exact], reward_weights=[0.5, 1.0],
                         max_new_tokens=6, name="sums", eval_fraction=0.25)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes the module to a fresh directory on sys.path; returns its name."""
    name = f"byo_{tmp_path.name.replace('-', '_')}"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{name}.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    yield name
    sys.modules.pop(name, None)


def test_public_names_are_exported():
    assert artsg_nb.Task is Task and artsg_nb.register_task is register_task
    assert artsg_nb.StepResult is tasks.StepResult and artsg_nb.Env is tasks.Env


def test_specs_resolve_and_say_which_part_failed(user_module):
    obj = resolve_task(f"{user_module}:task")
    assert obj.name == "say_digit" and resolve_task(obj) is obj and resolve_task("addition").name == "addition"
    with pytest.raises(TaskImportError, match=r"module 'no_such_mod_xyz' not found"):
        resolve_task("no_such_mod_xyz:task")
    with pytest.raises(TaskImportError, match=rf"module '{user_module}' imported, but it has no attribute 'tsak'"):
        resolve_task(f"{user_module}:tsak")
    with pytest.raises(TaskImportError, match="'exact' is a function, not an artsg_nb Task"):
        resolve_task(f"{user_module}:exact")
    with pytest.raises(UnknownTaskError, match="known tasks: addition"):
        resolve_task("nope")


def test_config_json_records_an_importable_spec(user_module):
    obj = resolve_task(f"{user_module}:sums")
    assert config_record(RunConfig(task=obj))["task"] == f"{user_module}:sums"
    assert config_record(RunConfig(task="addition"))["task"] == "addition"
    local = Task("in_a_notebook", "defined in a cell", max_turns=1, max_new_tokens=4, factory=lambda s: None)
    rec = config_record(RunConfig(task=local))
    assert rec["task"] == "in_a_notebook" and rec["task_note"] == tasks.NOT_IMPORTABLE


def test_a_task_registered_in_a_notebook_is_still_recorded_as_not_importable(monkeypatch):
    """register_task makes the name known in this process only: config.json must not claim another
    process can load it by that name (before, any registered task was recorded without the note)."""
    monkeypatch.setattr(tasks, "_TASKS", dict(tasks._TASKS))
    local = tasks.register_task(Task("registered_in_a_cell", "defined in a cell", max_turns=1, max_new_tokens=4,
                                     factory=lambda s: None))
    rec = config_record(RunConfig(task=local))
    assert rec["task"] == "registered_in_a_cell" and rec["task_note"] == tasks.NOT_IMPORTABLE


def test_a_registered_task_without_teacher_leaves_the_tiny_model_corpus_alone(monkeypatch):
    monkeypatch.setattr(tasks, "_TASKS", dict(tasks._TASKS))
    before = tasks.pretraining_corpus(12, seed=3)
    mine = register_task(Task("mine", "no teacher", max_turns=1, max_new_tokens=4, factory=lambda s: None))
    assert tasks.get_task("mine") is mine and "mine" in [t.name for t in tasks.list_tasks()]
    assert tasks.pretraining_corpus(12, seed=3) == before
    with pytest.raises(ValueError, match="no scripted teacher"):
        tasks.pretraining_corpus(2, mix=["mine"])
    with pytest.raises(ValueError, match="already registered"):
        register_task(Task("mine", "again", max_turns=1, max_new_tokens=4, factory=lambda s: None))


def test_learning_rate_follows_the_model(tiny_model_dir, tmp_path):
    assert RunConfig().learning_rate is None
    assert learning_rate(None, str(tiny_model_dir)) == 3e-3
    assert learning_rate(None, str(tmp_path)) == 2e-4
    assert learning_rate(1e-5, str(tmp_path)) == 1e-5
    built = tmp_path / "smollm2"  # a real model built offline by artsg_nb.models.pretrained carries a .complete of its own
    built.mkdir()
    (built / ".complete").write_text('{"name": "smollm2-135m-instruct", "recipe": "x"}')
    assert learning_rate(None, str(built)) == 2e-4


def test_cli_flags_come_from_the_dataclasses(user_module):
    a = parse_args(["--task", f"{user_module}:task", "--learning-rate", "1e-4", "--max-new-tokens", "5",
                    "--grpo.loss-type", "grpo", "--grpo.beta", "0.04", "--steps", "3", "--release-memory", "auto"])
    assert (a.run.task, a.run.learning_rate, a.run.max_new_tokens) == (f"{user_module}:task", 1e-4, 5)
    assert (a.run.grpo.loss_type, a.run.grpo.beta, a.steps, a.run.release_memory) == ("grpo", 0.04, 3, "auto")
    assert a.run.run_dir == "runs/say_digit" and parse_args(["--run-dir", "x"]).run.run_dir == "x"
    assert parse_args([]).run.run_dir == "runs/addition"


def test_cli_help_says_what_the_flags_do(capsys, monkeypatch):
    """Issue 50 item 5: --help said `--run-dir` defaulted to runs/quickstart (a run without it goes to
    runs/<task>) and that --task takes "a Task object", which no command line can pass."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "(default: 'runs/<task>')" in text and "runs/quickstart" not in text
    assert "Task object" not in text and '"package.module:ATTR" naming a Task' in text
    assert type(parse_args([]).run) is RunConfig  # what GRPORun and config.json get


def test_cli_server_args_take_server_flags():
    """A server flag as the value (--server-args "--attention-backend triton") is not taken for an
    option of ours, and reaches the server as separate argv items."""
    from artsg_nb.train import parse_args
    args = parse_args(["--server-args", "--attention-backend triton --sampling-backend pytorch", "--steps", "2"])
    assert args.run.server_args == ("--attention-backend", "triton", "--sampling-backend", "pytorch")
    assert args.steps == 2 and parse_args([]).run.server_args == ()


def test_cli_user_errors_exit_1_without_traceback(user_module, capsys, tmp_path):
    assert main(["--task", f"{user_module}:nope", "--run-dir", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "TaskImportError" in err and "no attribute 'nope'" in err and "Traceback" not in err


def test_a_model_path_that_is_not_there_fails_before_any_server_starts(tmp_path):
    cfg = RunConfig(engine="cpu", model_path=str(tmp_path / "no_model"), run_dir=str(tmp_path / "run"), verbose=False)
    with pytest.raises(ModelPathError, match="does not exist"):
        GRPORun(cfg).start()
    assert not list((tmp_path / "run").glob("*.log")), "no server may have been launched"


@pytest.mark.slow
def test_cli_trains_a_task_from_an_unseen_module(user_module, tiny_model_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "mods")])}
    out = subprocess.run([sys.executable, "-m", "artsg_nb.train", "--task", f"{user_module}:task", "--steps", "1",
                          "--engine", "cpu", "--model-path", str(tiny_model_dir), "--group-size", "4",
                          "--groups-per-step", "2", "--no-verify-adapter", "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: 1 steps" in out.stdout
    assert json.loads((tmp_path / "run" / "config.json").read_text())["task"] == f"{user_module}:task"
    assert (tmp_path / "run" / "adapters" / "policy-step-1").is_dir()


@pytest.mark.slow
def test_a_dataset_task_with_a_trl_reward_trains_in_process(user_module, tiny_model_dir, tmp_path):
    obj = resolve_task(f"{user_module}:sums")
    cfg = RunConfig(task=obj, engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"),
                    group_size=4, groups_per_step=2, verify_adapter=False, verbose=False)
    with GRPORun(cfg) as run:
        row = asyncio.run(run.step())
    assert row["reward_errors"] == 0 and row["failed_rollouts"] == 0 and row["reward_mean"] == row["reward_mean"]
    assert row["tokens"] > 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["task"] == f"{user_module}:sums"


def test_a_package_task_is_recorded_by_name_even_where_a_user_module_binds_it_too(tmp_path, monkeypatch):
    """A user module that imports a package task (`from artsg_nb.tasks.chat import ADDITION_CHAT`)
    must not change how a run records it (before: "mymod:ADDITION_CHAT", so a run started by name
    refused to resume in a process that had imported that module); a user package whose name
    merely starts with "artsg_nb" is a user module."""
    from artsg_nb.tasks.chat import ADDITION_CHAT

    (tmp_path / "binds_chat.py").write_text("from artsg_nb.tasks.chat import ADDITION_CHAT\n")
    (tmp_path / "artsg_nb_ext.py").write_text(textwrap.dedent("""
        from artsg_nb.tasks.registry import Task, register_task
        EXT = register_task(Task("ext_task", "a user's", max_turns=1, max_new_tokens=4, factory=lambda s: None))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tasks, "_TASKS", dict(tasks._TASKS))
    import importlib
    importlib.import_module("binds_chat")
    ext = importlib.import_module("artsg_nb_ext").EXT
    try:
        assert tasks.task_spec(ADDITION_CHAT) == ("addition_chat", None)
        assert tasks.task_spec(ext) == ("artsg_nb_ext:EXT", None)
    finally:
        sys.modules.pop("binds_chat", None)
        sys.modules.pop("artsg_nb_ext", None)
