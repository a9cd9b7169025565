"""Nothing outlives the server: after a json_schema request (which starts the schema-compile worker processes
and multiprocessing's resource tracker), a signal to the server's PID alone (not its process group, as a
supervisor with `KillMode=process` or a notebook's `proc.terminate()` sends it) ends every descendant within
5 s, whether the signal is SIGTERM, SIGINT or SIGKILL."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

pytest.importorskip("xgrammar")

from lab_utils.server.process import LabServer  # noqa: E402

MODEL, KEY = "tiny-random", "sk-test"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live (not zombie) process below `pid`."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        out = {}
        for p in psutil.Process(pid).children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out[p.pid] = " ".join(p.cmdline())
            except psutil.NoSuchProcess:
                pass
        return out
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z":
                parents[int(d)] = int(stat[1])
    found, frontier = {}, {pid}
    while frontier:
        frontier = {c for c, pp in parents.items() if pp in frontier and c not in found}
        for c in frontier:
            found[c] = open(f"/proc/{c}/cmdline").read().replace("\0", " ")
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_descendants_end_within_5_s_of_the_server(sig):
    srv = LabServer(MODEL, device="cpu", api_key=KEY, max_num_seqs=4).start()
    try:
        r = httpx.post(srv.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       timeout=120, json={"model": MODEL, "messages": [{"role": "user", "content": "a number"}],
                                          "max_tokens": 8, "response_format": {
                                              "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}})
        assert r.status_code == 200, r.text
        kids = descendants(srv.proc.pid)
        workers = [p for p, cmd in kids.items() if "multiprocessing" in cmd]
        assert len(workers) >= 2, f"the json_schema request should have started compile workers: {kids}"
        os.kill(srv.proc.pid, sig)  # the PID alone, not the group
        srv.proc.wait(30)
        deadline = time.monotonic() + 5.0
        left = list(kids)
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [p for p in left if alive(p)]
        assert not left, (f"after {sig.name} to the server alone, still alive 5 s later: "
                          f"{ {p: kids[p] for p in left} }\n{srv.log_tail()}")
    finally:
        srv.stop()  # the group, should anything have survived
