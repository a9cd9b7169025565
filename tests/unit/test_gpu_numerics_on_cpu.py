"""Numerics that decide results on a GPU, checked on a CPU: INT8 scales stay float32 in a bf16 model, and sampled
Medusa/EAGLE proposals come from the proposer's seeded generator (never the device's global RNG)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lab_utils.engine.config import SpecConfig
from lab_utils.quant.linear import Int8Linear, W8A8GroupLinear, W8A8Linear


def _layer(seed: int = 0, n: int = 256) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(n, n, bias=False)
    with torch.no_grad():  # rows of very different magnitudes: scales that are not round numbers in bf16
        lin.weight.mul_(torch.logspace(-2, 1, n)[:, None])
    return lin


@pytest.mark.parametrize("cls", [Int8Linear, W8A8Linear, W8A8GroupLinear])
def test_int8_scale_stays_float32_when_the_model_goes_to_bf16(cls):
    q = cls.from_linear(_layer())
    fp32 = q.scale.clone()
    q = q.to(torch.bfloat16)
    assert q.scale.dtype == torch.float32 and torch.equal(q.scale, fp32)
    assert q.qweight.dtype == torch.int8


def test_int8_bf16_output_is_the_fp32_scaled_product_rounded_once():
    lin = _layer()
    q = Int8Linear.from_linear(lin).to(torch.bfloat16)
    x = torch.randn(64, 256).to(torch.bfloat16)
    with torch.no_grad():
        got = q(x)
        prod = torch.nn.functional.linear(x, q.qweight.to(torch.bfloat16))
        assert torch.equal(got, (prod * q.scale).to(torch.bfloat16))
        # what a bf16-rounded scale gives instead, and its larger error against the exact dequantized layer
        rounded = prod * q.scale.to(torch.bfloat16)
        exact = x.double() @ (q.qweight.double() * q.scale.double()[:, None]).T
    err_fp32 = (got.double() - exact).abs().mean()
    err_bf16 = (rounded.double() - exact).abs().mean()
    assert err_fp32 < err_bf16, (float(err_fp32), float(err_bf16))
    assert torch.equal(q.dequantized_weight(torch.float32), q.qweight.float() * q.scale[:, None])


@pytest.fixture(scope="module")
def smollm2_shape():
    from lab_utils.models.loader import load_model

    model, tok = load_model("smollm2-135m-random", device="cpu", dtype=torch.float32)
    return model


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_sampled_proposals_follow_the_proposers_seeded_generator(smollm2_shape, method):
    from lab_utils.speculative import make_proposer

    model = smollm2_shape
    ids = list(range(1000, 1040))
    with torch.no_grad():
        hidden = model.hidden_states(torch.tensor([ids]))[0]
    runs = []
    for global_seed in (1, 2):
        prop = make_proposer(SpecConfig(method, 4), model, torch.device("cpu"))
        assert prop.generator.device.type == "cpu"
        torch.manual_seed(global_seed)  # the global RNG moves; the proposals must not
        runs.append([prop.propose(ids, 4, hidden[-2:-1], temperature=1.5).token_ids for _ in range(3)])
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) > 1, "three draws at T=1.5 were all equal: not sampling"
