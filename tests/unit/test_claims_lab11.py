"""Negative controls for lab 11's claims: good summaries pass, each perturbed one fails its claim."""
from __future__ import annotations

import copy

import pytest

from lab_utils.checks import lab11


def _s(recall, tokens, completeness):
    return {"recall@5": recall, "tokens_per_query": tokens, "constraint_completeness": completeness}


def good() -> dict:
    fu = {"bm25": {"last": _s(0.336, 8.8, 0.782), "full": _s(0.455, 87.8, 1.0), "session": _s(0.551, 24.8, 1.0)},
          "hybrid": {"last": _s(0.384, 8.8, 0.782), "full": _s(0.548, 87.8, 1.0), "session": _s(0.694, 24.8, 1.0)}}
    layout = {"yours": {"hit_rate": 0.55, "prompt_tokens": 3000, "cached_tokens": 1650},
              "volatile first": {"hit_rate": 0.04, "prompt_tokens": 3000, "cached_tokens": 120}}
    return dict(followup=fu, retrievers=["bm25", "hybrid"], layout=layout)


def test_good_summaries_pass(capsys):
    lab11.assert_claims(good())
    assert "FAIL" not in capsys.readouterr().out


def with_(retriever, strategy, key, value):
    r = copy.deepcopy(good())
    r["followup"][retriever][strategy][key] = value
    return r


@pytest.mark.parametrize("retriever, strategy, key, value, message", [
    ("bm25", "session", "recall@5", 0.40, "session beats last"),          # a state that loses the entity
    ("hybrid", "last", "recall@5", 0.60, "session beats last"),
    ("bm25", "session", "tokens_per_query", 60.0, "50% of full's tokens"),  # a state that keeps the history
    ("hybrid", "full", "recall@5", 0.70, "matches or beats full"),
    ("bm25", "session", "constraint_completeness", 0.9, "check of the state"),  # a state that drops constraints
    ("hybrid", "last", "constraint_completeness", 1.0, "check of the state"),
])
def test_each_claim_fails_on_a_wrong_summary(retriever, strategy, key, value, message):
    with pytest.raises(AssertionError, match=message):
        lab11.assert_claims(with_(retriever, strategy, key, value), show=False)


def test_the_layout_claim_fails_when_the_cache_is_not_used():
    r = copy.deepcopy(good())
    r["layout"]["yours"]["hit_rate"] = 0.08  # the state or the passages placed before the history
    with pytest.raises(AssertionError, match="prefix cache"):
        lab11.assert_claims(r, show=False)
