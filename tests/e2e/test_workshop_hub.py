"""A real JupyterHub as `lab_utils workshop` configures it, on loopback in a temporary folder: learners and an
instructor made through the REST API, two learners' servers spawned (their learner copies written at spawn), the
isolation rules that hold on one Unix user (a learner's token opens neither another learner's server, files and
kernels nor the instructor's board: 403), lab 00's first check run in two learners' kernels through the hub (one
right, one wrong) and both results on the board and in its gradebook, then everything stopped, no process left."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from lab_utils.workshop import gpu, sizing
from lab_utils.workshop.config import WorkshopOptions, render

psutil = pytest.importorskip("psutil")
pytest.importorskip("jupyterhub", reason="skipped: jupyterhub not installed (pip install -e .[dev])")
pytest.importorskip("nativeauthenticator", reason="skipped: jupyterhub-nativeauthenticator not installed")
pytest.importorskip("jupyterhub_idle_culler", reason="skipped: jupyterhub-idle-culler not installed")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("configurable-http-proxy") is None,
                                                    reason="skipped: configurable-http-proxy not installed")]
REPO = Path(__file__).resolve().parents[2]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Hub:
    def __init__(self, base: str, token: str) -> None:
        self.base, self.token = base, token

    def call(self, method: str, path: str, body: dict | None = None, token: str | None = None) -> tuple[int, object]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Authorization": f"token {token or self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(errors="replace")
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")


def _run_in_kernel(hub: Hub, user: str, token: str, code: str, timeout: float = 90) -> dict:
    """Start a kernel in `user`'s server beside their lab 00 copy, run `code` there; the execute_reply's content,
    with what the code printed under "stdout"."""
    import asyncio
    import uuid

    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    status, kernel = hub.call("POST", f"/user/{user}/api/kernels", {"path": "student/00_foundations.ipynb"},
                              token=token)
    assert status == 201, kernel

    async def go() -> dict:
        url = hub.base.replace("http", "ws", 1) + f"/user/{user}/api/kernels/{kernel['id']}/channels"
        ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {token}"}))
        msg_id = uuid.uuid4().hex
        ws.write_message(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": user, "session": msg_id,
                       "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        printed, reply, idle = [], None, False  # the reply (shell) and the output (iopub) come in either order
        while reply is None or not idle:
            msg = json.loads(await asyncio.wait_for(ws.read_message(), timeout))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                printed.append(msg["content"]["text"])
            elif msg["msg_type"] == "execute_reply":
                reply = msg["content"]
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
        ws.close()
        return {**reply, "stdout": "".join(printed)}

    try:
        return asyncio.run(go())
    finally:
        hub.call("DELETE", f"/user/{user}/api/kernels/{kernel['id']}", token=token)


ROPE_RIGHT = "def rope(x, positions, theta):\n    return lab00.reference_rope(x, positions, theta)\n"
ROPE_WRONG = "def rope(x, positions, theta):\n    return x.clone()  # forgot to rotate\n"
RUN_CHECK = "from lab_utils.checks import lab00\n{rope}lab00.check_rope(rope, seed=0)\n"
SHOW_DEVICE = "import os\nprint(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['LAB_KV_CACHE_MEMORY_BYTES'])\n"


def _spawn(hub: Hub, user: str, token: str) -> None:
    assert hub.call("POST", f"/hub/api/users/{user}/server", token=token)[0] in (201, 202)


def _wait_ready(hub: Hub, user: str) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        if hub.call("GET", f"/hub/api/users/{user}")[1]["servers"].get("", {}).get("ready"):
            hub.seen.update(p.pid for p in psutil.Process(hub.proc.pid).children(recursive=True))
            return
        time.sleep(1)
    pytest.fail(f"{user}'s server did not start: {hub.log.read_text()[-3000:]}")


@pytest.fixture
def hub(tmp_path):
    port, api, board, hub_port = _free_ports(4)
    admin_token = secrets.token_hex(16)
    o = WorkshopOptions(state=tmp_path / "state", homes=tmp_path / "homes", cache=tmp_path / "cache",
                        labs=REPO / "labs", share=sizing.share(2, ram=16 * sizing.GiB, cores=2), admins=["teach"],
                        port=port, hub_port=hub_port, proxy_api_port=api, board_port=board, unix_users=False,
                        gpu=gpu.GpuRoom(("0", "MIG-test-slice"), 16 * sizing.GiB, 2))  # names only: no GPU used
    o.state.mkdir(parents=True)
    # the test's own service token, to make users and tokens through the REST API as an instructor's script would
    text = render(o) + f"""
