"""Toolkit errors in a notebook: the message and its hint, not a page of traceback.

What it does: `register()` (run when `import artsg_nb` happens inside IPython or Jupyter) installs
an IPython custom exception handler. An exception whose class is artsg_nb's own (defined in an
artsg_nb module: ConfigError, ServerStartError, RewardFunctionCheckError, ...) is shown as
`ErrorName: message` — the message already says what happened and what to try — and one line
saying that `%tb` prints the whole traceback. Every other exception is shown exactly as IPython
would (and `%pdb` still opens the debugger on it). $ARTSG_FULL_TRACEBACKS=1 turns this off.

What it does not: change anything outside IPython (scripts and the CLI print what Python prints),
catch or reword errors, or replace a custom handler something else installed first.
"""
from __future__ import annotations

import os
import sys

OFF_VAR = "ARTSG_FULL_TRACEBACKS"
_RED, _DIM, _RESET = "\x1b[0;31m", "\x1b[2m", "\x1b[0m"


def is_toolkit_error(etype: type) -> bool:
    """Is `etype`, or a class it derives from, defined in artsg_nb?"""
    return any(getattr(cls, "__module__", "").split(".")[0] == "artsg_nb" for cls in getattr(etype, "__mro__", ()))


def short_traceback(shell, etype, value, tb, tb_offset=None) -> list[str]:
    """The custom exception handler: shows a toolkit error in two lines, any other exception as
    IPython does (its `showtraceback`, which also opens the debugger under %pdb). IPython 9 does
    not display what a custom handler returns, so this shows it, then returns it."""
    if not is_toolkit_error(etype):
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        return []
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb  # for %tb and %debug
    if hasattr(sys, "last_exc"):
        sys.last_exc = value
    stb = [f"{_RED}{etype.__name__}{_RESET}: {value}",
           f"{_DIM}(artsg_nb shows its own errors without the traceback: %tb prints it, %debug steps into it; "
           f"{OFF_VAR}=1 turns this off){_RESET}"]
    shell._showtraceback(etype, value, stb)  # the kernel's version sends it to the notebook as the cell's error
    return stb


def register() -> bool:
    """Install `short_traceback` in the running IPython shell; False when there is none, when
    $ARTSG_FULL_TRACEBACKS is set, or when another custom handler is already installed."""
    if os.environ.get(OFF_VAR, "").strip() not in ("", "0"):
        return False
    ipython = sys.modules.get("IPython")  # only where IPython is already running: never import it
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or not hasattr(shell, "set_custom_exc"):
        return False
    if shell.custom_exceptions and not getattr(shell, "_artsg_nb_short_tracebacks", False):
        return False  # someone else's handler: IPython holds one only
    shell.set_custom_exc((Exception,), short_traceback)
    shell._artsg_nb_short_tracebacks = True  # on the shell: a reloaded artsg_nb still knows it is ours
    return True
