"""Lab 16's reference Triton kernels (under Triton's interpreter on a CPU) equal `paged_attention_reference`:
random shuffled block tables, ragged contexts with partly filled last blocks, grouped-query ratios, and split-KV
with more splits than a short context has blocks (empty slices combine to nothing)."""
from __future__ import annotations

import random

import pytest
import torch

from lab_utils.kernels import triton_env
from lab_utils.kernels.decode_cases import random_case

triton, WHY = triton_env.load()
pytestmark = pytest.mark.skipif(triton is None, reason=WHY)


def _kernels():
    from lab_utils.kernels import paged_decode_triton

    return paged_decode_triton


@pytest.mark.parametrize("seed", range(4))
def test_single_program_matches_reference(seed):
    case = random_case(random.Random(seed))
    got = _kernels().paged_decode(*case.args())
    torch.testing.assert_close(got, case.expected(), atol=1e-5, rtol=1e-5, msg=case.describe)


@pytest.mark.parametrize("seed,splits", [(10, 2), (11, 3), (12, 8)])
def test_split_kv_matches_reference(seed, splits):
    case = random_case(random.Random(seed), max_context=48)
    got = _kernels().paged_decode_split(*case.args(), splits)
    torch.testing.assert_close(got, case.expected(), atol=1e-5, rtol=1e-5, msg=case.describe)


def test_large_scores_stay_finite():
    """Scores of ~1e3 overflow exp() without the running max: the kernel subtracts it."""
    case = random_case(random.Random(3), scale_q=400.0, heads=(4, 2))
    got = _kernels().paged_decode(*case.args())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, case.expected(), atol=1e-4, rtol=1e-4)


def test_bad_shapes_are_named():
    case = random_case(random.Random(5), heads=(4, 2))
    q, k, v, t, c, bs, s = case.args()
    with pytest.raises(ValueError, match="power of two"):
        _kernels().paged_decode(q, k, v, t, c, 6, s)
    with pytest.raises(ValueError, match="query heads cannot share"):
        _kernels().paged_decode(q[:, :3], k, v, t, c, bs, s)
