"""A wrong learner implementation injected into labs 05 and 07 stops the lab at the exercise's check, with the
check's named mistake: an AssertionError raised by the check cell, not a traceback from inside the engine and
not a lab that goes on to measure an engine built with a broken part."""
from __future__ import annotations

import pytest
from inject import assert_fails_at_check

from lab_utils.paths import REPO_ROOT

pytestmark = pytest.mark.notebooks

LABS = REPO_ROOT / "labs"

# lab 05: the fp16 scale rounded to nearest, so a group's largest weight can land 7.003 steps out
INT4_NEAREST_SCALE = """
g = w.float().reshape(w.shape[0], -1, group_size)
amax = g.abs().amax(dim=-1, keepdim=True)
s16 = torch.where(amax > 0, amax / 7, torch.ones_like(amax)).half()
q = torch.clamp(torch.round(g / s16.float()), -7, 7).to(torch.int8)
return q.reshape(w.shape), s16.squeeze(-1)
"""

# lab 07: the rejected guesses stay counted as computed (their garbage K/V would be attended to)
ROLLBACK_KEEPS_COUNT = """
del req.token_ids[len(req.token_ids) - num_guesses:]
keep = block_manager.blocks_needed(req.num_computed_tokens + 1)
for block_id in reversed(req.block_table[keep:]):
    block_manager.release(block_id)
del req.block_table[keep:]
"""


@pytest.mark.parametrize("lab, marker, body, message, check", [
    ("05_quantization", "def quantize_per_group_int4(", INT4_NEAREST_SCALE, "round the scale up",
     "lab05.check_int4_per_group("),
    ("07_speculative_decoding", "def rollback(", ROLLBACK_KEEPS_COUNT, "num_guesses - num_accepted",
     "lab07.check_rollback("),
])
def test_wrong_part_fails_at_its_check(lab, marker, body, message, check, tmp_path):
    assert_fails_at_check(LABS / f"{lab}.ipynb", marker, body, message, check, tmp_path)
