"""Finding the server environment: search order, the import check with fake interpreters, the
offline-bundle PYTHONPATH (server only), and the not-found message naming the fix."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from artsg_nb import engines
from artsg_nb.serving import server_env
from artsg_nb.serving.server_env import ServerEnvNotFoundError, find_server_env


def fake_python(path: Path, body: str) -> Path:
    """An executable script standing in for an interpreter (gets `-c <check> pkg entry`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No real conda, env vars or repo venvs leak into the search."""
    for var in ("CONDA_PREFIX", "CONDA_ROOT", "MAMBA_ROOT_PREFIX", "CONDA_EXE",
                *(v for e in engines.ENGINES for v in (engines.get(e).python_var, engines.get(e).pythonpath_var,
                                                        engines.get(e).env_var) if v)):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(server_env, "_conda_info_envs", lambda: [])
    monkeypatch.setattr(server_env, "_conda_exe", lambda: os.environ.get("CONDA_EXE"))
    monkeypatch.setattr(server_env, "_roots", lambda: [tmp_path / "repo"])
    monkeypatch.chdir(tmp_path)


def test_explicit_python_reports_version(tmp_path):
    py = fake_python(tmp_path / "bin" / "python", "echo 0.5.14")
    env = find_server_env("sglang", python=py)
    assert (env.python, env.engine, env.version, env.extra_env) == (str(py), "sglang", "0.5.14", {})


def test_env_var_wins_over_conda_and_venv(tmp_path, monkeypatch):
    fake_python(tmp_path / "repo" / ".venv-server" / "bin" / "python", "echo venv")
    monkeypatch.setenv("ARTSG_SERVER_PYTHON", str(fake_python(tmp_path / "a" / "python", "echo var")))
    env = find_server_env("sglang")
    assert env.version == "var" and env.source == "ARTSG_SERVER_PYTHON"


def test_conda_env_by_name(tmp_path, monkeypatch):
    root = tmp_path / "conda"
    fake_python(root / "envs" / "artsg-vllm" / "bin" / "python", "echo 0.26.0")
    monkeypatch.setenv("CONDA_PREFIX", str(root / "envs" / "artsg-train"))  # inside another env
    env = find_server_env("vllm")
    assert env.version == "0.26.0" and env.source == "conda env artsg-vllm"


def test_conda_info_envs_is_consulted(tmp_path, monkeypatch):
    prefix = tmp_path / "elsewhere" / "artsg-server"
    fake_python(prefix / "bin" / "python", "echo 0.5.23")
    monkeypatch.setattr(server_env, "_conda_info_envs", lambda: [str(tmp_path / "other"), str(prefix)])
    assert find_server_env("sglang").python == str(prefix / "bin" / "python")


def test_venv_at_repo_root_and_broken_candidates_are_skipped(tmp_path, monkeypatch):
    fake_python(tmp_path / "conda" / "envs" / "artsg-server" / "bin" / "python",
                "echo \"ModuleNotFoundError: No module named 'sglang'\" >&2; exit 1")
    monkeypatch.setenv("CONDA_EXE", str(tmp_path / "conda" / "bin" / "conda"))
    venv = fake_python(tmp_path / "repo" / ".venv-server" / "bin" / "python", "echo 0.5.14")
    env = find_server_env("sglang")
    assert env.python == str(venv) and env.source == "venv .venv-server"


def test_not_found_lists_places_and_the_command_without_conda(tmp_path):
    with pytest.raises(ServerEnvNotFoundError) as err:
        find_server_env("sglang")
    msg = str(err.value)
    assert "make server-env" in msg and "conda env create" not in msg
    assert str(tmp_path / "repo" / ".venv-server" / "bin" / "python") + " (missing)" in msg
    assert "ARTSG_SERVER_PYTHON: not set" in msg


def test_not_found_on_a_conda_box_names_the_yml(tmp_path, monkeypatch):
    monkeypatch.setenv("CONDA_EXE", str(tmp_path / "conda" / "bin" / "conda"))
    with pytest.raises(ServerEnvNotFoundError, match=r"conda env create -f environment-vllm\.yml"):
        find_server_env("vllm")


def test_failing_explicit_python_is_reported_not_replaced(tmp_path):
    fake_python(tmp_path / "repo" / ".venv-server" / "bin" / "python", "echo 0.5.14")
    bad = fake_python(tmp_path / "bad" / "python",
                      "echo \"ModuleNotFoundError: No module named 'sglang'\" >&2; exit 1")
    with pytest.raises(ServerEnvNotFoundError, match="No module named 'sglang'") as err:
        find_server_env("sglang", python=bad)
    assert ".venv-server" not in str(err.value)


def test_bare_name_is_looked_up_on_path(tmp_path, monkeypatch):
    fake_python(tmp_path / "bin" / "python3", "echo 0.5.14")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ARTSG_SERVER_PYTHON", "python3")  # as tools/gpu/install.sh exports it
    assert find_server_env("sglang").python == str(tmp_path / "bin" / "python3")


def test_import_check_times_out(tmp_path):
    slow = fake_python(tmp_path / "slow" / "python", "sleep 5; echo 1")
    ok, why = server_env.check_engine(slow, engines.get("sglang"), timeout_s=0.3)
    assert not ok and "took more than" in why


def test_offline_bundle_pythonpath_goes_to_the_server_only(tmp_path, monkeypatch):
    """A real interpreter imports a fake sglang only through ARTSG_SERVER_PYTHONPATH."""
    site = tmp_path / "site" / "sglang"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("__version__ = '0.5.14'\n")
    (site / "launch_server.py").write_text("")
    with pytest.raises(ServerEnvNotFoundError, match="No module named 'sglang'"):
        find_server_env("sglang", python=sys.executable)
    monkeypatch.setenv("ARTSG_SERVER_PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("ARTSG_SERVER_ENV", "HF_HUB_OFFLINE=1 SGLANG_IS_FLASHINFER_AVAILABLE=false")
    env = find_server_env("sglang", python=sys.executable)
    assert env.version == "0.5.14"
    assert env.extra_env == {"PYTHONPATH": str(tmp_path / "site"), "HF_HUB_OFFLINE": "1",
                             "SGLANG_IS_FLASHINFER_AVAILABLE": "false"}
    assert "sglang" not in sys.modules and str(tmp_path / "site") not in sys.path
    assert os.environ.get("PYTHONPATH") != str(tmp_path / "site")  # the kernel is untouched


def test_child_env_drops_the_kernels_pythonpath_for_other_interpreters(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/kernel/site")
    assert "PYTHONPATH" not in server_env.child_env(engines.get("sglang"), {})
    assert server_env.child_env(engines.get("vllm"), {"PYTHONPATH": "/b"})["PYTHONPATH"] == "/b"
    assert server_env.child_env(engines.get("cpu"), {})["PYTHONPATH"] == "/kernel/site"


def test_bad_env_var_syntax(monkeypatch):
    monkeypatch.setenv("ARTSG_VLLM_ENV", "NOEQUALS")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        server_env.server_extra_env(engines.get("vllm"))


def test_cpu_engine_uses_the_kernels_interpreter():
    try:
        env = find_server_env("cpu")
    except ServerEnvNotFoundError as e:  # until artsg_nb/cpu_engine/ exists
        assert "artsg_nb.cpu_engine" in str(e)
    else:
        assert env.python == sys.executable and env.extra_env == {}


def test_roots_walks_up_to_the_project(tmp_path, monkeypatch):
    monkeypatch.undo()  # the real _roots
    (tmp_path / "proj" / "notebooks").mkdir(parents=True)
    (tmp_path / "proj" / "pyproject.toml").write_text("")
    monkeypatch.chdir(tmp_path / "proj" / "notebooks")
    roots = server_env._roots()
    assert roots[:2] == [tmp_path / "proj" / "notebooks", tmp_path / "proj"]


def test_a_servers_engine_spec_is_carried_from_its_config_not_looked_up_again(tmp_path, monkeypatch):
    """ServerConfig looks its engine up once; the environment search, the command line, the
    environment and the client take the spec it carries (they used to look it up by name, ~80
    times over one start)."""
    from artsg_nb.serving.server import Server
    from artsg_nb.serving.server_config import ServerConfig, build_command, build_env, with_env_args

    monkeypatch.delenv("ARTSG_SGLANG_ARGS", raising=False)
    monkeypatch.delenv("ARTSG_SERVER_PYTHON", raising=False)
    cfg = ServerConfig("sglang", "org/model", str(tmp_path), port=30000, api_key=None)
    looked_up = []
    real_get = engines.get
    monkeypatch.setattr(engines, "get", lambda name: looked_up.append(name) or real_get(name))
    server = Server(with_env_args(cfg))
    build_command(server.config, sys.executable), build_env(server.config, api_key="k")
    server_env.server_extra_env(cfg.spec), server_env.child_env(cfg.spec, {})
    with pytest.raises(ServerEnvNotFoundError):
        server_env.find_server_env(cfg.spec, python=tmp_path / "missing" / "python")
    assert server.client().engine == "sglang"
    assert looked_up == []
