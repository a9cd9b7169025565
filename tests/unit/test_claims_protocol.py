"""Every lab states its claims one way (`lab_utils.checks.claims`): `claims(r) -> list[Claim]` and
`assert_claims(r, show=True)`, and a claims cell run before the cells that measure names what is missing."""
from __future__ import annotations

import importlib
import inspect

import pytest

LABS = [f"{n:02d}" for n in range(14)]


@pytest.mark.parametrize("lab", LABS)
def test_each_lab_has_the_one_claims_protocol(lab):
    module = importlib.import_module(f"lab_utils.checks.lab{lab}")
    assert list(inspect.signature(module.claims).parameters) == ["r"]
    assert list(inspect.signature(module.assert_claims).parameters) == ["r", "show"]
    assert inspect.signature(module.assert_claims).parameters["show"].default is True


@pytest.mark.parametrize("lab", LABS)
def test_claims_without_measurements_name_the_cells_to_run(lab):
    module = importlib.import_module(f"lab_utils.checks.lab{lab}")
    with pytest.raises(KeyError, match="run the cells above"):
        module.assert_claims({}, show=False)
