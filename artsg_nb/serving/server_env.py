"""Find the Python environment a server engine runs in, and check the engine imports there.

What it does: `find_server_env(spec)` (an engines.EngineSpec, carried from ServerConfig.spec; or
an engine's name) looks for the interpreter of the server environment, in
this order — an explicit `python=` path, an environment variable (`ARTSG_SERVER_PYTHON` for
sglang, `ARTSG_VLLM_PYTHON` for vllm), a conda env by name (`artsg-server`, `artsg-vllm`; found
from `$CONDA_PREFIX`/`$CONDA_EXE` paths and `conda info --envs`, never `conda run`), a venv at the
repo root or the working directory (`.venv-server`, `.venv-vllm`) — runs
`python -c "import sglang; print(sglang.__version__)"` there with a timeout, and returns a
`ServerEnv`. The CPU engine runs in the kernel's own interpreter (`sys.executable`).

An offline bundle (see shared/gpu/README.md) needs extra `PYTHONPATH` entries and variables in
the server process: `ARTSG_SERVER_PYTHONPATH` / `ARTSG_VLLM_PYTHONPATH` (os.pathsep-separated)
and `ARTSG_SERVER_ENV` / `ARTSG_VLLM_ENV` ("KEY=VALUE KEY2=VALUE2") end up in
`ServerEnv.extra_env`, which goes to the server subprocess only, never into the kernel.

What it does not: create or modify environments (it names the command that does), or start
the server (server.py).
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .. import engines
from ..engines import EngineSpec
from . import procs

log = logging.getLogger(__name__)

# Imports the engine's package in the candidate interpreter, checks its server entry point exists.
_CHECK = """\
import importlib, importlib.util, sys
mod = importlib.import_module(sys.argv[1])
if importlib.util.find_spec(sys.argv[2]) is None:
    raise SystemExit("no module named " + sys.argv[2])
version = getattr(mod, "__version__", None)
if version is None:
    from importlib.metadata import version as dist_version
    version = dist_version(sys.argv[1])
print(version)
"""


class ServerEnvNotFoundError(RuntimeError):
    """No interpreter with the engine installed was found; the message says where we looked."""


@dataclass(frozen=True)
class ServerEnv:
    """An interpreter that can run one engine's server."""
    python: str
    """Path of the interpreter (not resolved: a venv's bin/python symlink is kept)."""
    engine: str
    """"sglang", "vllm" or "cpu"."""
    version: str
    """The engine package's version as imported by that interpreter."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Variables for the server subprocess only (PYTHONPATH of an offline bundle, ...)."""
    source: str = ""
    """Where it was found, e.g. "ARTSG_SERVER_PYTHON" or "conda env artsg-server"."""


def find_server_env(engine: str | EngineSpec, python: str | os.PathLike | None = None,
                    timeout_s: float = 120.0) -> ServerEnv:
    """The interpreter for `engine` (its spec, or its name: ValueError for an unknown one), checked
    to import it; `ServerEnvNotFoundError` if none does."""
    spec = engines.get(engine) if isinstance(engine, str) else engine
    extra_env = server_extra_env(spec)
    looked: list[str] = []
    for source, path, explicit in _candidates(spec, python):
        if not Path(path).is_file():
            looked.append(f"{source}: {path} (missing)")
            if explicit:
                break
            continue
        ok, out = check_engine(path, spec, extra_env, timeout_s)
        if ok:
            log.info("%s %s from %s (%s)", spec.name, out, path, source)
            return ServerEnv(str(path), spec.name, out, extra_env, source)
        looked.append(f"{source}: {path} ({out})")
        if explicit:  # a path the user chose is reported, not silently replaced
            break
    raise ServerEnvNotFoundError(_not_found_message(spec, looked))


def server_args(spec: EngineSpec, explicit=()) -> tuple[str, ...]:
    """Extra server flags: `explicit` when given, else $ARTSG_SGLANG_ARGS / $ARTSG_VLLM_ARGS (e.g.
    the attention/sampling backends an offline GPU bundle needs; tools/gpu/validate.sh sets them)."""
    return tuple(explicit) or tuple(shlex.split(os.environ.get(spec.args_var, "")))


def server_extra_env(spec: EngineSpec) -> dict[str, str]:
    """PYTHONPATH and variables from ARTSG_*_PYTHONPATH / ARTSG_*_ENV for the server process."""
    env: dict[str, str] = {}
    for item in shlex.split(os.environ.get(spec.env_var, "")) if spec.env_var else ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{spec.env_var} holds {item!r}; write KEY=VALUE pairs separated by spaces")
        env[key] = value
    if spec.pythonpath_var and os.environ.get(spec.pythonpath_var):
        env["PYTHONPATH"] = os.environ[spec.pythonpath_var]
    return env