c.JupyterHub.services.append({{"name": "test-admin", "api_token": {admin_token!r}}})
c.JupyterHub.load_roles.append({{"name": "test-admin", "services": ["test-admin"],
    "scopes": ["admin:users", "admin:servers", "tokens", "list:users", "read:users"]}})
"""
    (o.state / "jupyterhub_config.py").write_text(text)
    log = (tmp_path / "hub.log").open("w")
    env = dict(os.environ, LAB_CHECKS_LOG="off")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(o.state / "jupyterhub_config.py")],
                            cwd=o.state, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    h = Hub(f"http://127.0.0.1:{port}", admin_token)
    h.homes, h.proc, h.log = o.homes, proc, tmp_path / "hub.log"
    seen: set[int] = set()
    h.seen = seen
    try:
        deadline = time.time() + 90
        while time.time() < deadline and proc.poll() is None:
            try:
                if h.call("GET", "/hub/api/")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"the hub did not answer: {h.log.read_text()[-3000:]}")
        yield h
    finally:
        try:
            seen.update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
        proc.send_signal(signal.SIGTERM)  # the hub stops its servers, services and proxy (cleanup_servers)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        deadline, left = time.time() + 15, []
        while time.time() < deadline:
            left = [p for p in seen if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            if not left:
                break
            time.sleep(0.5)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes left behind after the hub stopped: {left}"


def test_a_room_on_one_box(hub):
    assert hub.call("GET", "/hub/api/users/teach")[1]["admin"] is True  # admins = the instructors
    for name in ("ada", "bob"):
        assert hub.call("POST", f"/hub/api/users/{name}")[0] == 201
    tok = {n: hub.call("POST", f"/hub/api/users/{n}/tokens", {"note": "test"})[1]["token"]
           for n in ("ada", "bob", "teach")}

    # a learner's token cannot act on another learner through the hub's API, nor open the board
    assert hub.call("GET", "/hub/api/users/bob", token=tok["ada"])[0] in (403, 404)
    assert hub.call("POST", "/hub/api/users/bob/server", token=tok["ada"])[0] in (403, 404)
    assert hub.call("POST", "/hub/api/users/bob/tokens", {}, token=tok["ada"])[0] in (403, 404)
    assert hub.call("GET", "/services/board/room.json", token=tok["ada"])[0] == 403
    assert hub.call("GET", "/services/board/", token=tok["ada"])[0] == 403

    # both servers start in their own homes, with the learner copies written at spawn
    for name in ("ada", "bob"):
        _spawn(hub, name, tok[name])
    for name in ("ada", "bob"):
        _wait_ready(hub, name)
        status, listing = hub.call("GET", f"/user/{name}/api/contents/student", token=tok[name])
        assert status == 200, listing
        assert "00_foundations.ipynb" in {item["name"] for item in listing["content"]}
    # ... and stay each learner's own: 403 on the other's files and kernels
    assert hub.call("GET", "/user/ada/api/contents/student", token=tok["bob"])[0] == 403
    assert hub.call("GET", "/user/ada/api/kernels", token=tok["bob"])[0] == 403
    assert hub.call("POST", "/user/ada/api/kernels", {}, token=tok["bob"])[0] == 403

    # lab 00's first check in each learner's own kernel: ada right, bob wrong
    ada = _run_in_kernel(hub, "ada", tok["ada"], RUN_CHECK.format(rope=ROPE_RIGHT))
    assert ada["status"] == "ok", ada
    bob = _run_in_kernel(hub, "bob", tok["bob"], RUN_CHECK.format(rope=ROPE_WRONG))
    assert bob["status"] == "error" and bob["ename"] == "AssertionError", bob
    assert (hub.homes / "ada" / "student" / ".lab_checks.jsonl").exists()  # each in their own home

    # each learner's kernel sees their own device (round-robin by account) and the room's GPU KV budget
    room = gpu.GpuRoom(("0", "MIG-test-slice"), 16 * sizing.GiB, 2)
    seen = {name: _run_in_kernel(hub, name, tok[name], SHOW_DEVICE)["stdout"].split() for name in ("ada", "bob")}
    assert {seen["ada"][0], seen["bob"][0]} == set(room.devices), seen  # accounts made one after the other
    assert seen["ada"][1] == seen["bob"][1] == str(room.kv_bytes), seen

    # the instructor's board and gradebook show both results
    status, room = hub.call("GET", "/services/board/room.json", token=tok["teach"])
    assert status == 200, room
    got = {(r["learner"], r["check"]): r for r in room["rows"]}
    assert got[("ada", "check_rope")]["last_result"] == "passed"
    assert "differ" in got[("bob", "check_rope")]["last_result"]
    status, page = hub.call("GET", "/services/board/", token=tok["teach"])
    assert status == 200 and ">ada<" in page and ">bob<" in page and "rope" in page
    status, grades = hub.call("GET", "/services/board/grades.csv", token=tok["teach"])
    assert status == 200 and grades.splitlines()[0].startswith("learner,lab,check")
    assert sum(line.startswith(("ada,00,check_rope", "bob,00,check_rope")) for line in grades.splitlines()) == 2

    for name in ("ada", "bob"):
        assert hub.call("DELETE", f"/hub/api/users/{name}/server", token=tok[name])[0] in (202, 204)


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--disable-quic"]


def test_a_learner_signs_up_is_approved_logs_in_and_opens_lab_00_in_a_browser(hub):
    """The room's day through the hub's own pages in Chromium: a learner signs up, an instructor approves them at
    /hub/authorize, the learner logs in, their server starts with their copies and lab 00 opens from them."""
    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")
    password = {"cleo": secrets.token_urlsafe(12), "teach": secrets.token_urlsafe(12)}
    shots = REPO / "out" / "e2e"
    shots.mkdir(parents=True, exist_ok=True)

    def sign_up(page, name: str) -> str:
        page.goto(f"{hub.base}/hub/signup")
        page.fill("#username_input", name)
        page.fill("#password_input", password[name])
        page.fill("#password_confirmation_input", password[name])
        page.click("#signup_submit")
        page.wait_for_load_state()
        return page.inner_text("body")

    def log_in(page, name: str) -> None:
        page.goto(f"{hub.base}/hub/login")
        page.fill("#username_input", name)
        page.fill("#password_input", password[name])
        page.click("#login_submit")

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS, headless=True)
        try:
            learner = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            assert "sent to the admin" in sign_up(learner, "cleo")  # the learner waits for an instructor
            log_in(learner, "cleo")
            learner.wait_for_load_state()
            assert "/hub/login" in learner.url  # not approved yet: still at the login page

            teach = browser.new_context().new_page()
            sign_up(teach, "teach")  # an instructor is approved as they sign up
            log_in(teach, "teach")
            teach.wait_for_url("**/hub/**", timeout=60_000)
            teach.goto(f"{hub.base}/hub/authorize")
            teach.click("a[href$='authorize/cleo']")
            teach.wait_for_load_state()

            log_in(learner, "cleo")  # approved: the hub starts cleo's server and sends her to her copies
            learner.wait_for_url("**/user/cleo/lab**", timeout=180_000)
            _wait_ready(hub, "cleo")
            learner.goto(f"{hub.base}/user/cleo/lab/tree/student/00_foundations.ipynb", timeout=120_000)
            learner.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
            # the open document's tab: the learner's copy in student/, its kernel started
            learner.wait_for_selector(".lm-TabBar-tab.lm-mod-current[title*='Path: student/00_foundations.ipynb']",
                                      timeout=60_000)
            learner.wait_for_selector(".jp-DirListing-item.jp-mod-running[title*='00_foundations.ipynb']",
                                      timeout=60_000)
            assert "Foundations" in learner.locator(".jp-NotebookPanel .jp-Cell").first.inner_text()
            learner.screenshot(path=str(shots / "workshop_hub_lab00.png"))
        finally:
            browser.close()
    assert (hub.homes / "cleo" / "student" / "00_foundations.ipynb").exists()
    assert hub.call("DELETE", "/hub/api/users/cleo/server")[0] in (202, 204)
