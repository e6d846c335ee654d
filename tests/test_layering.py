"""The package's structure as a checked contract: import-linter's contracts in pyproject.toml
(layers only import downward, no import circles at any depth, the CPU engine imports nothing of
the training side), and every module opening with what it holds, none grown plainly into several."""
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "artsg_nb"
SANITY_LINES = 800
"""Not a cap to design to: the rule is that a file reads as one thing (its opening docstring says
which), whatever its length. This bound only catches a file that has plainly become several."""


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"an import contract is broken (pyproject.toml [tool.importlinter]):\n{out.stdout[-4000:]}{out.stderr[-2000:]}"
    assert "0 broken" in out.stdout


def test_no_module_is_plainly_several():
    """Every module opens with a docstring that says what it holds, and none is past the sanity bound."""
    bad = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > SANITY_LINES}
    assert not bad, f"modules over {SANITY_LINES} lines: they hold several things, split them: {bad}"
    undocumented = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                    if p.stat().st_size and not p.read_text().lstrip().startswith(('"""', 'r"""'))]
    assert not undocumented, f"modules that do not say what they hold (open them with a docstring): {undocumented}"


def test_a_run_imports_transformers_peft_and_trl_only_when_it_needs_them():
    """On a GPU, Unsloth patches transformers, peft and trl and must be imported before them
    (otherwise it warns that training "may run slower or encounter memory issues"), and it can
    only be imported after the GPU plan (it initialises CUDA). So importing the session, which a
    notebook does first, must import none of the three: the trainer imports Unsloth first."""
    code = ("import sys, artsg_nb, artsg_nb.run.session, artsg_nb.run.config; "
            "print(sorted(m for m in ('transformers', 'peft', 'trl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing artsg_nb.run.session imported {out.stdout.strip()}"
