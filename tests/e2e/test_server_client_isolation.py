"""No client can stop the service or hold it: grammars that admit nothing are refused or ended alone (never an
engine failure), a slow schema compiles off the event loop under a time limit, and a request whose client left
is aborted with its KV blocks freed. Loopback only; every request loop is bounded."""
from __future__ import annotations

import json
import random
import socket
import statistics
import threading
import time

import httpx
import pytest
from _server_utils import KEY, MODEL, H, UvicornThread, tiny_engine, wait_idle

pytest.importorskip("xgrammar")

from lab_utils.server.app import create_app  # noqa: E402

CHAT = "/v1/chat/completions"
REF = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
BAD_SCHEMAS = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {}, "additionalProperties": False, "required": ["a"]},
    {"type": "object", "required": ["x"],
     "properties": {"x": {"type": "object", "properties": {}, "additionalProperties": False, "required": ["y"]}}},
]
# an object of 12 long strings: compiling its grammar takes far longer than the test server's 3 s limit on any CPU
SLOW_SCHEMA = {"type": "object",
               "properties": {f"field_{i}": {"type": "string", "maxLength": 980 - i} for i in range(12)},
               "required": [f"field_{i}" for i in range(12)], "additionalProperties": False}
GOOD_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": ["n"], "additionalProperties": False}


