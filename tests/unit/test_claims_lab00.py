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
