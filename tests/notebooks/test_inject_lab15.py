"""A wrong fan-out or router injected into lab 15 stops the lab at the exercise's check, with the check's named
mistake, before the lab measures with it."""
from __future__ import annotations

import pytest
from inject import assert_fails_at_check

from lab_utils.paths import REPO_ROOT

pytestmark = pytest.mark.notebooks

LAB = REPO_ROOT / "labs" / "15_token_efficiency.ipynb"

# every sub-task sent in one instant: one batch, but each computes the shared prefix (none is cached yet)
ALL_AT_ONCE = """
return engine.generate(list(prompts), params)
"""

# the threshold on the wrong side: confident requests sent to the target, doubtful ones kept on the small model
WRONG_SIDE = """
top = max(small_scores)
confidence = 1.0 / sum(math.exp(s - top) for s in small_scores)
return "target" if confidence >= threshold else "small"
"""


@pytest.mark.parametrize("marker, body, message, check", [
    ("def fan_out(", ALL_AT_ONCE, "computed the shared prefix about", "lab15.check_fan_out("),
    ("def route(", WRONG_SIDE, "the other side", "lab15.check_route("),
])
def test_wrong_part_fails_at_its_check(marker, body, message, check, tmp_path):
    assert_fails_at_check(LAB, marker, body, message, check, tmp_path)
