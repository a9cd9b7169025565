"""A request's head is bounded in size (431) and in time (408) while it is read, before the API key check;
malformed HTTP is a 400; all three answer OpenAI's error object, and the server keeps serving."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from _server_utils import KEY, MODEL, H, UvicornThread, tiny_engine

from lab_utils.server.app import create_app
from lab_utils.server.http_limits import MAX_HEADER_BYTES, GuardedHttpTools


class QuickHeaders(GuardedHttpTools):
    header_timeout_s = 1.0


@pytest.fixture(scope="module")
def server():
    app = create_app(tiny_engine(), MODEL, max_tokens_cap=32, api_key=KEY)
    with UvicornThread(app, http=QuickHeaders) as srv:
        srv.port = int(srv.url.rsplit(":", 1)[1])
        yield srv


def _raw(port: int, data: bytes, wait_s: float = 0.0) -> bytes:
    """Send `data`, then read the answer until the server closes (at most 10 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        time.sleep(wait_s)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return out


def _error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, json.loads(body)["error"]


def _serves(url: str) -> None:
    r = httpx.post(url + "/v1/completions", headers=H, timeout=60,
                   json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_an_endless_header_is_a_431(server):
    big = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1000)
    status, err = _error(_raw(server.port, big))  # never finished: refused as soon as it passes the limit
    assert status == 431 and "headers" in err["message"] and err["code"] is None and err["param"] is None
    _serves(server.url)


def test_a_slow_header_is_a_408(server):
    t0 = time.perf_counter()
    status, err = _error(_raw(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ab"))
    assert status == 408 and "did not arrive" in err["message"], err
    assert time.perf_counter() - t0 < 5
    _serves(server.url)


def test_malformed_http_is_a_400_error_object(server):
    status, err = _error(_raw(server.port, b"NOT HTTP AT ALL\x00\r\n\r\n"))
    assert status == 400 and err["type"] == "invalid_request_error"
    _serves(server.url)


def test_ordinary_and_keep_alive_requests_are_unaffected(server):
    with httpx.Client() as c:  # one connection, several requests, slower than the header timeout in total
        for _ in range(3):
            assert c.get(server.url + "/health").status_code == 200
            time.sleep(0.6)
    _serves(server.url)
