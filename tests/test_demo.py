"""`make demo`'s notebook kernel talks to papermill over Unix sockets in a private directory, not
loopback TCP ports another local user could connect to (and ipykernel's warning about unencrypted
TCP no longer opens a new user's first command)."""
import json
import os
import stat
from pathlib import Path

import nbformat
import papermill

from artsg_nb import demo

PROBE = """import json
from ipykernel.connect import get_connection_info
info = get_connection_info(unpack=True)
print(json.dumps({"transport": info["transport"], "ip": info["ip"]}))"""


def test_the_demo_kernel_listens_on_sockets_in_a_private_directory(tmp_path, monkeypatch):
    seen = []

    def execute(src, out, **kw):
        sockets = Path(kw["config"].KernelManager.ip).parent
        seen.append((kw["config"].KernelManager.transport, stat.S_IMODE(sockets.stat().st_mode)))

    monkeypatch.setattr(demo.papermill, "execute_notebook", execute)
    monkeypatch.setattr(demo.tempfile, "tempdir", "/tmp")  # short enough for a socket path, whatever TMPDIR is
    assert demo.main(["--run-dir", str(tmp_path / "demo")]) == 0
    assert seen == [("ipc", 0o700)]


def test_a_kernel_started_with_the_demos_config_uses_those_sockets_and_leaves_none(tmp_path, capfd):
    sockets = tmp_path / "sockets"
    sockets.mkdir(mode=0o700)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(PROBE)])
    nbformat.write(nb, tmp_path / "probe.ipynb")
    out = papermill.execute_notebook(str(tmp_path / "probe.ipynb"), str(tmp_path / "out.ipynb"), kernel_name="python3",
                                     progress_bar=False, cwd=str(tmp_path), config=demo.kernel_config(str(sockets)))
    info = json.loads(out.cells[0].outputs[0]["text"])
    assert info["transport"] == "ipc" and info["ip"] == os.path.join(str(sockets), "kernel")
    assert "without encryption" not in capfd.readouterr().err  # the kernel's own stderr is this process's
    assert list(sockets.iterdir()) == [], "the kernel's sockets are removed when it stops"


def test_a_socket_directory_too_deep_for_a_unix_socket_falls_back_to_jupyters_default():
    deep = "/tmp/" + "d" * 100
    assert "transport" not in demo.kernel_config(deep).KernelManager
