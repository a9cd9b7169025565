"""The server survives what a client sends: every bad input gets its 4xx and the next request is served; a
failing engine step ends only its own requests; the queue is bounded; exact streaming over HTTP."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from _server_utils import KEY, MODEL, H, UvicornThread, tiny_engine, wait_idle

from lab_utils.server.app import create_app


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    app = create_app(engine, MODEL, max_tokens_cap=32, api_key=KEY, max_body_bytes=64_000)
    with UvicornThread(app) as srv:
        srv.engine = engine
        yield srv


def _ok(url: str, n: int = 3) -> None:
    """The server still serves: a good request gets exactly n tokens, /health is green."""
    r = httpx.post(url + "/v1/completions", headers=H,
                   json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": n, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == n
    assert httpx.get(url + "/health").status_code == 200


def test_out_of_vocabulary_prompt_is_a_400_and_the_next_request_succeeds(server):
    for bad in ([10_000_000], [-1], [5, 49152]):
        r = httpx.post(server.url + "/v1/completions", headers=H, json={"model": MODEL, "prompt": bad, "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and "vocabulary" in err["message"] and "[0, 49152)" in err["message"]
        _ok(server.url)
    server.engine.block_manager.check_all_free()


CHAT = "/v1/chat/completions"
BAD_INPUTS = [  # (name, path, body or raw bytes, expected status, a word the message must contain)
    ("temperature_nan", None, b'{"model": "tiny-random", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("temperature_high", None, {"temperature": 2.5}, 400, "temperature"),
    ("top_p_zero", None, {"top_p": 0}, 400, "top_p"),
    ("top_k_negative", None, {"top_k": -2}, 400, "top_k"),
    ("top_k_float", None, {"top_k": 1.5}, 400, "top_k"),
    ("seed_too_big", None, {"seed": 2 ** 70}, 400, "seed"),
    ("max_tokens_zero", None, {"max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens_string", None, {"max_tokens": "many"}, 400, "max_tokens"),
    ("n_too_many", None, {"n": 17}, 400, "n"),
    ("n_times_prompts", None, {"n": 16, "prompt": ["x"] * 17}, 400, "choices per request"),
    ("chat_n_two", CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ("stop_empty", None, {"stop": [""]}, 400, "stop"),
    ("stop_too_many", None, {"stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("prompt_empty_list", None, {"prompt": []}, 400, "prompt"),
    ("prompt_empty_text", None, {"prompt": ""}, 400, "prompt"),
    ("prompt_float_ids", None, {"prompt": [1.5, 2]}, 400, "prompt"),
    ("prompt_bool_ids", None, {"prompt": [True]}, 400, "prompt"),
    ("prompt_mixed_list", None, {"prompt": ["a", 5]}, 400, "prompt"),
    ("prompt_empty_in_list", None, {"prompt": [[5], []]}, 400, "prompt"),
    ("prompt_surrogate", None, b'{"model": "tiny-random", "prompt": "\\ud800"}', 400, "prompt"),
    ("prompt_too_long", None, {"prompt": [7] * 1100}, 400, "max_model_len"),
    ("body_too_large", None, {"prompt": "word " * 20_000}, 413, "limit"),
    ("bad_json", None, b"{not json", 400, "JSON"),
    ("json_array", None, b"[1, 2]", 400, "body"),
    ("wrong_model", None, {"model": "gpt-9"}, 404, "gpt-9"),
    ("chat_bad_role", CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("chat_no_messages", CHAT, {"messages": []}, 400, "messages"),
    ("chat_surrogate", CHAT, b'{"model": "tiny-random", "messages": [{"role": "user", "content": "\\udfff"}]}',
     400, "messages"),
]


@pytest.mark.parametrize("name,path,body,status,word", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_its_4xx_naming_the_problem(server, name, path, body, status, word):
    url = server.url + (path or "/v1/completions")
    headers = dict(H, **{"content-type": "application/json"})
    if isinstance(body, bytes):
        r = httpx.post(url, headers=headers, content=body)
    else:
        base = {"model": MODEL, "prompt": "x", "max_tokens": 2} if path is None else {"model": MODEL, "max_tokens": 2}
        r = httpx.post(url, headers=headers, json={**base, **body})
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert word.lower() in message.lower(), f"{name}: the error should name {word!r}: {message}"
    _ok(server.url, 2)


def test_api_key_is_checked_in_constant_time(server, monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    for headers, status in [({}, 401), ({"Authorization": "Bearer sk-tes"}, 401),
                            ({"Authorization": "Bearer sk-test2"}, 401), ({"Authorization": KEY}, 401), (H, 200)]:
        assert httpx.get(server.url + "/v1/models", headers=headers).status_code == status
    assert len(calls) == 5, "the key must be compared with hmac.compare_digest"


def test_stream_equals_non_stream_for_the_same_seed_and_never_shows_a_stop_string(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "seed": 7,
            "ignore_eos": True}
    plain = httpx.post(server.url + "/v1/completions", headers=H, json=body).json()["choices"][0]["text"]
    assert len(plain) > 12, plain
    stops = [plain[len(plain) // 2:len(plain) // 2 + 3], "\u2603never"]  # one that occurs mid-output
    for stop in (stops, []):
        want = httpx.post(server.url + "/v1/completions", headers=H, json={**body, "stop": stop}).json()
        text = want["choices"][0]["text"]
        got = []
        with httpx.stream("POST", server.url + "/v1/completions", headers=H,
                          json={**body, "stop": stop, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got.append(json.loads(line[6:])["choices"][0]["text"])
                    assert not any(s in "".join(got) for s in stop), "a stop string was streamed"
        assert "".join(got) == text
        if stop:
            assert len(text) < len(plain) and plain.startswith(text) and want["choices"][0]["finish_reason"] == "stop"


def test_a_full_queue_answers_503_with_retry_after():
    engine = tiny_engine(max_num_seqs=1)
    app = create_app(engine, MODEL, max_tokens_cap=32, max_waiting=2)

    async def main(url):
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 16, "ignore_eos": True}
            return await asyncio.gather(*[client.post(url + "/v1/completions", json=body) for _ in range(12)])

    with UvicornThread(app) as srv:
        rs = asyncio.run(main(srv.url))
        codes = sorted(r.status_code for r in rs)
        busy = [r for r in rs if r.status_code == 503]
        assert busy and set(codes) == {200, 503}, codes
        assert all(r.headers.get("retry-after") == "1" and "retry" in r.json()["error"]["message"] for r in busy)
        assert all(r.json()["usage"]["completion_tokens"] == 16 for r in rs if r.status_code == 200)
        text = httpx.get(srv.url + "/metrics").text
        assert re.search(r'lab:requests_rejected_total\{status="503"\} ([0-9.]+)', text).group(1) == f"{len(busy)}.0"
        wait_idle(engine)
        engine.block_manager.check_all_free()


POISON = 4242  # a prompt holding this id makes the (patched) model fail, as a bug hit by one request would


def _poisoned_engine(always: bool = False):
    engine = tiny_engine(max_num_seqs=8)
    real_run = engine.runner.run

    def run(scheduled, *args, **kw):
        if always or any(POISON in req.prompt_token_ids for req, _ in scheduled):
            raise RuntimeError("injected fault: the kernel cannot handle token 4242")
        return real_run(scheduled, *args, **kw)

    engine.runner.run = run
    return engine


def test_a_failing_step_ends_only_its_own_request():
    """Two poisoned requests share their first step with six good ones (the engine waits until all eight are
    queued): that step fails with eight suspects, who rejoin one at a time; a poisoned one fails as the only
    newcomer to a step, beside good requests that keep running, and only it is ended."""
    engine = _poisoned_engine()
    real_has_unfinished, gate = engine.has_unfinished, []
    engine.has_unfinished = lambda: real_has_unfinished() and bool(gate or len(engine.scheduler.waiting) >= 8
                                                                   and not gate.append(1))
    app = create_app(engine, MODEL, max_tokens_cap=32)

    async def main(url):
        async with httpx.AsyncClient(timeout=60) as client:
            def post(prompt, stream=False):
                return client.post(url + "/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stream": stream})
            good = [post([10 + i, 11, 12]) for i in range(6)]
            return await asyncio.gather(post([1, POISON, 2]), post([3, POISON], stream=True), *good)

    with UvicornThread(app) as srv:
        poisoned, poisoned_stream, *good = asyncio.run(main(srv.url))
        assert poisoned.status_code == 500
        assert "engine failed on this request" in poisoned.json()["error"]["message"]
        assert "token 4242" in poisoned.json()["error"]["message"]
        events = [json.loads(x[6:]) for x in poisoned_stream.text.splitlines() if x.startswith("data: {")]
        assert "error" in events[-1] and "token 4242" in events[-1]["error"]["message"]
        assert [r.status_code for r in good] == [200] * 6, [r.text for r in good]
        assert all(r.json()["usage"]["completion_tokens"] == 12 for r in good)
        _ok(srv.url)
        metrics = httpx.get(srv.url + "/metrics").text
        assert re.search(r"^lab:request_failures_total 2\.0$", metrics, re.MULTILINE), metrics
        # one shared failed step, then each poisoned request failing alone: 3 failed steps, 2 failed requests
        assert re.search(r"^lab:engine_step_failures_total 3\.0$", metrics, re.MULTILINE), metrics
        wait_idle(engine)
        engine.block_manager.check_all_free()


def test_an_engine_that_always_fails_turns_health_red():
    """The negative control: when every step fails whoever runs, the engine itself is unusable."""
    engine = _poisoned_engine(always=True)
    app = create_app(engine, MODEL, max_tokens_cap=32)
    with UvicornThread(app) as srv:
        codes = []
        for _ in range(12):
            r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 2})
            codes.append(r.status_code)
            if r.status_code == 503:
                break
        assert codes[0] == 500 and codes[-1] == 503, codes
        assert httpx.get(srv.url + "/health").status_code == 500
