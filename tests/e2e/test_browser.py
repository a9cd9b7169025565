"""JupyterLab in a real browser: open lab 00, run every cell through the UI (SMOKE), no error, a plotly figure.

Needs Debian's `chromium` (installed by .ci/run) and the `playwright` Python package; skips with the reason
when either is missing. The notebook runs from a temporary copy, so the repository's file is never modified.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "labs" / "00_foundations.ipynb"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = REPO / "out" / "e2e"
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--disable-quic"]

pytestmark = pytest.mark.notebooks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def jupyter(tmp_path):
    if not LAB.exists():
        pytest.skip("labs/00_foundations.ipynb does not exist yet")
    work = tmp_path / "labs"
    work.mkdir()
    shutil.copy(LAB, work / LAB.name)
    port, token = _free_port(), secrets.token_hex(16)
    # render every cell (JupyterLab 4 virtualises long notebooks, hiding off-screen cells from the page) and
    # do not ask about news: user settings in a private folder
    settings = tmp_path / "lab-settings"
    (settings / "@jupyterlab" / "notebook-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none"}))
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env = dict(os.environ, LAB_SMOKE="1", LAB_INTERACTIVE="0", HF_HUB_OFFLINE="1",
               JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTER_CONFIG_DIR=str(tmp_path / "jcfg"), JUPYTER_RUNTIME_DIR=str(tmp_path / "jrt"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--ServerApp.open_browser=False",
         *(["--allow-root"] if os.geteuid() == 0 else []),
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None else ""
                pytest.fail(f"JupyterLab did not answer on {url} within 90 s\n{out[-2000:]}")
            time.sleep(0.5)
        yield url, token, work / LAB.name
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Stop JupyterLab and its kernels (one process group); no process outlives the test."""
    for sig, wait in ((15, 20), (9, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _accept_dialogs(page, quiet_s: float = 5.0, limit_s: float = 60.0) -> list[str]:
    """Accept any dialog (e.g. "select a kernel": the default) until none has shown for `quiet_s` seconds."""
    seen, start, last = [], time.time(), time.time()
    while time.time() - last < quiet_s and time.time() - start < limit_s:
        dialog = page.locator(".jp-Dialog")
        if dialog.count():
            seen.append(dialog.first.inner_text()[:200])
            page.locator(".jp-Dialog .jp-mod-accept").first.click()
            last = time.time()
        time.sleep(0.5)
    return seen


def test_jupyterlab_answers_then_stops(jupyter):
    url, token, _ = jupyter
    with urllib.request.urlopen(f"{url}/lab?token={token}", timeout=10) as r:
        assert r.status == 200 and b"JupyterLab" in r.read()


def test_lab00_runs_in_the_browser(jupyter):
    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")
    url, token, nb_path = jupyter
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{url}/lab/tree/{nb_path.name}?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                                   ".jp-Toolbar-kernelStatus", timeout=120_000)
            time.sleep(2)  # let the kernel finish starting
            _accept_dialogs(page)  # e.g. "select a kernel" (accept the default) or the news prompt
            page.click(".lm-MenuBar-itemLabel:text-is('Run')", timeout=30_000)  # the main menu
            page.click(".lm-Menu-itemLabel:text-is('Run All Cells')", timeout=30_000)
            # wait until no cell is queued or running ([*]) and every code cell has an execution count
            deadline = time.time() + 900
            while time.time() < deadline:
                time.sleep(3)
                prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
                if prompts and not any("*" in t for t in prompts) and all(any(c.isdigit() for c in t) for t in prompts):
                    break
            else:
                pytest.fail("the notebook did not finish within 15 minutes in the browser")
            page.keyboard.press("Control+s")
            time.sleep(2)
            page.screenshot(path=str(ARTIFACTS / "lab00_browser.png"), full_page=False)
            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] "
                                  ":text('Traceback')").count()
            plots = page.locator(".js-plotly-plot, .plot-container").count()
        finally:
            browser.close()
    saved = json.loads(nb_path.read_text())
    cell_errors = [o for c in saved["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])
                   if o.get("output_type") == "error"]
    assert not cell_errors, f"cells failed in the browser: {[e.get('ename') + ': ' + e.get('evalue', '') for e in cell_errors]}"
    assert errors == 0, "a traceback is shown in the page"
    assert plots >= 1, "no plotly figure rendered in the page"
