"""The quickstart in a real browser: JupyterLab + headless Chromium, as a user would run it.

Starts JupyterLab (the .venv's, 127.0.0.1, a free port, token auth) on a temporary copy of
notebooks/ (the quickstart's parameters shrunk to 2 loop steps of 2 x 4 samples), opens
01_quickstart.ipynb in Debian's Chromium driven by Playwright and runs every cell (Shift+Enter):
the ipywidgets dashboard renders its CPU/GPU, engine and hit-rate rows and says "running"; the
server's start-up bar ends green; the `run.run(n, live=True)` cell shows an image that changes
from one step to the next under its progress bar, which ends "done"; the final plot cell shows a
figure; after the stop cell the dashboard says "stopped" and the server process is gone.
Screenshots go to test-artifacts/browser-quickstart-*.png. JupyterLab is stopped by its process
group. A second test renders a fake 8 x H200 dashboard in Chromium (the columns must line up).

Needs /usr/bin/chromium (`make browser-deps`); Playwright's own browsers are never installed.
"""
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from waiting import poll_until

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "01_quickstart.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
SMALL_RUN = {"GROUP_SIZE": 4, "GROUPS_PER_STEP": 2, "MORE_STEPS": 2}
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# JupyterLab would otherwise ask, in a toast over the page, whether to fetch Jupyter news.
PAGE_CONFIG = {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}
LAB_START_TIMEOUT_S = 60
CELLS_TIMEOUT_S = 180    # server start, trainer, one GRPO step on 2 shared cores
RUN_TIMEOUT_S = 300      # the whole notebook: 4 small steps, the plot, the stop
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

    def log_tail(self, chars: int = 3000) -> str:
        log = self.root.parent / "jupyterlab.log"
        return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


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
    shrink_parameters(root / "notebooks" / NOTEBOOK)
    config = tmp_path / "jupyter-config"
    (config / "labconfig").mkdir(parents=True)
    (config / "labconfig" / "page_config.json").write_text(json.dumps(PAGE_CONFIG))
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    with running_lab(root, env, tmp_path / "jupyterlab.log") as lab:
        yield lab


@contextlib.contextmanager
def running_lab(root: Path, env: dict, log_path: Path):
    """JupyterLab serving `root` on 127.0.0.1 with a random token, ready when yielded, its process
    group stopped after (the `lab` fixture's, and tools/screenshots.py's)."""
    port, token = free_port(), os.urandom(16).hex()
    cmd = [str(Path(sys.executable).with_name("jupyter")), "lab", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", "--port-retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--allow-root"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        lab = Lab(f"http://127.0.0.1:{port}", token, root, proc)
        try:
            wait_for_lab(lab, log_path)
            yield lab
        finally:
            stop_group(proc)


def shrink_parameters(path: Path) -> None:
    """Set SMALL_RUN in the copy's parameters cell, so the whole notebook runs in about a minute."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    for name, value in SMALL_RUN.items():
        cell.source, n = re.subn(rf"^{name} = .*$", f"{name} = {value!r}", cell.source, flags=re.M)
        assert n == 1, f"{name} is not set in the parameters cell of {path.name}"
    nbformat.write(nb, path)


def wait_for_lab(lab: Lab, log_path: Path) -> None:
    def answers() -> bool:
        if lab.proc.poll() is not None:
            pytest.fail(f"JupyterLab exited ({lab.proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            lab.api("status")
            return True
        except OSError:
            return False

    if poll_until(answers, LAB_START_TIMEOUT_S, poll_s=0.5):
        return
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


def wait_kernel_idle(lab: Lab, timeout_s: float = 60) -> dict:
    """Poll /api/kernels until every kernel is idle. While a kernel is still starting, jupyter_server
    can answer that listing 500: the kernel is listed before its start returns, but kernel_model reads
    `last_activity` / `execution_state`, set only after it (an AttributeError; CI hit it at bed33b1).
    So a 5xx is polled through, and a real failure ends with JupyterLab's log."""
    last = idle = None

    def all_idle() -> bool:
        nonlocal last, idle
        try:
            kernels = last = lab.api("kernels")
        except urllib.error.HTTPError as err:
            if err.code < 500:
                raise
            last = f"HTTP {err.code} from /api/kernels"
            return False
        idle = kernels[0] if kernels and all(k["execution_state"] == "idle" for k in kernels) else None
        return idle is not None

    if poll_until(all_idle, timeout_s, poll_s=0.5):
        return idle
    pytest.fail(f"the kernel was not idle within {timeout_s} s (last answer: {last}); JupyterLab's log:\n"
                f"{lab.log_tail()}")


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


def server_record(lab: Lab, timeout_s: float, errors_shown=lambda: "") -> dict:
    """The pid record the CPU engine server writes in the notebook's run directory, read as soon as
    it appears (the stop cell, queued behind the others, removes it)."""
    record = None

    def written() -> bool:
        nonlocal record
        for path in (lab.root / "runs").glob("*/cpu.server.json"):
            try:
                record = json.loads(path.read_text())
                return True
            except (OSError, json.JSONDecodeError):  # being written or already removed
                pass
        return False

    if poll_until(written, timeout_s, poll_s=0.2):
        return record
    pytest.fail(f"no cpu.server.json under {lab.root / 'runs'} within {timeout_s} s: did the server start? "
                f"Errors shown:\n{errors_shown()}")


def process_is(pid: int, create_time: float) -> bool:
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - create_time) < 0.01
    except psutil.NoSuchProcess:
        return False


