"""A real JupyterHub as `lab_utils workshop` configures it, on loopback in a temporary folder: learners and an
instructor made through the REST API, one learner's server spawned (its learner copies written at spawn), the
isolation rules that hold on one Unix user (a learner's token opens neither another learner's server nor the
instructor's board: 403), the board listing the room's checks, then everything stopped and no process left."""
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

from lab_utils.workshop import sizing
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


def _record_real_checks(home: Path, monkeypatch) -> None:
    """One right and one wrong answer to lab 00's first check, recorded by the check itself in the learner's home."""
    from lab_utils.checks import lab00

    monkeypatch.setenv("LAB_CHECKS_LOG", str(home / "student" / ".lab_checks.jsonl"))
    lab00.check_rope(lambda x, p, t: lab00.reference_rope(x, p, t), seed=0)
    with pytest.raises(AssertionError):
        lab00.check_rope(lambda x, p, t: x.clone(), seed=0)
    monkeypatch.setenv("LAB_CHECKS_LOG", "off")


@pytest.fixture
def hub(tmp_path):
    port, api, board, hub_port = _free_ports(4)
    admin_token = secrets.token_hex(16)
    o = WorkshopOptions(state=tmp_path / "state", homes=tmp_path / "homes", cache=tmp_path / "cache",
                        labs=REPO / "labs", share=sizing.share(2, ram=16 * sizing.GiB, cores=2), admins=["teach"],
                        port=port, hub_port=hub_port, proxy_api_port=api, board_port=board, unix_users=False)
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


def test_a_room_on_one_box(hub, monkeypatch):
    assert hub.call("GET", "/hub/api/users/teach")[1]["admin"] is True  # admins = the instructors
    for name in ("ada", "bob"):
        assert hub.call("POST", f"/hub/api/users/{name}")[0] == 201
    tok = {n: hub.call("POST", f"/hub/api/users/{n}/tokens", {"note": "test"})[1]["token"]
           for n in ("ada", "bob", "teach")}

    _record_real_checks(hub.homes / "ada", monkeypatch)
    _record_real_checks(hub.homes / "bob", monkeypatch)

    # the instructor's board: the admin sees both learners' results; a learner is refused
    status, room = hub.call("GET", "/services/board/room.json", token=tok["teach"])
    assert status == 200, room
    got = {(r["learner"], r["check"]): r for r in room["rows"]}
    assert {"ada", "bob"} <= set(room["learners"])
    assert got[("ada", "check_rope")]["attempts"] == 2 and "differ" in got[("ada", "check_rope")]["last_result"]
    status, page = hub.call("GET", "/services/board/", token=tok["teach"])
    assert status == 200 and "check_rope".removeprefix("check_") in page and "ada" in page
    status, grades = hub.call("GET", "/services/board/grades.csv", token=tok["teach"])
    assert status == 200 and grades.splitlines()[0].startswith("learner,lab,check")
    assert hub.call("GET", "/services/board/room.json", token=tok["ada"])[0] == 403
    assert hub.call("GET", "/services/board/", token=tok["ada"])[0] == 403

    # a learner's token cannot act on another learner through the hub's API
    assert hub.call("GET", "/hub/api/users/bob", token=tok["ada"])[0] in (403, 404)
    assert hub.call("POST", "/hub/api/users/bob/server", token=tok["ada"])[0] in (403, 404)
    assert hub.call("POST", "/hub/api/users/bob/tokens", {}, token=tok["ada"])[0] in (403, 404)

    # ada's server: spawned in her home with her learner copies; bob's token cannot open it
    assert hub.call("POST", "/hub/api/users/ada/server", token=tok["ada"])[0] in (201, 202)
    deadline = time.time() + 120
    while time.time() < deadline:
        model = hub.call("GET", "/hub/api/users/ada")[1]
        if model["servers"].get("", {}).get("ready"):
            break
        time.sleep(1)
    else:
        pytest.fail(f"ada's server did not start: {hub.log.read_text()[-3000:]}")
    hub.seen.update(p.pid for p in psutil.Process(hub.proc.pid).children(recursive=True))
    status, listing = hub.call("GET", "/user/ada/api/contents/student", token=tok["ada"])
    assert status == 200, listing
    assert "00_foundations.ipynb" in {item["name"] for item in listing["content"]}
    assert (hub.homes / "ada" / "student" / "00_foundations.ipynb").exists()
    assert hub.call("GET", "/user/ada/api/contents/student", token=tok["bob"])[0] == 403
    assert hub.call("GET", "/user/ada/api/kernels", token=tok["bob"])[0] == 403
    assert hub.call("DELETE", "/hub/api/users/ada/server", token=tok["ada"])[0] in (202, 204)
