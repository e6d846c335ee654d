"""The committed notebooks: clean (nbstripout --verify), shaped as style.md asks, parameters that
the GPU branch never overwrites, and the quickstart's loop and final plot cells showing figures.

The notebooks are the source contributors edit (in JupyterLab or any editor); `nbstripout`
(pinned in environment-train.yml; `nbstripout --install` sets it up as a git filter) strips
outputs before a commit. `make test` also runs every notebook with nbmake
(`pytest --nbmake notebooks`), on the CPU engine without a GPU.
"""
import ast
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
NBSTRIPOUT = Path(sys.executable).with_name("nbstripout")
STOPS_SERVER = re.compile(r"\.stop\(\)|stop_all\(\)|backend\.close\(\)")


def read(path: Path):
    return nbformat.read(path, as_version=4)


def test_the_six_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_multi_turn_agent.ipynb",
                                           "03_vllm_vs_sglang.ipynb", "04_bring_your_own_task.ipynb",
                                           "05_art_drop_in.ipynb", "06_sweep.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    dirty = [i for i, c in enumerate(read(path).cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, (f"{path.name}: cells {dirty} have outputs or execution counts; strip them with "
                       f"`nbstripout {path.relative_to(ROOT)}` (or `nbstripout --install` once per clone)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_title_then_parameters_cell(path):
    cells = read(path).cells
    assert cells[0].cell_type == "markdown" and cells[0].source.startswith("# "), \
        f"{path.name}: cell 1 must be the title (a markdown '# ...' heading)"
    assert cells[1].cell_type == "code" and "parameters" in cells[1].metadata.get("tags", []), \
        f"{path.name}: cell 2 must be the code cell tagged 'parameters' (papermill, nbmake)"
    assert re.search(r"^RUN_DIR = ", cells[1].source, re.M), f"{path.name}: the parameters cell sets RUN_DIR"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_last_cell_stops_the_server(path):
    cells = read(path).cells
    assert cells[-1].cell_type == "code" and STOPS_SERVER.search(cells[-1].source), \
        f"{path.name}: the last cell must stop the server; it is:\n{cells[-1].source}"


def test_nbstripout_would_change_nothing():
    """What nbstripout keeps is what is committed: a notebook saved from JupyterLab and stripped
    passes, one with outputs or stray metadata does not."""
    out = subprocess.run([str(NBSTRIPOUT), "--verify", *map(str, NOTEBOOKS)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, f"run `nbstripout notebooks/*.ipynb` and commit:\n{out.stdout}{out.stderr}"


def test_nbstripout_check_fails_on_a_saved_notebook(tmp_path):
    nb = read(NOTEBOOKS[0])
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="hello")]
    nb.cells[1].execution_count = 1
    nbformat.write(nb, tmp_path / "saved.ipynb")
    out = subprocess.run([str(NBSTRIPOUT), "--verify", str(tmp_path / "saved.ipynb")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_later_cells_fill_only_parameters_left_none(path):
    """A GPU branch must never overwrite what the user or papermill set: after the parameters
    cell a parameter is assigned only under `if NAME is None:`."""
    cells = read(path).cells
    names = {t.id for node in ast.parse(cells[1].source).body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name)}
    for i, cell in enumerate(cells[2:], 2):
        if cell.cell_type != "code":
            continue
        tree = ast.parse(re.sub(r"^\s*[%!].*$", "", cell.source, flags=re.M).replace("await ", ""))
        guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_none_test(node.test)
                   for n in ast.walk(node) if n is not node.test}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign)) and id(node) not in guarded:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                hit = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)} & names
                assert not hit, f"{path.name} cell {i} overwrites parameter(s) {hit}:\n{cell.source}"


def _is_none_test(test) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.Is)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None)


@pytest.mark.slow
def test_executed_quickstart_shows_figures_in_the_loop_and_plot_cells(tmp_path):
    """papermill runs the quickstart as a user does, its defaults (only RUN_DIR moved; this is the
    suite's one run of it, so nbmake leaves it out: tools/run_tests.sh); the `run.run(n,
    live=True)` cell and the final plot cell must each have an image output, the loop cell its
    progress bar at its end."""
    papermill = pytest.importorskip("papermill")
    out = tmp_path / "quickstart.ipynb"
    papermill.execute_notebook(str(NOTEBOOK_DIR / "01_quickstart.ipynb"), str(out), cwd=str(NOTEBOOK_DIR),
                               parameters={"RUN_DIR": str(tmp_path / "run")}, kernel_name="python3",
                               progress_bar=False)
    cells = read(out).cells
    assert str(tmp_path / "run") in cells[2].source  # papermill's injected parameters

    def cell_with(text):
        return next(c for c in cells if c.cell_type == "code" and text in c.source)

    def mimes(cell):
        return [m for o in cell.outputs for m in o.get("data", {})]

    loop = cell_with("live=True")
    assert "image/png" in mimes(loop), f"no figure in the loop cell: {loop.outputs}"
    bars = [o["data"]["text/html"] for o in loop.outputs if "text/html" in o.get("data", {})]
    assert any('data-state="done"' in b and re.search(r"step (\d+)/\1\b", b) for b in bars), bars
    final = cell_with("fig = run.plot()")
    assert "image/png" in mimes(final), f"no figure in the final plot cell: {final.outputs}"
    assert (tmp_path / "run" / "training.png").exists()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_name_a_notebook_takes_from_the_package_exists(path):
    """`ag.<name>` in a cell is a name artsg_nb exports: a branch a CPU run never takes (notebook
    03 plots step benchmarks only when result files exist) would otherwise fail on a user's box."""
    import artsg_nb

    code = "\n".join(c.source for c in read(path).cells if c.cell_type == "code")
    used = set(re.findall(r"\bag\.([A-Za-z_]\w*)", code))
    assert not {n for n in used if not hasattr(artsg_nb, n)}, f"{path.name} uses names artsg_nb does not export"
