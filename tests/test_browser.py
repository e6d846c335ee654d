"""The quickstart in a real browser: JupyterLab + headless Chromium, as a user would run it.

Starts JupyterLab (the .venv's, 127.0.0.1, a free port, token auth) on a temporary copy of
notebooks/, opens 01_quickstart.ipynb in Debian's Chromium driven by Playwright, runs the cells
one by one (Shift+Enter) up to the first GRPO step, and checks that the ipywidgets dashboard
rendered its CPU/GPU, engine and hit-rate rows. Saves test-artifacts/browser-quickstart.png.
Then shuts the kernel down — the toolkit's atexit hook must stop the server it started — and
stops JupyterLab by its process group.

Needs /usr/bin/chromium (`make browser-deps`); Playwright's own browsers are never installed.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "01_quickstart.ipynb"
SCREENSHOT = ROOT / "test-artifacts" / "browser-quickstart.png"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# JupyterLab would otherwise ask, in a toast over the page, whether to fetch Jupyter news.
PAGE_CONFIG = {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}
LAB_START_TIMEOUT_S = 60
CELLS_TIMEOUT_S = 180    # server start, trainer, one GRPO step on 2 shared cores
SERVER_STOP_TIMEOUT_S = 30


@dataclass
class Lab:
    url: str
    token: str
    root: Path
    proc: subprocess.Popen

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing; `make browser-deps` installs Debian's chromium")
    pytest.importorskip("playwright.sync_api")
    root = tmp_path / "lab"
    shutil.copytree(ROOT / "notebooks", root / "notebooks")  # RUN_DIR "../runs/..." lands in root/runs
    config = tmp_path / "jupyter-config"
    (config / "labconfig").mkdir(parents=True)
    (config / "labconfig" / "page_config.json").write_text(json.dumps(PAGE_CONFIG))
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    port, token = free_port(), os.urandom(16).hex()
    cmd = [str(Path(sys.executable).with_name("jupyter")), "lab", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", "--port-retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--allow-root"]
    log = open(tmp_path / "jupyterlab.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    lab = Lab(f"http://127.0.0.1:{port}", token, root, proc)
    try:
        wait_for_lab(lab, tmp_path / "jupyterlab.log")
        yield lab
    finally:
        stop_group(proc)
        log.close()


def wait_for_lab(lab: Lab, log_path: Path) -> None:
    deadline = time.monotonic() + LAB_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if lab.proc.poll() is not None:
            pytest.fail(f"JupyterLab exited ({lab.proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            lab.api("status")
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"JupyterLab gave no /api/status in {LAB_START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


def stop_group(proc: subprocess.Popen, timeout_s: float = 15) -> None:
    """SIGTERM JupyterLab's process group (it shuts its kernels down), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout_s)
            return
        except subprocess.TimeoutExpired:
            continue


def last_cell_to_run(path: Path) -> int:
    """Index of the quickstart's first GRPO step cell: after it the dashboard shows a hit rate."""
    cells = json.loads(path.read_text())["cells"]
    return next(i for i, c in enumerate(cells) if "await run.step()" in "".join(c["source"]))


def wait_kernel_idle(lab: Lab, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kernels = lab.api("kernels")
        if kernels and all(k["execution_state"] == "idle" for k in kernels):
            return kernels[0]
        time.sleep(0.5)
    pytest.fail(f"the kernel was not idle within {timeout_s} s: {lab.api('kernels')}")


def run_cells(page, last: int) -> None:
    """Select the first cell in command mode, then Shift+Enter through cell `last`."""
    page.locator(".jp-Notebook .jp-Cell").first.locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    for _ in range(last + 1):
        page.keyboard.press("Shift+Enter")
        page.wait_for_timeout(150)


def failed_cell_output(page) -> str:
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    return "\n".join(errors.all_inner_texts())[-3000:]


def server_record(lab: Lab) -> dict:
    """The pid record the CPU engine server wrote in the notebook's run directory."""
    records = list((lab.root / "runs").glob("*/cpu.server.json"))
    assert records, f"no cpu.server.json under {lab.root / 'runs'}: did the server start?"
    return json.loads(records[0].read_text())


def process_is(pid: int, create_time: float) -> bool:
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - create_time) < 0.01
    except psutil.NoSuchProcess:
        return False


def test_quickstart_dashboard_renders_in_chromium(lab):
    from playwright.sync_api import sync_playwright

    last = last_cell_to_run(lab.root / "notebooks" / NOTEBOOK)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{lab.url}/lab/tree/notebooks/{NOTEBOOK}?token={lab.token}")
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            wait_kernel_idle(lab)
            run_cells(page, last)
            hit_rate = page.locator(".artsg-dashboard .artsg-hit-rate[data-value]")
            try:
                hit_rate.wait_for(timeout=CELLS_TIMEOUT_S * 1000)
            except Exception:
                pytest.fail(f"no hit-rate value in the dashboard after {CELLS_TIMEOUT_S} s; "
                            f"errors shown:\n{failed_cell_output(page)}")
            wait_kernel_idle(lab, CELLS_TIMEOUT_S)

            dashboard = page.locator(".artsg-dashboard")
            assert dashboard.locator(".artsg-cpu-row, .artsg-gpu-row").count() >= 1
            engine = dashboard.locator(".artsg-engine-row")
            assert engine.count() == 1 and "running" in engine.inner_text()
            assert 0.0 <= float(hit_rate.get_attribute("data-value")) <= 1.0
            assert page.locator(".jp-OutputArea-output img").count() >= 1, "the live training plot is missing"
            # The dashboard cell at the top of the view, the first step's curves below it.
            page.locator(".jp-Cell", has=dashboard).evaluate("cell => cell.scrollIntoView({block: 'start'})")
            page.wait_for_timeout(300)
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT))
        finally:
            browser.close()

    record = server_record(lab)
    assert process_is(record["pid"], record["create_time"]), "the server died before the kernel shut down"
    for kernel in lab.api("kernels"):
        lab.api(f"kernels/{kernel['id']}", method="DELETE")  # a graceful shutdown: atexit runs
    deadline = time.monotonic() + SERVER_STOP_TIMEOUT_S
    while process_is(record["pid"], record["create_time"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not process_is(record["pid"], record["create_time"]), \
        f"the cpu_engine server (pid {record['pid']}) outlived its kernel's shutdown"
