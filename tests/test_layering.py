"""The package's structure as a checked contract: import-linter's contracts in pyproject.toml
(layers only import downward, no import circles at any depth, the CPU engine imports nothing of
the training side), and no module grown past what one reader takes in at once."""
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "artsg_nb"
MAX_LINES = 420
LONG_ON_PURPOSE: dict[str, str] = {
    "tiny_model.py": "one recipe, top to bottom: tokenizer, config, scripted corpus, pretraining, save",
    "rollout.py": "one algorithm: play a group's episodes turn by turn under a submission schedule",
    "server.py": "one process lifecycle: config, command line, start, readiness, stop, records",
    "engines/base.py": "the engine-neutral client: its interface, and the HTTP under it with each call's timeout",
}
"""Modules allowed past MAX_LINES, with the reason they read as one thing."""


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"an import contract is broken (pyproject.toml [tool.importlinter]):\n{out.stdout[-4000:]}{out.stderr[-2000:]}"
    assert "0 broken" in out.stdout


def test_no_module_is_longer_than_one_reading():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES and str(p.relative_to(PACKAGE)) not in LONG_ON_PURPOSE}
    assert not long, f"modules over {MAX_LINES} lines (split them, or say in LONG_ON_PURPOSE why they read as one): {long}"


def test_a_run_imports_transformers_peft_and_trl_only_when_it_needs_them():
    """On a GPU, Unsloth patches transformers, peft and trl and must be imported before them
    (otherwise it warns that training "may run slower or encounter memory issues"), and it can
    only be imported after the GPU plan (it initialises CUDA). So importing the session, which a
    notebook does first, must import none of the three: the trainer imports Unsloth first."""
    code = ("import sys, artsg_nb, artsg_nb.session, artsg_nb.run_config; "
            "print(sorted(m for m in ('transformers', 'peft', 'trl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing artsg_nb.session imported {out.stdout.strip()}"
