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
    body_timeout_s = 2.0


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


SLOW_BODY_HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")


def test_a_slow_body_is_a_408_and_the_connection_closed(server):
    t0 = time.perf_counter()
    status, err = _error(_raw(server.port, SLOW_BODY_HEAD + b'{"model": '))  # then nothing more
    took = time.perf_counter() - t0
    assert status == 408 and "body did not arrive within 2 s" in err["message"], err
    assert QuickHeaders.body_timeout_s <= took < QuickHeaders.body_timeout_s + 3, took  # _raw read to the close
    _serves(server.url)


def test_trickling_bodies_are_all_closed_at_the_deadline(server):
    """Many clients each sending a byte now and then (slow POST): every connection is closed by the deadline."""
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(50)]
    try:
        for s in socks:
            s.sendall(SLOW_BODY_HEAD + b"{")
        time.sleep(1.0)
        for s in socks:
            s.sendall(b" ")  # still trickling: the deadline is for the whole body, not between bytes
        time.sleep(QuickHeaders.body_timeout_s + 1.5)
        for s in socks:
            s.settimeout(5)
            answer = b""
            while chunk := s.recv(65536):  # b"" once the server closed its side
                answer += chunk
            assert _error(answer)[0] == 408
    finally:
        for s in socks:
            s.close()
    _serves(server.url)


def test_a_body_sent_in_pieces_within_the_deadline_is_served(server):
    body = json.dumps({"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "ignore_eos": True}).encode()
    head = SLOW_BODY_HEAD.replace(b"100000", str(len(body)).encode())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head)
        for i in range(0, len(body), len(body) // 4 + 1):
            time.sleep(0.3)  # 4 pieces over about 1.2 s: slower than one packet, well within 2 s
            s.sendall(body[i:i + len(body) // 4 + 1])
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_an_idle_keep_alive_connection_outlives_the_body_deadline(server):
    with httpx.Client() as c:  # the deadline ended with the first request's body: it does not close the connection
        assert c.get(server.url + "/health").status_code == 200
        time.sleep(QuickHeaders.body_timeout_s + 0.5)
        r = c.post(server.url + "/v1/completions", headers=H, timeout=60,
                   json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
