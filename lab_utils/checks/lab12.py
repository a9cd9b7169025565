"""Checks for lab 12's exercises: parsing a server-sent-events stream, and latency from chunk arrival times.

Each check builds a fresh random stream / timeline, compares the learner's answer with the reference, and says
what differs without showing the reference code.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable


def reference_parse_sse(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        out.append(json.loads(data))
    return out


def _random_stream(rng: random.Random) -> tuple[list[str], list[dict]]:
    chunks = [{"id": "cmpl-x", "choices": [{"index": 0, "text": rng.choice(["a", " b", "c ", "", " [DONE] "]),
                                            "token_ids": [rng.randrange(1000)]}]} for _ in range(rng.randint(2, 8))]
    lines: list[str] = []
    if rng.random() < 0.5:
        lines.append(": keep-alive comment")
    for c in chunks:
        lines.append("data: " + json.dumps(c) if rng.random() < 0.7 else "data:" + json.dumps(c))
        lines.append("")  # events are separated by blank lines
    lines += ["data: [DONE]", ""]
    if rng.random() < 0.5:
        lines += ["data: " + json.dumps({"after": "done"}), ""]  # nothing after [DONE] counts
    return lines, chunks


def check_parse_sse(fn: Callable[[list[str]], list[dict]], seed: int | None = None) -> None:
    rng = random.Random(seed)
    for trial in range(20):
        lines, expected = _random_stream(rng)
        got = fn(list(lines))
        if not isinstance(got, list):
            raise AssertionError(f"parse_sse must return a list of dicts, got {type(got).__name__}")
        if len(got) != len(expected):
            hint = ""
            if len(got) > len(expected):
                hint = " (stop at 'data: [DONE]', skip comments and blank lines)"
            raise AssertionError(f"trial {trial}: {len(got)} events but the stream has {len(expected)}{hint}\n"
                                 f"stream: {lines}")
        for i, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                raise AssertionError(f"trial {trial}: event {i} is {g!r}, expected {e!r} "
                                     "(the JSON after 'data:', with or without a space)")
    print("check_parse_sse passed: events decoded, comments skipped, stopped at [DONE]")


def reference_latencies(send_time: float, arrivals: list[float]) -> tuple[float, list[float]]:
    return arrivals[0] - send_time, [b - a for a, b in zip(arrivals, arrivals[1:])]


def check_latencies(fn: Callable[[float, list[float]], tuple[float, list[float]]], seed: int | None = None) -> None:
    rng = random.Random(seed)
    for trial in range(20):
        send = rng.uniform(0, 100)
        arrivals = [send + rng.uniform(0.05, 0.5)]
        for _ in range(rng.randint(0, 12)):
            arrivals.append(arrivals[-1] + rng.uniform(0.001, 0.2))
        exp_ttft, exp_itl = reference_latencies(send, arrivals)
        got = fn(send, list(arrivals))
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"return (ttft, itls), got {got!r}")
        ttft, itls = got
        if abs(ttft - exp_ttft) > 1e-9:
            raise AssertionError(f"trial {trial}: TTFT {ttft:.4f} s, expected {exp_ttft:.4f} s "
                                 "(from sending the request to the first chunk)")
        itls = list(itls)
        if len(itls) != len(exp_itl):
            raise AssertionError(f"trial {trial}: {len(itls)} inter-token latencies for {len(arrivals)} chunks, "
                                 f"expected {len(exp_itl)} (one per gap between consecutive chunks)")
        for i, (g, e) in enumerate(zip(itls, exp_itl)):
            if abs(g - e) > 1e-9:
                raise AssertionError(f"trial {trial}: ITL[{i}] = {g:.4f} s, expected {e:.4f} s")
    print("check_latencies passed: TTFT and ITL match on 20 random streams")


# --- the lab's closing claims --------------------------------------------------------------------------------


def claims(r: dict) -> list[tuple[str, bool]]:
    """Lab 12's claims from the run's measurements `r` (built in the notebook's claims cell).

    `server_ttft_count` / `server_ttft_mean_s` are the server's own TTFT histogram over the benchmark only (the
    difference of /metrics read before and after it); `client_ttft_mean_s` is what the client measured for the same
    requests."""
    from lab_utils.checks.claims import need

    need(r, "expected_tokens", "got_tokens", "n_requests", "server_ttft_count", "server_ttft_mean_s",
         "client_ttft_mean_s", "kv_usage_after")
    exp, got = list(r["expected_tokens"]), list(r["got_tokens"])
    lost = [i for i, (a, b) in enumerate(zip(exp, got)) if a != b] + list(range(min(len(exp), len(got)), max(len(exp), len(got))))
    cm, sm = r["client_ttft_mean_s"], r["server_ttft_mean_s"]
    return [
        (f"every request streamed every token ({len(got)} requests; wrong counts at {lost[:5]})", not lost),
        (f"the server's TTFT histogram counted each of the {r['n_requests']} benchmark requests once (counted "
         f"{r['server_ttft_count']:.0f})", r["server_ttft_count"] == r["n_requests"]),
        (f"the client's mean TTFT is at least the server's for the same requests ({cm * 1e3:.1f} vs {sm * 1e3:.1f} ms: "
         "HTTP, parsing and queueing before the engine come on top)", r["server_ttft_count"] > 0 and cm >= sm),
        (f"no KV memory is held once the benchmark is over (usage {r['kv_usage_after']:.3f})", r["kv_usage_after"] == 0.0),
    ]


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 12's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)
