"""Lab 02's claims cell: holds on good measurements, and each claim fails on a perturbed one."""
from __future__ import annotations

import pytest

from lab_utils.checks import lab02

CONTIGUOUS = {"kv_waste": 0.745, "peak_running": 8}
PAGED = {"kv_waste": 0.028, "peak_running": 24}


CALLS = {name: 50 for name in lab02.PAGED_RUN_PARTS}


def measured(c=CONTIGUOUS, p=PAGED, same=24, calls=CALLS, finished=True) -> dict:
    return dict(contiguous=c, paged=p, same=same, num_requests=24, calls=calls, all_finished=finished)


def test_good_measurements_pass(capsys):
    lab02.assert_claims(measured())
    out = capsys.readouterr().out
    assert out.count("PASS") == 6 and "FAIL" not in out


@pytest.mark.parametrize("kwargs, words", [
    (dict(p={**PAGED, "kv_waste": 0.06}), "paged waste"),
    (dict(c={**CONTIGUOUS, "kv_waste": 0.3}), "contiguous reservation waste"),
    (dict(p={**PAGED, "peak_running": 12}), "more sequences resident"),
    (dict(same=23), "greedy outputs identical"),
    (dict(calls={**CALLS, "scheduler.preempt": 0}), "never called: scheduler.preempt"),  # no preemption ran
    (dict(calls={}), "never called: block_manager.grow"),
    (dict(finished=False), "every request finished"),
])
def test_each_claim_can_fail(kwargs, words):
    with pytest.raises(AssertionError, match=words):
        lab02.assert_claims(measured(**kwargs), show=False)


def test_missing_measurements_name_the_cells_to_run():
    with pytest.raises(KeyError, match="run the cells above"):
        lab02.claims({"paged": PAGED})