def _tool(params: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": params}}


def _random_request(rng: random.Random) -> tuple[str, dict]:
    """One request from the mix: a bad schema (response_format or a tool's parameters), a good one, or plain."""
    msgs = [{"role": "user", "content": rng.choice(["hi", "give me json", "weather?"])}]
    common = {"model": MODEL, "max_tokens": rng.choice([4, 16, 40]), "temperature": rng.choice([0, 1]),
              "seed": rng.randrange(100)}
    kind = rng.choice(["bad_format", "bad_tool", "good_format", "plain_chat", "plain_text", "plain_stream"])
    if kind == "bad_format":
        return CHAT, {**common, "messages": msgs, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": rng.choice(BAD_SCHEMAS)}}}
    if kind == "bad_tool":
        return CHAT, {**common, "messages": msgs, "tools": [_tool(rng.choice(BAD_SCHEMAS))],
                      "tool_choice": rng.choice(["required", {"type": "function", "function": {"name": "f"}}])}
    if kind == "good_format":
        return CHAT, {**common, "messages": msgs, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": GOOD_SCHEMA}}}
    if kind == "plain_chat":
        return CHAT, {**common, "messages": msgs}
    return "/v1/completions", {**common, "prompt": "once upon a time", "stream": kind == "plain_stream"}


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    app = create_app(engine, MODEL, max_tokens_cap=1024, api_key=KEY, compile_timeout_s=3.0)
    with UvicornThread(app) as srv:
        srv.engine, srv.aengine = engine, app.state.async_engine
        yield srv


def _reference(url: str) -> str:
    r = httpx.post(url + "/v1/completions", headers=H, json=REF, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("seed", [0, 1])
def test_no_mix_of_client_requests_reaches_the_engine_failure_rule(server, seed):
    """Random mixes of bad schemas, bad tools and plain requests, four at a time: every bad one is a 400 naming
    its field, no request is a 5xx, no engine step fails, /health stays green and the reference text is unchanged."""
    before = _reference(server.url)
    rng = random.Random(seed)
    batch = [_random_request(rng) for _ in range(24)]
    results: list[tuple[dict, int, str]] = []

    def send(chunk):
        with httpx.Client(headers=H, timeout=120) as c:
            for path, body in chunk:
                r = c.post(server.url + path, json=body)
                results.append((body, r.status_code, r.text))

    threads = [threading.Thread(target=send, args=(batch[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == len(batch)
    for body, status, text in results:
        bad = any(json.dumps(s) in json.dumps(body) for s in BAD_SCHEMAS)
        if bad:
            assert status == 400, (body, text)
            err = json.loads(text)["error"]
            assert status == 400 and err["param"] in ("response_format", "tools"), text
            assert isinstance(err["code"], (str, type(None))), text
        else:
            assert status == 200, text
            assert "data: {\"error\"" not in text, text
    wait_idle(server.engine)
    assert server.aengine.num_step_failures == 0 and server.aengine.error is None
    assert httpx.get(server.url + "/health").status_code == 200
    assert _reference(server.url) == before
    server.engine.block_manager.check_all_free()


def test_a_slow_schema_compiles_off_the_loop_and_is_refused_past_the_limit(server):
    """An object of 12 strings of up to 980 characters takes tens of seconds to compile (a single
    {"type": "string", "maxLength": 1000} took 7.7 s on one machine and under the 3 s limit on a faster one):
    meanwhile /health answers quickly and a running stream keeps flowing; past the 3 s limit the client gets
    400 "schema too complex"."""
    before = _reference(server.url)
    slow = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SLOW_SCHEMA}}}
    answer: dict = {}

    def send_slow():
        r = httpx.post(server.url + CHAT, headers=H, json=slow, timeout=120)
        answer.update(status=r.status_code, body=r.json())

    gaps: list[float] = []

    def stream():
        body = {**REF, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", headers=H, json=body, timeout=120) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    def poll_health(c: httpx.Client, until) -> list[float]:
        ms = []
        while not until() and len(ms) < 400:
            t = time.perf_counter()
            assert c.get(server.url + "/health").status_code == 200
            ms.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.05)
        return ms

    streamer = threading.Thread(target=stream)
    streamer.start()
    sender = threading.Thread(target=send_slow)
    with httpx.Client() as c:
        t0 = time.perf_counter()
        calm = poll_health(c, lambda: time.perf_counter() - t0 > 2.0)  # the same stream, no compile
        sender.start()
        busy = poll_health(c, lambda: not sender.is_alive())
    sender.join(timeout=60)
    streamer.join(timeout=120)
    med = statistics.median
    print(f"/health, stream running: alone median {med(calm):.1f} ms max {max(calm):.1f} ms (n={len(calm)}); "
          f"while the schema compiles median {med(busy):.1f} ms max {max(busy):.1f} ms (n={len(busy)}); "
          f"stream: largest gap {max(gaps) * 1e3:.0f} ms over {len(gaps)} chunks")
    assert answer["status"] == 400 and answer["body"]["error"]["code"] == "schema_too_complex", answer
    assert "schema too complex" in answer["body"]["error"]["message"]
    assert len(busy) >= 5
    # A loop blocked by the compile would hold one /health, and the stream, for all of it (> 3 s, the limit).
    # The target is 100 ms for /health and 1 s for the stream's gap; this shared 2-core machine runs at a load
    # of ~11 (and this test's clients share the server's process), where /health alone already takes up to
    # ~170 ms: the bars get that slack, and still fail a blocked loop.
    assert max(busy) < 1500 and med(busy) < max(250.0, 3 * med(calm)), (calm, busy)
    assert max(gaps) < 1.5, max(gaps)
    assert _reference(server.url) == before and httpx.get(server.url + "/health").status_code == 200


def _wait_free(engine, within_s: float) -> float:
    t0 = time.perf_counter()
    while engine.scheduler.has_work() or engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
        assert time.perf_counter() - t0 < within_s, f"still busy after {within_s} s: {engine.stats()}"
        time.sleep(0.02)
    return time.perf_counter() - t0


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_ends_when_its_client_leaves(server, stream):
    wait_idle(server.engine)
    aborted = server.engine.num_aborted
    body = json.dumps({**REF, "max_tokens": 1000, "stream": stream}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        t0 = time.perf_counter()
        while not server.engine.scheduler.has_work():
            assert time.perf_counter() - t0 < 30
            time.sleep(0.01)
        time.sleep(0.2)  # it runs
    freed_s = _wait_free(server.engine, within_s=3.0)
    print(f"stream={stream}: KV blocks back {freed_s * 1e3:.0f} ms after the client closed")
    assert server.engine.num_aborted == aborted + 1
    assert freed_s < 3.0  # about a second is the aim; slack for a loaded machine
