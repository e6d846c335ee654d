"""Toolkit errors in IPython show their message and hint, not the whole traceback (issue 50,
build item 3): an IPython shell in a subprocess imports artsg_nb and runs cells as a notebook would."""
from __future__ import annotations

import re
import subprocess
import sys

SHELL = r'''
import sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
for cell in sys.argv[1:]:
    shell.run_cell(cell)
    print("=== cell end", flush=True)
'''
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def cells(*code: str, env: dict | None = None) -> list[str]:
    """What each cell printed, colours stripped."""
    out = subprocess.run([sys.executable, "-c", SHELL, *code], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return ANSI.sub("", out.stdout).split("=== cell end\n")[:-1]


CONFIG_ERROR = "from artsg_nb.run.config import RunConfig; RunConfig(engine='sglnag')"


def test_a_toolkit_error_is_its_message_and_hint_and_others_keep_their_traceback():
    imported, toolkit, other, tb = cells("import artsg_nb", CONFIG_ERROR, "1/0", "%tb")
    assert toolkit.splitlines()[0] == ("ConfigError: unknown engine 'sglnag'; did you mean 'sglang'? "
                                       "(known: auto, sglang, vllm, cpu)")
    assert "%tb prints it" in toolkit and "Traceback" not in toolkit and "config_checks.py" not in toolkit
    assert "Traceback (most recent call last)" in other and "ZeroDivisionError: division by zero" in other
    assert "Traceback" in tb and "ZeroDivisionError" in tb  # %tb: the last error's whole traceback


def test_tb_shows_the_toolkit_errors_whole_traceback():
    _, _, tb = cells("import artsg_nb", CONFIG_ERROR, "%tb")
    assert "config_checks.py" in tb and "ConfigError: unknown engine 'sglnag'" in tb


def test_off_switch_and_another_handler_are_respected():
    import os

    env = {**os.environ, "ARTSG_FULL_TRACEBACKS": "1"}
    _, toolkit = cells("import artsg_nb", CONFIG_ERROR, env=env)
    assert "Traceback (most recent call last)" in toolkit and "config_checks.py" in toolkit
    mine = ("def mine(shell, etype, value, tb, tb_offset=None):\n    print('MINE', etype.__name__)\n    return []\n"
            "get_ipython().set_custom_exc((ValueError,), mine)")
    _, _, toolkit = cells(mine, "import artsg_nb", CONFIG_ERROR)
    assert toolkit.strip() == "MINE ConfigError"
