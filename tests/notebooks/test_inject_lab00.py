"""A wrong rope injected into lab 00 stops the lab at its check with the named mistake, before the model runs it
and before any measurement."""
from __future__ import annotations

import pytest
from inject import assert_fails_at_check

from lab_utils.paths import REPO_ROOT

pytestmark = pytest.mark.notebooks

# rotates by the usual base 10000 whatever `theta` says (SmolLM2 uses 100000)
FIXED_THETA = """
D = x.shape[-1]
inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
angles = positions.float().unsqueeze(-1) * inv_freq
angles = torch.cat([angles, angles], dim=-1).unsqueeze(2)
return x * angles.cos().to(x.dtype) + rotate_half(x) * angles.sin().to(x.dtype)
"""


def test_a_rope_with_a_fixed_theta_fails_at_its_check(tmp_path):
    assert_fails_at_check(REPO_ROOT / "labs" / "00_foundations.ipynb", "def rope(", FIXED_THETA,
                          "you used theta=10000 instead of the `theta` argument", "lab00.check_rope(", tmp_path)
