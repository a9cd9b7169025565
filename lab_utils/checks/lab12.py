"""Checks for lab 12's exercises: parsing a server-sent-events stream, and latency from chunk arrival times.

Each check builds a fresh random stream / timeline, compares the learner's answer with the reference, and says
what differs without showing the reference code.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable

from lab_utils.checks.claims import Claim
from lab_utils.checks.part_named import checks_part


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
            if len(got) > len(expected):
                hint = " (stop at 'data: [DONE]', skip comments and blank lines)"
            else:
                hint = (" (every line that starts with 'data:' before [DONE] is an event, with or without a space "
                        "after the colon)")
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
                hint = ("an ITL is the gap between consecutive chunks, not the time since sending" if
                        abs(g - (arrivals[i + 1] - send)) < 1e-9 else
                        "an ITL is the gap between consecutive chunks, not since the first chunk" if
                        abs(g - (arrivals[i + 1] - arrivals[0])) < 1e-9 else
                        f"ITL[i] = arrival[i + 1] - arrival[i]: here {arrivals[i + 1]:.4f} - {arrivals[i]:.4f}")
                raise AssertionError(f"trial {trial}: ITL[{i}] = {g:.4f} s, expected {e:.4f} s\n   hint: {hint}")
    print("check_latencies passed: TTFT and ITL match on 20 random streams")


# --- the server's streaming loop ---------------------------------------------------------------------------


class _Out:
    """A stand-in for RequestOutput: what the loop may look at."""

    def __init__(self, i: int, finished: bool, reason: str | None = None) -> None:
        self.request_id, self.new_token_ids, self.finished = "r", [100 + i], finished
        self.finish_reason = reason if finished else None


def _chunk(out) -> dict:
    if out.finish_reason and out.finish_reason.startswith("error"):
        return {"error": {"message": out.finish_reason}}
    return {"choices": [{"token_ids": out.new_token_ids, "finish_reason": out.finish_reason}]}


def _format_hint(got: list, want: list) -> str:
    for g, w in zip(got, want):
        if g == w:
            continue
        if not isinstance(g, str):
            return f"yield str lines, got {type(g).__name__}"
        if g.rstrip("\n") == w.rstrip("\n"):
            return "an SSE event ends with a blank line: 'data: ...\\n\\n' (two newlines)"
        if g.startswith("data:") and not g.startswith("data: "):
            return "write 'data: ' with a space, as OpenAI and vLLM do"
        if "'" in g and '"' not in g:
            return "the payload is JSON: json.dumps(to_chunk(out)), not str()"
        if "[DONE]" in w:
            return "after the last output, end the stream with 'data: [DONE]\\n\\n'"
        return ""
    if len(got) < len(want):
        return ("end the stream with 'data: [DONE]\\n\\n'" if len(got) == len(want) - 1
                else "one event per engine output, none skipped")
    return "nothing after 'data: [DONE]' (and one event per output)"


async def _fake_outputs(n: int, reason: str = "length", hang_after: int | None = None, fail_after: int | None = None):
    import asyncio

    for i in range(n):
        await asyncio.sleep(0)
        if hang_after is not None and i == hang_after:
            await asyncio.Event().wait()  # a client that stays while the engine is slow: only a cancel ends this
        if fail_after is not None and i == fail_after:
            raise RuntimeError("the engine failed")
        yield _Out(i, i == n - 1, reason)


def _run_async(make: Callable):
    """Run the coroutine `make()` to its end: here, or (in a notebook, whose event loop is already running) on a
    thread of its own; its exception, if any, is raised here."""
    import asyncio
    import threading

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(make())
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = err

    thread = threading.Thread(target=target, name="lab12-check")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


@checks_part("server.stream_sse")
def check_stream_sse(fn: Callable, seed: int | None = 0) -> None:
    """`fn(outputs, to_chunk, abort)`, an async generator of SSE lines: on fake streams (whole ones, a failed
    request, a client that leaves after k events, one cancelled while it waits for the engine, an engine that
    raises), then in the real `AsyncEngine` over a tiny engine: a client that leaves must free the request's
    blocks. Submits `fn` when it passes."""
    import asyncio
    import inspect as insp

    from lab_utils.course import learner_parts

    if not insp.isasyncgenfunction(fn):
        if insp.iscoroutinefunction(fn):  # the learner copy's stub: `raise NotImplementedError(...)`, no yield
            try:
                _run_async(lambda: fn(_fake_outputs(1), _chunk, lambda: None))
            except NotImplementedError:
                raise
            except Exception:  # noqa: BLE001 - not an async generator either way
                pass
        raise AssertionError("write an async generator: `async def stream_sse(...)` with `yield` inside (the "
                             "server iterates it with `async for`)")
    rng = random.Random(seed)

    async def run_all() -> None:
        for trial in range(12):
            n, reason = rng.randint(1, 6), rng.choice(["length", "stop", "error: the engine failed on this request"])
            aborts: list[int] = []
            got = [line async for line in fn(_fake_outputs(n, reason), _chunk, lambda: aborts.append(1))]
            outs = [_Out(i, i == n - 1, reason) for i in range(n)]
            want = [f"data: {json.dumps(_chunk(o))}\n\n" for o in outs] + ["data: [DONE]\n\n"]
            if got != want:
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                raise AssertionError(
                    f"a whole stream of {n} outputs (finish reason {reason!r}): line {first} is "
                    f"{got[first] if first < len(got) else '(missing)'!r}, expected "
                    f"{want[first] if first < len(want) else '(nothing)'!r}\n   hint: {_format_hint(got, want)}")
            if aborts:
                raise AssertionError(
                    f"a whole stream of {n} outputs (finish reason {reason!r}) ran to [DONE], yet your loop called "
                    f"abort() {len(aborts)} time(s)\n   hint: abort() is for a client that left before the request "
                    f"finished; a finished request has nothing to abort (remember whether the last output was "
                    f"finished, and abort in `finally` only when it was not)")
            # a client that leaves after k events: the server closes the generator (GeneratorExit)
            k = rng.randint(1, max(n - 1, 1))
            if n > 1:
                aborts = []
                agen = fn(_fake_outputs(n), _chunk, lambda: aborts.append(1))
                for _ in range(k):
                    await agen.__anext__()
                await agen.aclose()
                if len(aborts) != 1:
                    raise AssertionError(
                        f"a client left after {k} of {n} events (the server closed your generator): abort() was "
                        f"called {len(aborts)} times, expected once\n   hint: "
                        + ("the request is still running in the engine and holds its KV blocks: call abort() when the "
                           "loop is left before the request finished; leaving shows up as GeneratorExit or "
                           "CancelledError, which are not Exceptions: use try/finally" if not aborts else
                           "abort once"))
        # a client that leaves while the loop waits for the engine: the server cancels the task (CancelledError)
        aborts = []

        async def consume(agen, seen):
            async for line in agen:
                seen.append(line)

        seen: list[str] = []
        task = asyncio.ensure_future(consume(fn(_fake_outputs(5, hang_after=2), _chunk, lambda: aborts.append(1)),
                                             seen))
        for _ in range(50):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception as err:  # noqa: BLE001 - reported in the learner's terms
            raise AssertionError(f"a client left while your loop waited for the engine: it raised "
                                 f"{type(err).__name__}: {err}") from None
        if len(aborts) != 1 or len(seen) != 2:
            raise AssertionError(
                f"a client left (the task was cancelled) while your loop waited for the engine's third output: "
                f"{len(seen)} events sent (expected 2), abort() called {len(aborts)} times (expected once)\n   hint: "
                "a cancel raises CancelledError at the `async for`; abort in a finally block, and do not swallow it")
        # the engine failing: the exception must reach the server (it sends the client an error event)
        aborts = []
        try:
            [line async for line in fn(_fake_outputs(5, fail_after=2), _chunk, lambda: aborts.append(1))]
        except RuntimeError:
            pass
        else:
            raise AssertionError("the engine's outputs raised an error and your loop swallowed it: let it propagate "
                                 "(the server turns it into an error event for the client)")

    _run_async(run_all)
    freed = _stream_in_engine(fn)
    print(f"✔ check_stream_sse: SSE lines, [DONE] and abort-on-disconnect right on fake streams; in the real "
          f"AsyncEngine a client that left after 3 events freed its request's {freed} KV blocks")
    learner_parts.submit("server.stream_sse", fn)


def _stream_in_engine(fn: Callable) -> int:
    """The learner's loop on the real AsyncEngine (tiny random model): a full stream, then a client that leaves
    after 3 events; returns how many blocks the leaver held (all must come back)."""
    import asyncio
    import time

    import torch

    from lab_utils.engine.config import EngineConfig
    from lab_utils.engine.engine import LLMEngine
    from lab_utils.engine.sampling_params import SamplingParams
    from lab_utils.models.loader import build_random
    from lab_utils.models.registry import REGISTRY
    from lab_utils.server.async_engine import AsyncEngine

    model = build_random(REGISTRY["tiny-random"].config, seed=0).eval()
    engine = LLMEngine((model, None), EngineConfig(max_num_seqs=4, block_size=4, num_gpu_blocks=64,
                                                   max_model_len=256, enable_prefix_caching=False), device="cpu")
    real_step = engine.step

    def paced_step():  # a tiny model decodes 200 tokens faster than a client reads 3 events: pace it like a real one
        time.sleep(0.02)
        return real_step()

    engine.step = paced_step
    aengine = AsyncEngine(engine)
    prompt = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(0)).tolist()

    async def main() -> int:
        stream = aengine.add(prompt, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
        lines = [line async for line in fn(aengine.outputs(stream, abort_on_exit=False), _chunk,
                                           lambda: aengine.abort(stream.request_id))]
        events = [json.loads(x[len("data: "):]) for x in lines if x.startswith("data: {")]
        ntok = sum(len(e["choices"][0]["token_ids"]) for e in events)
        if ntok != 6 or lines[-1:] != ["data: [DONE]\n\n"]:
            raise AssertionError(f"in the real engine, a 6-token request streamed {ntok} tokens in {len(events)} "
                                 f"events, last line {lines[-1:]}: one event per output, then [DONE]")
        stream = aengine.add(prompt, SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0))
        agen = fn(aengine.outputs(stream, abort_on_exit=False), _chunk, lambda: aengine.abort(stream.request_id))
        for _ in range(3):
            await agen.__anext__()
        held = len(engine.requests[stream.request_id].block_table)
        await agen.aclose()  # what the server does when the client disconnects
        deadline = time.monotonic() + 10
        while engine.has_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        req = engine.requests[stream.request_id]
        if engine.has_unfinished() or req.num_output_tokens >= 200:
            raise AssertionError(f"in the real engine, a client left after 3 events but its request kept decoding "
                                 f"({req.num_output_tokens} of 200 tokens, status {req.status.name}) and kept its "
                                 f"{held} KV blocks: call abort() when the loop is left early")
        return held

    try:
        held = _run_async(main)
    finally:
        aengine.shutdown()
    used = engine.stats()["num_blocks_used"]
    if used:
        raise AssertionError(f"after the client left and its request was aborted, {used} KV blocks are still in use")
    return held


# --- the lab's closing claims --------------------------------------------------------------------------------


def claims(r: dict) -> list[Claim]:
    """Lab 12's claims from the run's measurements `r` (built in the notebook's claims cell).

    `server_ttft_count` / `server_ttft_mean_s` are the server's own TTFT histogram over the benchmark only (the
    difference of /metrics read before and after it); `client_ttft_mean_s` is what the client measured for the same
    requests."""
    from lab_utils.checks.claims import need

    need(r, "disconnect", "expected_tokens", "got_tokens", "n_requests", "server_ttft_count", "server_ttft_mean_s",
         "client_ttft_mean_s", "kv_usage_after")
    d = r["disconnect"]
    exp, got = list(r["expected_tokens"]), list(r["got_tokens"])
    lost = [i for i, (a, b) in enumerate(zip(exp, got)) if a != b] + list(range(min(len(exp), len(got)), max(len(exp), len(got))))
    cm, sm = r["client_ttft_mean_s"], r["server_ttft_mean_s"]
    return [
        (f"measured: a client that hung up after 3 events had its request aborted by your stream_sse in the server "
         f"({d['aborted']:.0f} aborted; running {d['running_during']:.0f} -> {d['running_after']:.0f}) and its KV "
         f"blocks freed (usage {d['kv_during']:.4f} -> {d['kv_after']:.4f}, {d['freed_s'] * 1e3:.0f} ms)",
         bool(d["your_loop"]) and d["aborted"] == 1 and d["kv_during"] > 0 and d["kv_after"] == 0
         and d["running_after"] == 0),
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


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
