"""`make demo`: execute the quickstart notebook headless and leave the results in a run directory.

What it does: runs notebooks/01_quickstart.ipynb top to bottom with papermill on whatever the
machine has (the CPU engine and the offline tiny model without a GPU, SGLang with one), writing
the executed notebook, history.jsonl, adapters and the training plot into `--run-dir` (an earlier
demo there, executed notebook included, is first moved to `<run-dir>/archive/<date>/`). It prints
where everything is and the wall time. It does not change the committed notebook.

The notebook's kernel talks to papermill over Unix sockets in a private temporary directory
(`kernel_config`), not loopback TCP ports any local user could connect to (ipykernel warns about
unencrypted TCP on every start).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import papermill
from traitlets.config import Config

from .run.rundir import archive_earlier_run

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "01_quickstart.ipynb"


SOCKET_PATH_MAX = 100
"""Unix socket paths are limited to 104-108 bytes (sockaddr_un); `<dir>/kernel-<port>` must fit."""


def kernel_config(socket_dir: str) -> Config:
    """Jupyter config for a kernel on Unix sockets `<socket_dir>/kernel-<port>` (IPC transport);
    loopback TCP (Jupyter's default) where a socket path there would be too long."""
    prefix = os.path.join(socket_dir, "kernel")
    if len(prefix) + len("-65535") > SOCKET_PATH_MAX:
        return Config()
    return Config({"KernelManager": {"transport": "ipc", "ip": prefix}})


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
    with tempfile.TemporaryDirectory(prefix="artsg-kernel-") as sockets:  # mode 0700: this user's only
        papermill.execute_notebook(a.notebook, str(out), parameters={"RUN_DIR": str(run_dir)},
                                   cwd=str(Path(a.notebook).parent), execution_timeout=a.cell_timeout_s,
                                   progress_bar=True, config=kernel_config(sockets))
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    print(f"  executed notebook: {out}")
    for name in ("training.png", "history.jsonl"):
        if (run_dir / name).exists():
            print(f"  {name}: {run_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
