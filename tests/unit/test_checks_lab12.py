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
