"""Negative controls for lab 00's claims: a good run passes, each perturbed measurement fails its claim."""
from __future__ import annotations

import copy

import pytest
import torch

from lab_utils.checks import lab00


def good() -> dict:
    toks = torch.arange(12).reshape(1, 12)
    return dict(
        naive_tokens=toks, cached_tokens=toks.clone(), kv_speedup=4.3, t_max=128, prefill_tps=64.0,
        decode_tps={1: 4.0, 4: 9.0, 16: 20.0}, ai_decode=0.51, ai_prefill=65.0, ridge=5.3,
        prefill_vs_peak=0.82, decode_vs_peak=0.05,
        seq=dict(median_ttft_ms=4003.0, output_throughput=3.4, request_goodput=0.11),
        bat=dict(median_ttft_ms=589.0, output_throughput=8.7, request_goodput=1.08),
    )


def test_a_good_run_passes(capsys):
    lab00.assert_claims(good())
    assert "FAIL" not in capsys.readouterr().out


def _set(r: dict, path: str, value) -> dict:
    r = copy.deepcopy(r)
    *head, last = path.split(".")
    d = r
    for k in head:
        d = d[k]
    d[int(last) if isinstance(d, dict) and last.isdigit() else last] = value
    return r


@pytest.mark.parametrize("path, value, message", [
    ("cached_tokens", torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 99]]), "identical tokens"),  # a broken cache
    ("kv_speedup", 1.2, "KV cache speeds up"),
    ("prefill_tps", 10.0, "prefill is >= 3x"),
    ("decode_tps.16", 6.0, "decode batch 16"),                  # a batch that runs row by row
    ("ai_decode", 6.0, "roofline"),
    ("ai_prefill", 4.0, "roofline"),
    ("prefill_vs_peak", 0.01, "larger share of the measured peak"),
    ("bat.median_ttft_ms", 5000.0, "first tokens come sooner"),
    ("bat.output_throughput", 3.0, "higher output throughput"),
    ("bat.request_goodput", 0.1, "higher goodput"),
])
def test_each_claim_fails_on_a_wrong_measurement(path, value, message):
    with pytest.raises(AssertionError, match=message):
        lab00.assert_claims(_set(good(), path, value), show=False)


def test_a_missing_measurement_is_named():
    r = good()
    del r["ridge"]
    with pytest.raises(KeyError, match="ridge"):
        lab00.assert_claims(r, show=False)


# --- timing claims on a busy machine: per-round ratios of interleaved measurements ------------------------------
def _serving(ttft, thr, goodput) -> dict:
    return dict(median_ttft_ms=ttft, output_throughput=thr, request_goodput=goodput)


def loaded() -> dict:
    """Rounds as a loaded 2-core laptop gives them (a busy process on each core): everything 2-4x slower than
    `good()` and uneven from round to round, but each round's two sides slowed alike."""
    return {**good(), "kv_speedup": 2.7, "kv_predicted": 3.4, "kv_rounds": [2.7, 3.1, 2.2],
            "prefill_s_rounds": [4.1, 2.6, 5.0], "decode_s_rounds": {1: [0.61, 0.35, 0.70], 4: [0.9, 0.52, 1.2],
                                                                   16: [1.9, 1.1, 2.6]},
            "seq_rounds": [_serving(9100.0, 1.2, 0.04), _serving(6200.0, 1.7, 0.05), _serving(11800.0, 0.9, 0.03)],
            "bat_rounds": [_serving(2300.0, 3.1, 0.41), _serving(1500.0, 4.6, 0.55), _serving(3900.0, 1.8, 0.21)]}


def verdicts(r: dict) -> dict[str, bool | None]:
    return {text.split(" (")[0].split(" [")[0]: ok for text, ok in lab00.claims(r)}


def test_a_loaded_machine_still_passes_every_claim(capsys):
    lab00.assert_claims(loaded())
    out = capsys.readouterr().out
    assert "FAIL" not in out and "NOT JUDGED" not in out and "median of 3 rounds" in out


def test_goodput_zero_on_both_sides_is_not_judged_not_failed(capsys):
    """The old failure: an SLO from an unloaded measurement, then 0.00 vs 0.00 req/s read as 'not higher'."""
    r = loaded()
    r["seq_rounds"] = [{**m, "request_goodput": 0.0} for m in r["seq_rounds"]]
    r["bat_rounds"] = [{**m, "request_goodput": 0.0} for m in r["bat_rounds"]]
    lab00.assert_claims(r)  # raises nothing
    out = capsys.readouterr().out
    assert "NOT JUDGED  the batch has higher goodput" in out and "no request met the SLO" in out and "rerun" in out


def test_rounds_that_disagree_across_the_bar_are_not_judged(capsys):
    r = {**loaded(), "kv_rounds": [3.3, 1.2, 2.9]}  # one round hit by a burst of load: 1.2x
    lab00.assert_claims(r)
    assert "NOT JUDGED  KV cache speeds up" in capsys.readouterr().out


@pytest.mark.parametrize("change, message", [
    ({"kv_rounds": [1.1, 1.3, 1.2]}, "KV cache speeds up"),  # a cache that does not help, in every round
    ({"decode_s_rounds": {1: [0.6, 0.35, 0.7], 4: [2.3, 1.3, 2.7], 16: [9.5, 5.4, 11.0]}}, "decode batch 16"),
    ({"prefill_s_rounds": [60.0, 40.0, 70.0]}, "prefill is >= 3x"),
    ({"bat_rounds": [_serving(9300.0, 1.1, 0.03), _serving(6400.0, 1.6, 0.04), _serving(12000.0, 0.85, 0.02)]},
     "first tokens come sooner"),  # a "batch" that runs its rows one after another
])
def test_loaded_rounds_still_fail_a_wrong_measurement(change, message):
    with pytest.raises(AssertionError, match=message):
        lab00.assert_claims({**loaded(), **change}, show=False)


def test_a_batch_that_loses_on_goodput_in_every_round_fails():
    r = loaded()
    r["bat_rounds"] = [{**m, "request_goodput": 0.0} for m in r["bat_rounds"]]
    with pytest.raises(AssertionError, match="higher goodput"):
        lab00.assert_claims(r, show=False)
