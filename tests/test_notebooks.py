"""The committed notebooks: clean, shaped as style.md asks, and exactly what the generator writes.

Executing them is not done here: `make test` runs every notebook with nbmake
(`pytest --nbmake notebooks`), on the CPU engine without a GPU.
"""
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
GENERATOR = ROOT / "tools" / "make_notebooks.py"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
STOPS_SERVER = re.compile(r"\.stop\(\)|stop_all\(\)")


def read(path: Path):
    return nbformat.read(path, as_version=4)


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_multi_turn_agent.ipynb",
                                           "03_vllm_vs_sglang.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    dirty = [i for i, c in enumerate(read(path).cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, (f"{path.name}: cells {dirty} have outputs or execution counts; regenerate it with "
                       f"`python tools/make_notebooks.py` instead of saving it from Jupyter")


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


def test_generator_reproduces_the_committed_notebooks(tmp_path):
    subprocess.run([sys.executable, str(GENERATOR), str(tmp_path)], check=True, timeout=120)
    generated = sorted(p.name for p in tmp_path.glob("*.ipynb"))
    assert generated == [p.name for p in NOTEBOOKS], "notebooks/ and tools/make_notebooks.py disagree on which exist"
    drifted = [name for name in generated if (tmp_path / name).read_bytes() != (NOTEBOOK_DIR / name).read_bytes()]
    assert not drifted, (f"{drifted} differ from what tools/make_notebooks.py writes: edit the cells in the "
                         f"script and run `python tools/make_notebooks.py`, then commit both")
