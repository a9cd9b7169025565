"""Negative controls for lab 09's claims: a good run passes, each perturbed result fails its claim."""
from __future__ import annotations

import copy

import pytest

from lab_utils.checks import lab09


def good() -> dict:
    return dict(same_tp=True, same_pp=True, n_prompts=4,
                tp_parts=[["tensor_parallel.row_parallel", "tensor_parallel.shard_weights"]] * 2,
                max_tokens=16, ratio_tp=1.0, ratio_pp=1.003,
                tp_dec={2: 25.3, 4: 14.3, 8: 8.7}, pp_dec={2: 67.6, 4: 79.3, 8: 88.9},
                sat={1: 6244.0, 2: 5081.0, 4: 3755.0, 8: 2467.0},
                l4=dict(tokens1=42262, tokens2=207057, seqs1=18, seqs2=89, thr1=214.0, thr2=736.0),
                h100=dict(tokens1=426784, tokens2=976100, seqs1=185, seqs2=423, thr1=1275.0, thr2=2606.0))


def test_a_good_run_passes(capsys):
    lab09.assert_claims(good())
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.count("check of the model") == 5  # labelled, not passed off as measurements


def with_(path: str, value) -> dict:
    r = copy.deepcopy(good())
    *head, last = path.split(".")
    d = r
    for k in head:
        d = d[k]
    d[int(last) if last.isdigit() else last] = value
    return r


@pytest.mark.parametrize("path, value, message", [
    ("same_tp", False, "same greedy tokens"),                    # a rank that skips its all-reduce
    ("tp_parts.1", ["tensor_parallel.shard_weights"], "your shard_weights"),  # a rank ran the reference
    ("same_pp", False, "same greedy tokens"),
    ("ratio_tp", 0.5, "payloads"),                               # an all-reduce that sends half the activations
    ("ratio_pp", 1.2, "payloads"),
    ("tp_dec.8", 30.0, "70B decode step"),
    ("pp_dec.4", 10.0, "70B decode step"),
    ("sat.8", 7000.0, "at saturation"),
    ("h100.tokens2", 800000, "more than doubles KV space"),      # weights paid on every GPU
    ("l4.thr2", 400.0, "where the weights fill the GPU"),
    ("h100.thr2", 5000.0, "where the weights fill the GPU"),
])
def test_each_claim_fails_on_a_wrong_result(path, value, message):
    with pytest.raises(AssertionError, match=message):
        lab09.assert_claims(with_(path, value), show=False)
