"""Negative controls for lab 06's claims: a good run passes, each perturbed measurement fails its claim."""
from __future__ import annotations

import copy

import pytest

from lab_utils.checks import lab06


def good() -> dict:
    return dict(live_losses=[8.9, 8.0, 7.1, 6.0, 5.5, 5.2, 5.0, 4.9], draft_mb=13.8, cost_ratio=17.9,
                agreement={"draft": 0.251, "untrained": 0.016, "PCA init": 0.004},
                draft_params=6_882_176, teacher_params=134_515_008,
                ppl={"teacher": 49.8, "draft": 615.0, "untrained": 47929.0})


def test_a_good_run_passes(capsys):
    lab06.assert_claims(good())
    assert "FAIL" not in capsys.readouterr().out


def with_(path: str, value) -> dict:
    r = copy.deepcopy(good())
    if "." in path:
        a, b = path.split(".")
        r[a][b] = value
    else:
        r[path] = value
    return r


@pytest.mark.parametrize("path, value, message", [
    ("live_losses", [5.0, 5.2, 6.0, 7.0, 8.0, 8.5, 8.9, 9.0], "KD loss falls"),   # a loss with the wrong sign
    ("agreement.draft", 0.05, "distilled draft agrees"),                             # an untrained checkpoint
    ("agreement.untrained", 0.10, "distilled draft agrees"),
    ("draft_params", 20_000_000, "shipped draft is tiny"),
    ("draft_mb", 27.6, "shipped draft is tiny"),                                     # saved in fp32
    ("cost_ratio", 3.0, "cheaper per decode step"),
    ("ppl.draft", 40.0, "held-out perplexity"),
    ("ppl.draft", 5000.0, "held-out perplexity"),
])
def test_each_claim_fails_on_a_wrong_measurement(path, value, message):
    with pytest.raises(AssertionError, match=message):
        lab06.assert_claims(with_(path, value), show=False)
