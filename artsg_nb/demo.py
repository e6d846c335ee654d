"""`make demo`: execute the quickstart notebook headless and leave the results in a run directory.

What it does: runs notebooks/01_quickstart.ipynb top to bottom with papermill on whatever the
machine has (the CPU engine and the offline tiny model without a GPU, SGLang with one), writing
the executed notebook, history.jsonl, adapters and the training plot into `--run-dir` (an earlier
demo there, executed notebook included, is first moved to `<run-dir>/archive/<date>/`). It prints
where everything is and the wall time. It does not change the committed notebook.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import papermill

from .run.rundir import archive_earlier_run

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "01_quickstart.ipynb"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m artsg_nb.demo", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--notebook", default=str(NOTEBOOK))
    p.add_argument("--cell-timeout-s", type=int, default=1800)
    a = p.parse_args(argv)

    run_dir = Path(a.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    archive_earlier_run(run_dir)  # before papermill writes the new executed notebook there
    out = run_dir / (Path(a.notebook).stem + ".executed.ipynb")
    t0 = time.perf_counter()
    papermill.execute_notebook(a.notebook, str(out), parameters={"RUN_DIR": str(run_dir)},
                               cwd=str(Path(a.notebook).parent), execution_timeout=a.cell_timeout_s,
                               progress_bar=True)
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    print(f"  executed notebook: {out}")
    for name in ("training.png", "history.jsonl"):
        if (run_dir / name).exists():
            print(f"  {name}: {run_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
