"""Load with faults: many concurrent streams, some clients leaving mid-stream, some requests malformed.

`run_fault_load(url, model)` sends them all at once and checks what each should get: a well-formed stream
gets exactly `max_tokens` tokens (counted from the chunks' token ids and the final usage), a malformed request
a 4xx with an error message, a client that leaves gets whatever it read. It returns counts, the problems it
saw, and the time to first token (TTFT) of the complete streams. Used by tests/e2e and benchmarks/.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

# bodies a client might send by mistake, each of which must get a 4xx (key: what is wrong)
MALFORMED = {
    "token id outside the vocabulary": {"prompt": [10_000_000]},
    "negative token id": {"prompt": [-5, 3]},
    "negative temperature": {"temperature": -1},
    "empty prompt": {"prompt": ""},
    "top_p of 0": {"top_p": 0},
    "max_tokens as text": {"max_tokens": "ten"},
    "not JSON": b"{\"model\": ",
}


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


async def _stream(client, url, body, headers, leave_after: int | None) -> dict:
    t0 = time.perf_counter()
    ttft, tokens, usage, finish, events = None, 0, None, None, 0
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": (await r.aread()).decode(errors="replace")[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"status": 500, "error": chunk["error"]["message"]}
            if not chunk["choices"]:  # the usage chunk (stream_options.include_usage), last before [DONE]
                usage = chunk["usage"]
                continue
            choice = chunk["choices"][0]
            if choice["token_ids"] and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += len(choice["token_ids"])
            finish = choice["finish_reason"] or finish
            events += 1
            if leave_after is not None and events >= leave_after:
                return {"status": 200, "left": True, "tokens": tokens}  # closing the stream drops the connection
    return {"status": 200, "ttft": ttft, "tokens": tokens, "usage": usage, "finish": finish}


async def _malformed(client, url, body, headers) -> dict:
    if isinstance(body, bytes):
        r = await client.post(url + "/v1/completions", content=body, headers={**headers, "content-type": "application/json"})
    else:
        r = await client.post(url + "/v1/completions", json=body, headers=headers)
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = ""
    return {"status": r.status_code, "message": message}


async def _run(url: str, model: str, n: int, disconnect_frac: float, malformed_frac: float, max_tokens: int,
               seed: int, headers: dict, timeout_s: float) -> dict:
    import httpx

    rng = random.Random(seed)
    kinds = ["malformed"] * round(n * malformed_frac) + ["leave"] * round(n * disconnect_frac)
    kinds += ["full"] * (n - len(kinds))
    rng.shuffle(kinds)
    bad = list(MALFORMED.items())
    base = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    jobs, plan = [], []
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        for i, kind in enumerate(kinds):
            prompt = [rng.randrange(100, 40_000) for _ in range(rng.randint(4, 24))]
            if kind == "malformed":
                name, patch = bad[i % len(bad)]
                body = patch if isinstance(patch, bytes) else {**base, "prompt": prompt, **patch}
                jobs.append(_malformed(client, url, body, headers))
                plan.append((kind, name))
            else:
                leave = rng.randint(1, max(1, max_tokens - 1)) if kind == "leave" else None
                jobs.append(_stream(client, url, {**base, "prompt": prompt}, headers, leave))
                plan.append((kind, leave))
        t0 = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), timeout_s)
        wall = time.perf_counter() - t0
    problems, ttfts = [], []
    for (kind, what), res in zip(plan, results):
        if isinstance(res, BaseException):
            problems.append(f"{kind} request raised {type(res).__name__}: {res}")
        elif kind == "malformed":
            if not (400 <= res["status"] < 500 and res["message"]):
                problems.append(f"malformed ({what}) got {res['status']} {res['message']!r}, not a 4xx with a message")
        elif res["status"] != 200:
            problems.append(f"{kind} stream got {res['status']}: {res.get('error')}")
        elif kind == "full":
            used = (res["usage"] or {}).get("completion_tokens")
            if res["tokens"] != max_tokens or used != max_tokens or res["finish"] != "length":
                problems.append(f"a stream got {res['tokens']} tokens (usage {used}, finish {res['finish']}), "
                                f"not {max_tokens}")
            if res["ttft"] is not None:
                ttfts.append(res["ttft"])
    return {
        "num_requests": n, "num_full": kinds.count("full"), "num_left": kinds.count("leave"),
        "num_malformed": kinds.count("malformed"), "max_tokens": max_tokens, "wall_s": round(wall, 3),
        "ttft_p50_ms": None if not ttfts else round(1000 * _percentile(ttfts, 50), 1),
        "ttft_p99_ms": None if not ttfts else round(1000 * _percentile(ttfts, 99), 1),
        "problems": problems,
    }


def run_fault_load(url: str, model: str, n: int = 200, disconnect_frac: float = 0.2, malformed_frac: float = 0.05,
                   max_tokens: int = 8, seed: int = 0, headers: dict | None = None, timeout_s: float = 300.0) -> dict:
    """Send `n` requests at once to an OpenAI-compatible server and check each; see the module docstring."""
    return asyncio.run(_run(url, model, n, disconnect_frac, malformed_frac, max_tokens, seed, headers or {},
                            timeout_s))
