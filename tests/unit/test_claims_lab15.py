"""Negative controls for lab 15's claims: good measurements pass, each perturbed one fails its claim; and a real
run on a tiny engine where the "fan-out" sends everything in one instant (the shared prefix computed once a
sub-task) fails the fan-out claim."""
from __future__ import annotations

import copy
import random

import pytest

from lab_utils.checks import lab15
from lab_utils.efficiency import fanout
from tests.unit import step_profiles


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


# ------------------------------------------------------------------------------------------------- routing
def _scored(seed: int = 0):
    """Synthetic option scores for the course's tasks: the target right on 38 of 40; the small model right on
    about two thirds, confident where it agrees with the target and doubtful where it does not (a useful signal)."""
    from lab_utils.efficiency.routing import Scored
    from lab_utils.efficiency.tasks import routing_tasks

    rng = random.Random(seed)
    tasks = routing_tasks(0)
    target, small = [], []
    for i, t in enumerate(tasks):
        t_pick = t.answer if i % 20 else 1 - t.answer
        target.append([-1.0 if k == t_pick else -5.0 for k in range(len(t.options))])
        agrees = rng.random() < 0.65
        pick, margin = (t_pick, rng.uniform(2.0, 5.0)) if agrees else (1 - t_pick, rng.uniform(0.1, 1.5))
        small.append([-1.0 if k == pick else -1.0 - margin for k in range(len(t.options))])
    picks = lambda ss: [max(range(len(s)), key=s.__getitem__) for s in ss]  # noqa: E731
    tokens = [14] * len(tasks)
    return (tasks, Scored(small, picks(small), tokens, 1.0, 7_000_000),
            Scored(target, picks(target), tokens, 2.0, 135_000_000))


def _routing_r(router=None, random_seed=0):
    from lab_utils.efficiency import routing

    tasks, small, target = _scored()
    points = routing.curve(tasks, small, target, router or routing.route)
    return dict(curve=points, random_curve=routing.random_curve(tasks, small, target, seed=random_seed),
                route_calls={"efficiency.route": len(points)})


def test_a_router_with_a_signal_passes(capsys):
    lab15.assert_claims(dict(good(), routing=_routing_r()))
    assert "FAIL" not in capsys.readouterr().out


def _random_router(seed):
    rng = random.Random(seed)
    return lambda task, scores, threshold: "small" if rng.random() < threshold else "target"


@pytest.mark.parametrize("seed", range(5))
def test_a_random_router_fails_the_curve_claim(seed):
    """A router that ignores its signal: its curve is the straight line between the endpoints, give or take."""
    with pytest.raises(AssertionError, match="above the straight line"):
        lab15.assert_claims(dict(good(), routing=_routing_r(_random_router(seed))), show=False)


def test_a_router_on_the_wrong_side_fails_the_curve_claim():
    from lab_utils.efficiency.routing import confidence

    def wrong_side(task, scores, threshold):
        return "target" if confidence(scores) >= threshold else "small"

    with pytest.raises(AssertionError, match="above the straight line"):
        lab15.assert_claims(dict(good(), routing=_routing_r(wrong_side)), show=False)


def test_a_router_that_never_ran_fails():
    r = _routing_r()
    r["route_calls"] = {}
    with pytest.raises(AssertionError, match="never called"):
        lab15.assert_claims(dict(good(), routing=r), show=False)


# ------------------------------------------------------------------------------------------------- contexts
# the reader's prefills of the timing cell, one a turn and variant (tokens a turn: full 240, last 118, session 72,
# compressed 118 after a full scoring pass), two rounds
PREFILLS = [240, 118, 72, 240, 118] * 4 * 2


def _contexts_r(profile: str = "cpu") -> dict:
    return dict(turns=4, k=8, budgets=[100, 110, 120, 130], compressed_sizes=[98, 110, 119, 127], whole_words=4,
                scoring_tokens=960, tokens={"full": 960, "last": 470, "session": 290, "compressed": 474},
                kept={"full": 1.0, "last": 0.5, "session": 0.0, "compressed": 0.25, "random words": 0.25},
                agreed_tokens={"full": 8.0, "last": 5.0, "session": 1.5, "compressed": 2.0, "random words": 2.0},
                ttft_s={"full": [4.4, 4.3], "last": [2.3, 2.2], "session": [1.4, 1.4], "compressed": [8.0, 7.9]},
                step_logs=[step_profiles.log(PREFILLS, profile)])


def test_shorter_contexts_that_hold_pass(capsys):
    lab15.assert_claims(dict(good(), contexts=_contexts_r()))
    assert "FAIL" not in capsys.readouterr().out


def _contexts_with(key, value):
    r = _contexts_r()
    if isinstance(key, tuple):
        r[key[0]] = {**r[key[0]], key[1]: value}
    else:
        r[key] = value
    return dict(good(), contexts=r)


@pytest.mark.parametrize("key, value, message", [
    (("tokens", "session"), 700, "session state sent"),                  # a "state" that re-sends the history
    (("ttft_s", "session"), [4.3, 4.4], "sooner than the full"),         # no time saved
    ("compressed_sizes", [98, 110, 121, 127], "met its budget on 3/4"),  # one prompt over its budget
    ("whole_words", 3, "only whole history words"),                      # a word cut in two, a template token gone
    (("ttft_s", "compressed"), [2.2, 2.1], "its scoring pass counted"),  # timed without its scoring pass
    (("kept", "full"), 0.75, "the check agrees with generation"),         # a check that misreads the answer
    (("kept", "last"), 1.0, "every shorter context lost answers"),       # quality assumed, not measured
])
def test_each_contexts_claim_can_fail(key, value, message):
    with pytest.raises(AssertionError, match=message):
        lab15.assert_claims(_contexts_with(key, value), show=False)


