"""Lab 08's goodput checker: it accepts the reference and rejects each common mistake with a useful message."""
from __future__ import annotations

import math

import pytest

from lab_utils.bench.metrics import meets_slo
from lab_utils.checks import lab08


def goodput(requests, duration_s, slo_ttft_ms, slo_tpot_ms):
    return sum(1 for r in requests if r.token_times and meets_slo(r, slo_ttft_ms, slo_tpot_ms)) / duration_s


def _ttft_ms(r):
    return (r.token_times[0] - r.arrival_time) * 1e3


def _tpot_ms(r):
    n = len(r.token_times)
    return (r.token_times[-1] - r.token_times[0]) / (n - 1) * 1e3 if n > 1 else math.nan


def _ok(r, t, p, strict=False, skip_tpot=False, nan_fails=False, tpot=_tpot_ms):
    if not r.token_times:
        return False
    bad = (lambda x, s: x >= s) if strict else (lambda x, s: x > s)
    if t is not None and bad(_ttft_ms(r), t):
        return False
    v = tpot(r)
    if p is not None and not skip_tpot:
        if math.isnan(v):
            return not nan_fails
        if bad(v, p):
            return False
    return True


def throughput(reqs, d, t, p):
    return sum(1 for r in reqs if r.token_times) / d


def count_only(reqs, d, t, p):
    return sum(_ok(r, t, p) for r in reqs)


def ttft_only(reqs, d, t, p):
    return sum(_ok(r, t, p, skip_tpot=True) for r in reqs) / d


def strict_edge(reqs, d, t, p):
    return sum(_ok(r, t, p, strict=True) for r in reqs) / d


def tpot_over_e2e(reqs, d, t, p):
    return sum(_ok(r, t, p, tpot=lambda r: (r.token_times[-1] - r.arrival_time) / len(r.token_times) * 1e3)
               for r in reqs) / d


def one_token_fails(reqs, d, t, p):
    return sum(_ok(r, t, p, nan_fails=True) for r in reqs) / d


def attainment(reqs, d, t, p):
    done = [r for r in reqs if r.token_times]
    return sum(_ok(r, t, p) for r in done) / len(done)


def returns_string(reqs, d, t, p):
    return f"{goodput(reqs, d, t, p):.3f}"


def not_implemented(reqs, d, t, p):
    raise NotImplementedError("hint: count the requests that met both SLOs")


def test_reference_passes(capsys):
    lab08.check_goodput(goodput, seed=0)
    lab08.check_goodput(goodput)  # fresh random runs
    assert "check_goodput passed" in capsys.readouterr().out


def test_reference_matches_metrics_module():
    """The checker's reference is the one the bench reports use (`request_goodput`)."""
    import random

    from lab_utils.bench.metrics import summarize

    reqs = lab08.random_run(random.Random(3))
    s = summarize(reqs, 4.0, 250.0, 62.5)
    assert s["request_goodput"] == pytest.approx(lab08.reference_goodput(reqs, 4.0, 250.0, 62.5))


@pytest.mark.parametrize("wrong, expect", [
    (throughput, "request throughput"),
    (count_only, "divide the good requests by duration_s"),
    (ttft_only, "TPOT SLO"),
    (strict_edge, "exactly at the SLO"),
    (tpot_over_e2e, "not E2E / n"),
    (one_token_fails, "one-token request"),
    (attainment, "slo_attainment"),
])
def test_wrong_solutions_rejected_with_diagnosis(wrong, expect):
    with pytest.raises(AssertionError, match="expected goodput") as exc:
        lab08.check_goodput(wrong, seed=0)
    assert expect in str(exc.value), str(exc.value)
    assert "meets_slo" not in str(exc.value)  # never shows the solution


def test_wrong_type_rejected():
    with pytest.raises(AssertionError, match="must return a number"):
        lab08.check_goodput(returns_string, seed=0)


def test_not_implemented_propagates():
    with pytest.raises(NotImplementedError, match="hint"):
        lab08.check_goodput(not_implemented, seed=0)


# --- the knob sweep against an SLO -------------------------------------------------------------------------------
def _sweep(run_at, values, slo_ttft_ms, slo_tpot_ms, pick=lambda t, vs: max(vs, key=lambda n: (t[n], -n)),
           metric=None):
    table = {}
    for n in values:
        r = run_at(n)
        table[n] = metric(r) if metric else lab08.reference_goodput(r.requests, r.duration, slo_ttft_ms, slo_tpot_ms)
    return pick(table, values), table


def test_sweep_checker_accepts_correct(capsys):
    lab08.check_sweep(lambda run_at, values, t, p: _sweep(run_at, values, t, p))
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (lambda run_at, v, t, p: _sweep(run_at, v, t, p, metric=lambda r: sum(len(q.token_times) for q in r.requests)
                                    / r.duration), "output tokens per second"),          # throughput, not goodput
    (lambda run_at, v, t, p: _sweep(run_at, v, t, p, pick=lambda tb, vs: max(vs, key=lambda n: (tb[n], n))),
     "take the smallest"),                                                                # ties to the largest
    (lambda run_at, v, t, p: _sweep(run_at, v, t, p, pick=lambda tb, vs: max(vs)), "expected"),  # the biggest batch
    (lambda run_at, v, t, p: (_sweep(run_at, v, t, p), _sweep(run_at, v, t, p))[1], "once per value"),
])
def test_sweep_checker_rejects_mistakes(bad, msg):
    with pytest.raises(AssertionError, match=msg):
        lab08.check_sweep(bad)


def _seconds_vs_ms(requests, duration_s, slo_ttft_ms, slo_tpot_ms):  # SLOs compared with seconds
    return sum(1 for r in requests if r.token_times and meets_slo(r, None if slo_ttft_ms is None else slo_ttft_ms / 1e3,
                                                                  None if slo_tpot_ms is None else slo_tpot_ms / 1e3)
               ) / duration_s


def _off_by_one_request(requests, duration_s, slo_ttft_ms, slo_tpot_ms):
    return (goodput(requests, duration_s, slo_ttft_ms, slo_tpot_ms) * duration_s + 1) / duration_s


@pytest.mark.parametrize("wrong", [_seconds_vs_ms, _off_by_one_request])
def test_a_wrong_goodput_without_a_known_mistake_still_gets_a_cause(wrong):
    with pytest.raises(AssertionError, match="expected goodput") as exc:
        lab08.check_goodput(wrong, seed=0)
    msg = str(exc.value)
    assert "Likely cause" in msg or "a request is good when it has tokens" in msg, msg
    assert "request throughput" not in msg  # the catalogue's causes stay silent on these
