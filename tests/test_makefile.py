"""The Makefile's user-facing targets (issue 50 items 1 and 5): `make venv` installs the nbstripout
git filter (JupyterLab's autosave wrote outputs into the tracked notebooks), `make lab` starts
JupyterLab on 127.0.0.1 with the venv's kernel and JupyterLab's own token, and `make demo` ends
by saying how to open the notebooks. Each runs make in a scratch git checkout whose .venv is
already built (a stand-in pointing at this interpreter), so nothing is installed."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None,
                                reason="needs make and git")


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A git checkout with the Makefile and a .venv that make takes as built."""
    for name in ("Makefile", "environment-train.yml", "pyproject.toml", "tools/yml_requirements.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    (bin_dir / "nbstripout").symlink_to(Path(sys.executable).with_name("nbstripout"))
    installed = tmp_path / ".venv" / ".installed"
    installed.touch()
    later = time.time() + 60
    os.utime(installed, (later, later))  # newer than what it is built from: make leaves it
    return tmp_path


def make(checkout: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "GIT_"))}
    out = subprocess.run(["make", "--no-print-directory", *args], cwd=checkout, capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_make_venv_installs_the_nbstripout_filter_once(checkout):
    said = make(checkout, "venv")
    assert "nbstripout git filter installed" in said
    config = subprocess.run(["git", "config", "--get", "filter.nbstripout.clean"], cwd=checkout,
                            capture_output=True, text=True).stdout
    assert "nbstripout" in config
    attributes = subprocess.run(["git", "check-attr", "filter", "notebooks/x.ipynb"], cwd=checkout,
                                capture_output=True, text=True).stdout
    assert attributes.strip().endswith("filter: nbstripout")
    assert "nbstripout" not in make(checkout, "venv")  # already there: nothing to say


def test_make_lab_binds_loopback_with_the_venvs_python_and_no_token_on_its_command_line(checkout):
    command = " ".join(make(checkout, "-n", "lab").split())
    assert ".venv/bin/python -m jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=8888" in command
    assert "token" not in command.lower() and "notebooks/01_quickstart.ipynb" in command
    assert "--ServerApp.port=9999" in make(checkout, "-n", "lab", "LAB_PORT=9999")
    assert ("--allow-root" in command) == (os.getuid() == 0)  # JupyterLab refuses root without it


def test_make_demo_ends_by_saying_how_to_open_the_notebooks(checkout):
    last = make(checkout, "-n", "demo").strip().splitlines()[-1]
    assert "make lab" in last and "127.0.0.1:8888" in last