def test_a_compressor_that_drops_single_tokens_fails_the_whole_word_claim():
    """Measured on the course's tokenizer and lab 11's conversations: dropping the least surprising TOKENS to the
    budget (rather than whole words) cuts words and template markers, and the claim names it."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lab_utils.efficiency import contexts
    from lab_utils.models.loader import model_folder
    from lab_utils.models.tokenizer import load_tokenizer
    from lab_utils.rag.conversations import load_conversations
    from lab_utils.rag.corpus import load_corpus

    tok, corpus = load_tokenizer(model_folder("smollm2-135m")), load_corpus()
    rng = random.Random(0)
    turns, budgets = [], []
    for convo in load_conversations()[:3]:
        t = contexts.variants(tok, "You are a helpful assistant.", convo, corpus, len(convo.turns) - 1)
        surprisal = [rng.uniform(0, 10) for _ in range(len(t["full"]))]
        budget = len(t["full"]) // 2
        drop = set(sorted(range(len(surprisal)), key=surprisal.__getitem__)[:len(surprisal) - budget])
        tokens = tuple(x for i, x in enumerate(t["full"].ids) if i not in drop)
        t["compressed"] = contexts.Context((contexts.Piece(tokens, "word"),))
        turns.append(t)
        budgets.append(budget)
    scores = {v: [(8, -0.5)] * len(turns) for v in turns[0]}
    scores["last"] = [(3, -1.0)] * len(turns)
    r = contexts.summary(turns, scores, 8, budgets, _contexts_r()["ttft_s"], sum(len(t["full"]) for t in turns))
    r["step_logs"] = _contexts_r()["step_logs"]
    assert r["whole_words"] == 0
    verdicts = dict(lab15.contexts_claims(r))
    assert [ok for text, ok in verdicts.items() if "only whole history words" in text] == [False]


def _timed_routing_r(walls):
    r = _routing_r()
    point = r["curve"][len(r["curve"]) // 2]
    return dict(r, time_point=point, routed_walls=walls), point


def test_a_routing_time_that_matches_its_run_passes(capsys):
    r, point = _timed_routing_r(None)
    r["routed_walls"] = [point.time_s * 1.1, point.time_s * 1.05]
    lab15.assert_claims(dict(good(), routing=r))
    assert "FAIL" not in capsys.readouterr().out


def test_a_routing_time_far_from_its_run_fails_and_a_noisy_run_is_not_judged():
    r, point = _timed_routing_r(None)
    r["routed_walls"] = [point.time_s * 2.0, point.time_s * 2.1]  # e.g. time taken as compute share x target's
    with pytest.raises(AssertionError, match="per-task times give"):
        lab15.assert_claims(dict(good(), routing=r), show=False)
    r["routed_walls"] = [point.time_s * 1.0, point.time_s * 2.5]
    verdicts = dict(lab15.claims(dict(good(), routing=r)))
    assert [ok for text, ok in verdicts.items() if "per-task times give" in text] == [None]


def test_every_setting_has_the_time_of_the_tasks_each_model_serves():
    from lab_utils.efficiency import routing

    tasks, small, target = _scored()
    pts = routing.curve(tasks, small, target)
    assert pts[0].time_s == pytest.approx(small.wall_s)          # always small: its run, every task
    assert pts[-1].time_s == pytest.approx(target.wall_s)        # always target: no probe
    for p in pts[1:-1]:
        sent = (len(tasks) - p.to_small) / len(tasks)           # equal tokens a task in _scored
        assert p.time_s == pytest.approx(small.wall_s + sent * target.wall_s)


@pytest.mark.parametrize("profile", ["launch", "gpu"])
def test_on_a_launch_bound_device_the_session_ttft_claim_is_not_judged_never_a_false_fail(profile):
    """Flat step costs: 72 and 240 prompt tokens are one prefill step each, ~1x sooner; the claim says why. The
    compressor's claim (a scoring pass and a prefill against one prefill) holds on any device and stays judged."""
    r = _contexts_r(profile)
    r["ttft_s"] = {"full": [0.124, 0.121], "last": [0.121, 0.122], "session": [0.12, 0.123],
                   "compressed": [0.245, 0.241]}  # what such a device measures: 4 turns of one 30 ms step each
    claims = dict(lab15.contexts_claims(r))
    session = [(text, ok) for text, ok in claims.items() if "session state reached" in text]
    assert len(session) == 1 and session[0][1] is None and "NOT JUDGED: on this device" in session[0][0]
    assert [ok for text, ok in claims.items() if "its scoring pass counted" in text] == [True]
    lab15.assert_claims(dict(good(), contexts=r), show=False)


def test_on_a_compute_bound_device_the_session_ttft_claim_is_judged_both_ways():
    claims = dict(lab15.contexts_claims(_contexts_r("cpu")))
    assert [ok for text, ok in claims.items() if "session state reached" in text] == [True]
    with pytest.raises(AssertionError, match="sooner than the full"):
        lab15.assert_claims(_contexts_with(("ttft_s", "session"), [4.3, 4.4]), show=False)
