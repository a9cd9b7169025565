"""The prefill cost fit (TTFT = a + b x prompt tokens) and the TTFT cut it predicts for prefix-cache hits."""
from __future__ import annotations

import pytest

from lab_utils.sim.prefill_cost import predicted_ttft_cut, prefill_cost_fit


def test_prefill_cost_fit_and_prediction():
    lens = [100, 200, 300, 400]
    cpu = prefill_cost_fit(lens, [0.001 + 1e-4 * n for n in lens])  # per-token cost dominates
    assert cpu == pytest.approx((0.001, 1e-4))
    gpu = prefill_cost_fit(lens, [0.006 + 1e-7 * n for n in lens])  # the step's fixed cost dominates
    cached = [0, 160, 256, 352]
    assert predicted_ttft_cut(cpu, lens, cached) > 0.5
    assert predicted_ttft_cut(gpu, lens, cached) < 0.02
    # super-linear (attention): no negative fixed cost; flat noise: no negative slope
    assert prefill_cost_fit(lens, [1e-6 * n * n for n in lens])[0] == 0.0
    assert prefill_cost_fit(lens, [0.006, 0.0059, 0.0058, 0.0057])[1] == 0.0
    with pytest.raises(ValueError, match=">= 2 prompts"):
        prefill_cost_fit([100], [0.01])
