"""Lab 12's checkers accept correct answers and reject plausible wrong ones with a useful message."""
from __future__ import annotations

import json

import pytest

from lab_utils.checks import lab12


def good_parse(lines):
    out = []
    for line in lines:
        if line.startswith("data:"):
            d = line[5:].strip()
            if d == "[DONE]":
                break
            out.append(json.loads(d))
    return out


def test_parse_accepts_correct(capsys):
    lab12.check_parse_sse(good_parse, seed=0)
    lab12.check_parse_sse(good_parse)
    assert "passed" in capsys.readouterr().out


def test_parse_rejects_reading_past_done():
    def bad(lines):
        return [json.loads(line[5:]) for line in lines if line.startswith("data:") and "[DONE]" not in line]

    with pytest.raises(AssertionError, match="DONE"):
        lab12.check_parse_sse(bad, seed=1)


def test_parse_rejects_assuming_a_space_after_colon():
    def bad(lines):
        out = []
        for line in lines:
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    break
                out.append(json.loads(line[6:]))
        return out

    with pytest.raises(AssertionError, match="events but the stream has"):
        lab12.check_parse_sse(bad, seed=2)


def good_lat(send, arrivals):
    return arrivals[0] - send, [b - a for a, b in zip(arrivals, arrivals[1:])]


def test_latencies_accept_correct(capsys):
    lab12.check_latencies(good_lat, seed=0)
    assert "passed" in capsys.readouterr().out


def test_latencies_reject_itl_from_send_time():
    def bad(send, arrivals):
        times = [send] + arrivals
        return arrivals[0] - send, [b - a for a, b in zip(times, times[1:])]

    with pytest.raises(AssertionError, match="inter-token latencies"):
        lab12.check_latencies(bad, seed=3)


def test_latencies_reject_ttft_as_first_gap():
    def bad(send, arrivals):
        return (arrivals[1] - arrivals[0]) if len(arrivals) > 1 else 0.0, [b - a for a, b in zip(arrivals, arrivals[1:])]

    with pytest.raises(AssertionError, match="TTFT"):
        lab12.check_latencies(bad, seed=4)


# --- the server's streaming loop --------------------------------------------------------------------------------

from lab_utils.server.streaming import stream_sse


@pytest.fixture
def learner_dir(tmp_path, monkeypatch):
    from lab_utils.course import learner_parts

    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path / "my_engine"))
    yield tmp_path / "my_engine"
    learner_parts.forget()


def test_stream_checker_accepts_the_reference_and_submits(learner_dir, capsys):
    lab12.check_stream_sse(stream_sse)
    assert "✔ check_stream_sse" in capsys.readouterr().out
    assert "async def stream_sse(" in (learner_dir / "server.py").read_text()


async def _never_aborts(outputs, to_chunk, abort):
    async for out in outputs:
        yield f"data: {json.dumps(to_chunk(out))}\n\n"
    yield "data: [DONE]\n\n"


async def _aborts_on_exception_only(outputs, to_chunk, abort):
    try:
        async for out in outputs:
            yield f"data: {json.dumps(to_chunk(out))}\n\n"
        yield "data: [DONE]\n\n"
    except Exception:
        abort()
        raise


async def _one_newline(outputs, to_chunk, abort):
    try:
        async for out in outputs:
            yield f"data: {json.dumps(to_chunk(out))}\n"
            if out.finished:
                return
    finally:
        pass


async def _no_done(outputs, to_chunk, abort):
    finished = False
    try:
        async for out in outputs:
            yield f"data: {json.dumps(to_chunk(out))}\n\n"
            finished = out.finished
    finally:
        if not finished:
            abort()


async def _python_repr(outputs, to_chunk, abort):
    finished = False
    try:
        async for out in outputs:
            yield f"data: {to_chunk(out)}\n\n"
            finished = out.finished
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            abort()


async def _swallows_errors(outputs, to_chunk, abort):
    finished = False
    try:
        async for out in outputs:
            yield f"data: {json.dumps(to_chunk(out))}\n\n"
            finished = out.finished
        yield "data: [DONE]\n\n"
    except RuntimeError:
        pass
    finally:
        if not finished:
            abort()


def _not_a_generator(outputs, to_chunk, abort):
    return [f"data: {json.dumps(to_chunk(o))}\n\n" for o in outputs]


@pytest.mark.parametrize("bad, msg", [
    (_never_aborts, "still running in the engine"),
    (_aborts_on_exception_only, "not Exceptions: use try/finally"),
    (_one_newline, "blank line"),
    (_no_done, r"data: \[DONE\]"),
    (_python_repr, "json.dumps"),
    (_swallows_errors, "swallowed"),
    (_not_a_generator, "async generator"),
])
def test_stream_checker_rejects_mistakes(bad, msg, learner_dir):
    with pytest.raises(AssertionError, match=msg):
        lab12.check_stream_sse(bad)


def test_stream_checker_lets_the_stub_through(learner_dir):
    async def stream(outputs, to_chunk, abort):
        raise NotImplementedError("write the loop")

    with pytest.raises(NotImplementedError):
        lab12.check_stream_sse(stream)


async def _aborts_a_finished_request(outputs, to_chunk, abort):
    try:
        async for out in outputs:
            yield f"data: {json.dumps(to_chunk(out))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        abort()  # also after [DONE]: the engine retired this request already


async def _aborts_before_done(outputs, to_chunk, abort):
    async for out in outputs:
        yield f"data: {json.dumps(to_chunk(out))}\n\n"
        if out.finished:
            abort()
    yield "data: [DONE]\n\n"


@pytest.mark.parametrize("bad", [_aborts_a_finished_request, _aborts_before_done])
def test_stream_checker_rejects_an_abort_of_a_finished_request(bad, learner_dir):
    with pytest.raises(AssertionError, match=r"ran to \[DONE\], yet your loop called abort\(\)") as err:
        lab12.check_stream_sse(bad)
    assert str(err.value).startswith("server.stream_sse (lab 12, my_engine/server.py): ")


@pytest.mark.parametrize("bad", [_never_aborts, _no_done, _one_newline])
def test_every_stream_rejection_names_the_part_and_its_file(bad, learner_dir):
    with pytest.raises(AssertionError) as err:
        lab12.check_stream_sse(bad)
    assert str(err.value).startswith("server.stream_sse (lab 12, my_engine/server.py): ")
    assert "abort() 1 time" not in str(err.value)  # the finished-request diagnosis stays silent on other mistakes


@pytest.mark.parametrize("bad, hint", [
    (lambda send, a: (a[0] - send, [t - send for t in a[1:]]), "not the time since sending"),
    (lambda send, a: (a[0] - send, [t - a[0] for t in a[1:]]), "not since the first chunk"),
])
def test_latencies_name_the_itl_mistake(bad, hint):
    with pytest.raises(AssertionError, match="ITL") as err:
        lab12.check_latencies(bad, seed=3)
    assert hint in str(err.value)
    other = "not since the first chunk" if "sending" in hint else "not the time since sending"
    assert other not in str(err.value)
