"""A lab's closing claims: statements computed from what just ran, printed, and asserted.

Every lab states its claims one way. Its module (`lab_utils.checks.labNN`) has `claims(r: dict) -> list[Claim]`,
built from `r`, the dict of the run's measurements the notebook's claims cell passes (`need` names a missing one),
and `assert_claims(r: dict, show: bool = True) -> None`, which is `report(claims(r), show)`: the cell prints one
PASS / FAIL / NOT JUDGED line per claim and fails on a FAIL. Keeping the logic out of the notebook lets a unit test
(`tests/unit/test_claims_labNN.py`) feed it a perturbed measurement (a broken component, a slower path) and see the
claim fail: every claim must be able to fail.
A statement that only re-checks a model's own arithmetic says so ("check of the model"), so it does not read as
a measurement.
A timing claim may also be "not judged" (verdict None, see `lab_utils.checks.timing`): the machine was too busy
for its interleaved rounds to agree. It is printed with how to rerun, and raises nothing.
A claim about a trained model's quality (perplexity order, a draft's agreement, schema-valid answers, routing)
is a coin toss on random weights (`MODEL="smollm2-135m-random"`, the lent GPU machine's model): `trained_only`
makes it NOT JUDGED there, saying so, while every other claim of that run is judged.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

Claim = tuple[str, bool | None]  # None: a timing claim the run could not judge


def report(claims: Sequence[Claim], show: bool = True) -> None:
    """Print each claim as PASS/FAIL/NOT JUDGED; raise AssertionError naming every claim that failed."""
    if show:
        for text, ok in claims:
            print(("NOT JUDGED  " if ok is None else "PASS  " if ok else "FAIL  ") + text)
    failed = [text for text, ok in claims if ok is not None and not ok]
    if failed:
        raise AssertionError(f"{len(failed)} of {len(claims)} claims failed: " + " | ".join(failed))


def need(r: Mapping, *keys: str) -> None:
    """A clear error when the claims cell did not pass a measurement the claims need."""
    missing = [k for k in keys if k not in r]
    if missing:
        raise KeyError(f"the claims need {missing}: run the cells above first (they compute these)")


def parts_called(what: str, calls: Mapping[str, int], names: Sequence[str]) -> Claim:
    """The claim '<what> ran your <parts>', with each part's calls in the measured run (`EngineParts.calls`, or
    its difference over the run): it holds only when every named part was called at least once."""
    counts = {name: int(calls.get(name, 0)) for name in names}
    idle = [name for name, k in counts.items() if k == 0]
    text = f"{what} ran your " + ", ".join(f"{name.split('.')[-1]} ({k} calls)" for name, k in counts.items())
    if idle:
        text += f"; never called: {', '.join(idle)}"
    return text, bool(counts) and not idle


RANDOM_WEIGHTS = "NOT JUDGED: random weights"


def has_random_weights(model: str | None) -> bool:
    """Whether the model named `model` (a registry name, e.g. the lab's `MODEL`) has random weights."""
    from lab_utils.models.registry import REGISTRY

    spec = REGISTRY.get(str(model)) if model is not None else None
    return spec is not None and spec.kind == "random"


def trained_only(claim: Claim, model: str | None) -> Claim:
    """`claim` as it is, unless `model` has random weights: then NOT JUDGED (verdict None), with why."""
    text, ok = claim
    if not has_random_weights(model):
        return claim
    return (f"{text} -- {RANDOM_WEIGHTS} ({model}: this claim needs a trained model's quality; "
            f"run with MODEL='smollm2-135m' to judge it)", None)
