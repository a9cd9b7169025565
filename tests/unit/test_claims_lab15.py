"""Negative controls for lab 15's claims: good measurements pass, each perturbed one fails its claim; and a real
run on a tiny engine where the "fan-out" sends everything in one instant (the shared prefix computed once a
sub-task) fails the fan-out claim."""
from __future__ import annotations

import copy
import random

import pytest

from lab_utils.checks import lab15
from lab_utils.efficiency import fanout


def good() -> dict:
    return dict(
        computed={"one by one": 190, "all at once": 1500, "fan-out": 190},
        batch={"one by one": 1, "all at once": 4, "fan-out": 4},
        wall_s={"one by one": [6.0, 6.4], "all at once": [2.6, 2.5], "fan-out": [2.1, 2.2]},
        prefix_tokens=360, subtasks=4, suffix_tokens=60, answers_same=4, usage_computed=190,
        calls={"efficiency.fan_out": 3})


def test_good_measurements_pass(capsys):
    lab15.assert_claims(good())
    assert "FAIL" not in capsys.readouterr().out


def with_(path, value):
    r = copy.deepcopy(good())
    *keys, last = path
    d = r
    for k in keys:
        d = d[k]
    d[last] = value
    return r


@pytest.mark.parametrize("path, value, message", [
    (("computed", "fan-out"), 1500, "shared prefix once"),             # a fan-out that computes the prefix N times
    (("computed", "all at once"), 400, "sent all at once"),             # the engine deduplicated: not this engine
    (("batch", "fan-out"), 1, "together"),                              # a "fan-out" that runs one by one
    (("wall_s", "fan-out"), [5.9, 6.3], "faster than one by one"),      # no gain measured
    (("answers_same",), 3, "the same answers"),
    (("usage_computed",), 1330, "your prompt_usage"),                   # cached tokens counted as computed
    (("calls",), {}, "never called"),
])
def test_each_claim_can_fail(path, value, message):
    with pytest.raises(AssertionError, match=message):
        lab15.assert_claims(with_(path, value), show=False)


def test_a_fan_out_that_computes_the_prefix_once_a_subtask_fails_on_a_real_engine():
    """Measured on a tiny engine: sending every sub-task in one instant in the fan-out's place fails the claim."""
    from lab_utils import SamplingParams

    prompts = lab15.random_subtasks(random.Random(0), 4, 5)
    modes = {"one by one": fanout.one_by_one, "all at once": fanout.all_at_once, "fan-out": fanout.all_at_once}
    runs = fanout.measure(modes, lab15._tiny_engine, prompts, SamplingParams(max_tokens=3), rounds=1)
    r = dict(fanout.summary(runs, prompts), answers_same=4, usage_computed=runs["fan-out"][-1]["computed"],
             calls={"efficiency.fan_out": 1})
    with pytest.raises(AssertionError, match="shared prefix once"):
        lab15.assert_claims(r, show=False)
    good_runs = fanout.measure({**modes, "fan-out": fanout.fan_out}, lab15._tiny_engine, prompts,
                               SamplingParams(max_tokens=3), rounds=1)
    verdicts = dict(lab15.claims(dict(fanout.summary(good_runs, prompts), answers_same=4,
                                      usage_computed=good_runs["fan-out"][-1]["computed"],
                                      calls={"efficiency.fan_out": 1})))
    assert all(ok for text, ok in verdicts.items() if "prefix once" in text or "all at once" in text), verdicts