def cell_containing(page, text: str):
    """The code cell whose source shows `text` (by content: JupyterLab may not render every cell)."""
    return page.locator(".jp-Notebook .jp-CodeCell").filter(
        has=page.locator(".jp-InputArea", has_text=text)).first


WATCH_LIVE_CELL = """() => {
  // Every (step, image) pair the live cell renders, however fast the steps go, and every text
  // the dashboard's engine row shows (the stop cell may already have run when the test looks).
  window.__artsgLive = [];
  window.__artsgEngine = [];
  const seen = new Set();
  const record = () => {
    for (const row of document.querySelectorAll('.artsg-dashboard .artsg-engine-row')) {
      const text = row.textContent || '';
      if (!window.__artsgEngine.includes(text)) window.__artsgEngine.push(text);
    }
    for (const bar of document.querySelectorAll('.artsg-progress')) {
      const cell = bar.closest('.jp-CodeCell');
      const img = cell && cell.querySelector('.jp-OutputArea-output img');
      const src = img ? img.getAttribute('src') || '' : '';
      const key = bar.dataset.done + '|' + src.length + '|' + src.slice(-96);
      if (!seen.has(key)) {
        seen.add(key);
        window.__artsgLive.push({done: Number(bar.dataset.done), src: src});
      }
    }
  };
  new MutationObserver(record).observe(document.body, {subtree: true, childList: true, attributes: true});
}"""


