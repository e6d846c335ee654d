"""The README's screenshots, re-made: the quickstart run in JupyterLab, in headless Chromium.

What it does: starts JupyterLab the way tests/test_browser.py does (this venv's, 127.0.0.1, a
free port, token auth, a temporary copy of notebooks/ with the quickstart's parameters shrunk to
groups of 4, MORE_STEPS=5), opens 01_quickstart.ipynb in Debian's Chromium driven by Playwright,
runs its cells with Shift+Enter as a user would, and saves, each cut to one cell and resized to at
most MAX_WIDTH_PX wide, into docs/screenshots/ (or the folder given):

  quickstart-dashboard.png      the dashboard after a few steps (engine, adapter, hit rate)
  quickstart-plot.png           the training figure after them (reward, ..., hit-rate panel)
  interrupted-step.png          `await run.run(5, live=True)` stopped with the toolbar's stop
                                button during a step: what the loop cell says then
  show-samples.png              `run.show_samples(4)` after it: full completions, reward parts

The steps run on the CPU engine with the shipped tiny model (about two minutes on two cores).

What it does not: check anything (tests/test_browser.py does), or install Chromium
(`make browser-deps`) or Playwright's own browsers.

    .venv/bin/python tools/screenshots.py [OUT_DIR]
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_browser import (CHROMIUM, CHROMIUM_ARGS, NOTEBOOK, PAGE_CONFIG, SMALL_RUN, Lab,  # noqa: E402
                          cell_containing, failed_cell_output, running_lab, shrink_parameters,
                          wait_kernel_idle)

MAX_WIDTH_PX = 1000
MAX_HEIGHT_PX = 1400
"""A taller cell (a long traceback) is cut to its top this high, as a screen shows it."""
VIEWPORT = {"width": 1100, "height": 1700}  # a tall cell is drawn whole only inside the window
LOOP_STEPS = 5
STEP_TIMEOUT_MS = int(os.environ.get("SCREENSHOT_STEP_TIMEOUT_S", 240)) * 1000
NOTEBOOK_SETTINGS = {"windowingMode": "none"}  # every cell rendered, so any can be found and cut out


@contextlib.contextmanager
def jupyter_lab(tmp: Path):
    """JupyterLab on a copy of notebooks/ (test_browser's `lab` fixture, with MORE_STEPS=5)."""
    import shutil

    root = tmp / "lab"
    shutil.copytree(ROOT / "notebooks", root / "notebooks")
    SMALL_RUN["MORE_STEPS"] = LOOP_STEPS
    shrink_parameters(root / "notebooks" / NOTEBOOK)
    config, settings = tmp / "jupyter-config", tmp / "settings" / "@jupyterlab" / "notebook-extension"
    (config / "labconfig").mkdir(parents=True)
    (config / "labconfig" / "page_config.json").write_text(json.dumps({**PAGE_CONFIG, "exposeAppInBrowser": True}))
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps(NOTEBOOK_SETTINGS))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # this checkout's artsg_nb
    env = {**os.environ, "PYTHONPATH": path, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces")}
    with running_lab(root, env, tmp / "jupyterlab.log") as lab:
        yield lab


RUN_CELL = """(i) => {
  const notebook = window.jupyterapp.shell.currentWidget.content;
  notebook.activeCellIndex = i;
  notebook.mode = 'command';
  window.jupyterapp.commands.execute('notebook:run-cell');  // Shift+Enter's run, not awaited
}"""


def run_cells(page, first: int, last: int) -> None:
    """Run cells first..last (indices), queued one after another as Shift+Enter queues them.
    By JupyterLab's own run command: key presses in a loop were dropped now and then."""
    for i in range(first, last + 1):
        page.evaluate(RUN_CELL, i)
        page.wait_for_timeout(100)


def save(locator, path: Path) -> None:
    """A screenshot of one element, resized to at most MAX_WIDTH_PX wide, cut to MAX_HEIGHT_PX."""
    from PIL import Image

    locator.scroll_into_view_if_needed()
    locator.page.wait_for_timeout(300)  # widgets and images settle after a scroll
    locator.screenshot(path=str(path))
    with Image.open(path) as image:
        if image.width > MAX_WIDTH_PX:
            height = round(image.height * MAX_WIDTH_PX / image.width)
            image.resize((MAX_WIDTH_PX, height), Image.LANCZOS).save(path, optimize=True)
    with Image.open(path) as image:
        if image.height > MAX_HEIGHT_PX:
            image = image.crop((0, 0, image.width, MAX_HEIGHT_PX))
        image.convert("RGB").quantize(256).save(path, optimize=True)  # a 256-colour palette: a third the bytes
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def take(page, lab: Lab, out: Path) -> None:
    cells = json.loads((lab.root / "notebooks" / NOTEBOOK).read_text())["cells"]
    sources = ["".join(c["source"]) if c["cell_type"] == "code" else "" for c in cells]  # markdown names them too
    loop_at = next(i for i, s in enumerate(sources) if "live=True" in s)
    samples_at = next(i for i, s in enumerate(sources) if "run.show_samples" in s)
    # The parameters cell through the loop cell: start, chat, dashboard, two steps, the loop of 5.
    run_cells(page, 1, loop_at)
    loop = page.locator(".jp-Notebook .jp-Cell").nth(loop_at)
    try:  # two of the loop's steps done: stop the third with the toolbar's button
        loop.locator(".artsg-progress[data-done='2']").wait_for(timeout=STEP_TIMEOUT_MS)
    except Exception:
        page.screenshot(path=str(out / "failed.png"), full_page=True)
        raise SystemExit(f"(page: {out / 'failed.png'}) "
                         f"the loop cell did not reach step 2 of {LOOP_STEPS}; errors shown:\n{failed_cell_output(page)}")
    page.locator("[data-command='notebook:interrupt-kernel']").first.click()
    wait_kernel_idle(lab, 120)
    page.wait_for_timeout(500)
    save(loop, out / "interrupted-step.png")
    # After the stop, as a user goes on: the history, the plot, show_samples (chat and stop after).
    run_cells(page, loop_at + 1, samples_at)
    wait_kernel_idle(lab, 120)
    save(cell_containing(page, "run.show_samples").locator(".jp-OutputArea"), out / "show-samples.png")
    save(cell_containing(page, "fig = run.plot()").locator(".jp-OutputArea"), out / "quickstart-plot.png")
    save(cell_containing(page, "dashboard = run.dashboard()"), out / "quickstart-dashboard.png")
    run_cells(page, len(sources) - 1, len(sources) - 1)  # run.stop()
    wait_kernel_idle(lab, 60)


def main(out: Path) -> None:
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        raise SystemExit(f"{CHROMIUM} is missing; `make browser-deps` installs Debian's chromium")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="artsg-screenshots-") as tmp, jupyter_lab(Path(tmp)) as lab, \
            sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(f"{lab.url}/lab/tree/notebooks/{NOTEBOOK}?token={lab.token}")
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            wait_kernel_idle(lab)
            page.evaluate("window.jupyterapp.shell.collapseLeft()")  # the notebook takes the width
            take(page, lab, out)
        finally:
            browser.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "screenshots")