def check_engine(python: str | os.PathLike, spec: EngineSpec, extra_env: dict[str, str] | None = None,
                 timeout_s: float = 120.0) -> tuple[bool, str]:
    """Import the engine in `python`: (True, version) or (False, why not)."""
    package, entry = spec.package, spec.entry
    env = child_env(spec, extra_env or {})
    try:  # own process group, so a timeout also ends whatever the interpreter started
        proc = subprocess.Popen([str(python), "-c", _CHECK, package, entry], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        return False, f"cannot run it: {e}"
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        procs.stop_group(proc.pid, timeout_s=0, proc=proc)
        return False, f"`import {package}` took more than {timeout_s:.0f} s"
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["exit code %d" % done.returncode])[-1]
        return False, f"`import {package}` failed: {last}"
    lines = done.stdout.strip().splitlines()
    return True, lines[-1] if lines else "unknown"


def child_env(spec: EngineSpec, extra_env: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (os.environ) for a subprocess of the engine's interpreter: minus what would make
    another interpreter import the kernel's packages, plus `extra_env`."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONHOME", None)
    if spec.python_var is not None:  # the CPU engine shares the kernel's packages
        env.pop("PYTHONPATH", None)
    env.update(extra_env)
    return env


def _candidates(spec: EngineSpec, python) -> list[tuple[str, Path, bool]]:
    """(where, interpreter path, explicitly chosen) in search order."""
    if python is not None:
        return [("python argument", _on_path(python), True)]
    if spec.python_var is None:
        return [("the kernel's interpreter", Path(sys.executable), True)]
    var = spec.python_var
    if os.environ.get(var):
        return [(var, _on_path(os.environ[var]), True)]
    found = [(f"conda env {spec.conda_env}", p, False) for p in _conda_pythons(spec.conda_env)]
    found += [(f"venv {spec.venv_dir}", root / spec.venv_dir / "bin" / "python", False)
              for root in _roots()]
    unique, seen = [], set()
    for item in found:
        if item[1] not in seen:
            seen.add(item[1])
            unique.append(item)
    return unique


def _on_path(python: str | os.PathLike) -> Path:
    """A bare name ("python3") is looked up on PATH, like a shell would."""
    if os.sep not in os.fspath(python):
        return Path(shutil.which(os.fspath(python)) or python)
    return Path(python)


def _conda_exe() -> str | None:
    return os.environ.get("CONDA_EXE") or shutil.which("conda")


def _conda_pythons(name: str) -> list[Path]:
    """bin/python of conda env `name` under every conda root we can see."""
    bases = []
    for var in ("CONDA_PREFIX", "CONDA_ROOT", "MAMBA_ROOT_PREFIX"):
        if os.environ.get(var):
            prefix = Path(os.environ[var])
            # inside a non-base env, CONDA_PREFIX is <root>/envs/<env>
            bases.append(prefix.parent.parent if prefix.parent.name == "envs" else prefix)
    if os.environ.get("CONDA_EXE"):
        bases.append(Path(os.environ["CONDA_EXE"]).parent.parent)  # <root>/bin/conda
    paths = [b / "envs" / name / "bin" / "python" for b in bases]
    paths += [Path(p) / "bin" / "python" for p in _conda_info_envs() if Path(p).name == name]
    return list(dict.fromkeys(paths))


def _conda_info_envs() -> list[str]:
    conda = _conda_exe()
    if not conda:
        return []
    try:
        out = subprocess.run([conda, "info", "--envs", "--json"], capture_output=True,
                             text=True, timeout=30)
        return list(json.loads(out.stdout).get("envs", []))
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        log.debug("conda info --envs failed: %s", e)
        return []


def _roots() -> list[Path]:
    """The working directory, its parents up to a project root, and this package's repo."""
    cwd = Path.cwd()
    roots = [cwd]
    for d in (cwd, *cwd.parents):
        if (d / "pyproject.toml").exists() or (d / ".git").exists():
            roots.append(d)
            break
    repo = Path(__file__).resolve().parent.parent
    if (repo / "pyproject.toml").exists():
        roots.append(repo)
    return list(dict.fromkeys(roots))


def _not_found_message(spec: EngineSpec, looked: list[str]) -> str:
    engine = spec.name
    if spec.create_commands is None:
        return (f"the {engine} engine ({spec.entry}) does not import in "
                + "; ".join(looked) + ". Try: `pip install -e .` in the kernel's environment.")
    conda_cmd, make_cmd = spec.create_commands
    has_conda = bool(_conda_exe())
    create = (f"`{conda_cmd}` (or `{make_cmd}` for a venv)" if has_conda
              else f"`{make_cmd}` (no conda on this machine)")
    where = "\n".join(f"  - {item}" for item in looked) or "  - (nothing)"
    return (f"no Python environment with {engine} was found. Looked in:\n{where}\n"
            f"  - {spec.python_var}: {'set' if os.environ.get(spec.python_var) else 'not set'}\n"
            f"Try: create it with {create}, or set {spec.python_var} to an interpreter that has "
            f"{engine} (with {spec.pythonpath_var} for an offline bundle), or pass python=...")