def test_quickstart_runs_live_in_chromium(lab):
    from playwright.sync_api import sync_playwright

    path = lab.root / "notebooks" / NOTEBOOK
    n_cells = len(json.loads(path.read_text())["cells"])
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{lab.url}/lab/tree/notebooks/{NOTEBOOK}?token={lab.token}")
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            wait_kernel_idle(lab)
            page.evaluate(WATCH_LIVE_CELL)
            run_cells(page, n_cells - 1)  # queued: the kernel runs them one after another
            record = server_record(lab, CELLS_TIMEOUT_S, lambda: failed_cell_output(page))
            hit_rate = page.locator(".artsg-dashboard .artsg-hit-rate[data-value]")
            try:
                hit_rate.wait_for(timeout=CELLS_TIMEOUT_S * 1000)
            except Exception:
                pytest.fail(f"no hit-rate value in the dashboard after {CELLS_TIMEOUT_S} s; "
                            f"errors shown:\n{failed_cell_output(page)}")
            dashboard = page.locator(".artsg-dashboard")
            assert dashboard.locator(".artsg-cpu-row, .artsg-gpu-row").count() >= 1
            engine_rows = page.evaluate("window.__artsgEngine")  # DOM text: an off-screen cell renders none
            assert any("running" in text for text in engine_rows), f"the engine row never said running: {engine_rows}"
            assert 0.0 <= float(hit_rate.get_attribute("data-value")) <= 1.0

            # The loop cell: its own image, redrawn after each step under the progress bar. Steps
            # can outrun any polling (0.05 s each on a fast CI box), so the page records every
            # (step, image) pair it renders from before the cells run (watch_live_cell).
            loop = cell_containing(page, "live=True")
            try:
                loop.locator(".artsg-progress:not([data-done='0'])").wait_for(timeout=CELLS_TIMEOUT_S * 1000)
            except Exception:
                page.screenshot(path=str(ARTIFACTS / "browser-quickstart-failed.png"), full_page=True)
                pytest.fail(f"the loop cell never showed a finished step; it holds:\n{loop.inner_html()[-3000:]}"
                            f"\nerrors:\n{failed_cell_output(page)}")
            loop.screenshot(path=str(ARTIFACTS / "browser-quickstart-live.png"))
            loop.locator(".artsg-progress[data-state='done']").wait_for(timeout=CELLS_TIMEOUT_S * 1000)
            frames = [f for f in page.evaluate("window.__artsgLive")
                      if f["done"] >= 1 and f["src"].startswith("data:image/png")]
            assert len({f["src"] for f in frames}) >= 2, \
                f"the live cell's image did not change between steps (images at steps {[f['done'] for f in frames]})"

            # The stop cell ran last: the dashboard's final refresh says stopped.
            # JupyterLab renders only the cells in view: with the stop cell far below, the dashboard's
            # cell is scrolled back into view before each read (and its engine rows were recorded).
            status, dash_cell = dashboard.locator(".artsg-server-status"), cell_containing(page, "run.dashboard()")

            def says_stopped() -> bool:
                dash_cell.scroll_into_view_if_needed()
                seen = status.all_inner_texts() + page.evaluate("window.__artsgEngine")  # it re-renders: by locator
                return any("stopped" in text for text in seen)

            assert poll_until(says_stopped, RUN_TIMEOUT_S, poll_s=0.5), \
                f"the dashboard does not say stopped: {status.all_inner_texts()!r}; errors:\n{failed_cell_output(page)}"
            wait_kernel_idle(lab, RUN_TIMEOUT_S)
            assert not failed_cell_output(page).strip() or "Traceback" not in failed_cell_output(page)
            assert "run stopped" in dashboard.inner_text()
            plot = cell_containing(page, "fig = run.plot()")
            assert plot.locator(".jp-OutputArea-output img").count() == 1, "the final plot cell has no figure"
            # tqdm.notebook bars (the server start) end green, never red after a success.
            assert page.locator(".jp-OutputArea .progress-bar-danger").count() == 0
            assert page.locator(".jp-OutputArea .progress-bar-success").count() >= 1

            page.locator(".jp-Cell", has=dashboard).evaluate("cell => cell.scrollIntoView({block: 'start'})")
            page.wait_for_timeout(300)
            page.screenshot(path=str(ARTIFACTS / "browser-quickstart-stopped.png"))
            loop.screenshot(path=str(ARTIFACTS / "browser-quickstart-loop-done.png"))
            plot.screenshot(path=str(ARTIFACTS / "browser-quickstart-plot.png"))
        finally:
            browser.close()

    assert not process_is(record["pid"], record["create_time"]), \
        f"the cpu_engine server (pid {record['pid']}) outlived run.stop()"


def test_eight_h200_dashboard_lines_up_in_chromium():
    """The GPU view of an 8 x H200 split (fake NVML readings over six refreshes) as Chromium
    draws it: one aligned table, a sparkline per series. Saved for a look."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing; `make browser-deps` installs Debian's chromium")
    pytest.importorskip("playwright.sync_api")
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(ROOT / "tests"))
    from test_widgets import eight_h200_dashboard

    from artsg_nb.view import widgets

    made = []
    dashboard = eight_h200_dashboard(lambda *a, **kw: made.append(widgets.Dashboard(*a, **kw)) or made[-1])
    html = f"<html><body>{widgets.render_html(dashboard.snapshot)}</body></html>"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 340})
            page.set_content(html)
            lefts = page.eval_on_selector_all(".artsg-gpu-mem", "els => els.map(e => e.getBoundingClientRect().left)")
            assert len(lefts) == 8 and max(lefts) - min(lefts) < 1, f"memory columns do not line up: {lefts}"
            assert page.locator("svg.artsg-spark polyline").count() >= 24
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard-8xh200.png"))
        finally:
            browser.close()
