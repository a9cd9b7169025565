"""A lab's closing claims: statements computed from what just ran, printed, and asserted.

Each lab's module (`lab_utils.checks.labNN`) has `claims(r) -> list[Claim]`, built from a dict of the run's
measurements, and `assert_claims(r)`. Keeping the logic out of the notebook lets a unit test feed it a perturbed
measurement (a broken component, a slower path) and see the claim fail: every claim must be able to fail.
A statement that only re-checks a model's own arithmetic says so ("check of the model"), so it does not read as
a measurement.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

Claim = tuple[str, bool]


def report(claims: Sequence[Claim], show: bool = True) -> None:
    """Print each claim as PASS/FAIL; raise AssertionError naming every claim that failed."""
    if show:
        for text, ok in claims:
            print(("PASS  " if ok else "FAIL  ") + text)
    failed = [text for text, ok in claims if not ok]
    if failed:
        raise AssertionError(f"{len(failed)} of {len(claims)} claims failed: " + " | ".join(failed))


def need(r: Mapping, *keys: str) -> None:
    """A clear error when the claims cell did not pass a measurement the claims need."""
    missing = [k for k in keys if k not in r]
    if missing:
        raise KeyError(f"the claims need {missing}: run the cells above first (they compute these)")
