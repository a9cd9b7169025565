"""Lab 00's checkers: they accept correct solutions and reject each common mistake with a useful message."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lab_utils.checks import lab00
from lab_utils.models.llama import rotate_half

# --- RoPE --------------------------------------------------------------------------------------------------


def good_rope(x, positions, theta):
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.double().unsqueeze(-1) * inv
    ang = torch.cat([ang, ang], -1).unsqueeze(2)
    return (x.double() * ang.cos() + rotate_half(x.double()) * ang.sin()).to(x.dtype)


def test_rope_checker_accepts_correct(capsys):
    lab00.check_rope(good_rope, seed=0)
    lab00.check_rope(good_rope)  # fresh random inputs
    assert "check_rope passed" in capsys.readouterr().out


def _ignores_positions(x, positions, theta):
    return good_rope(x, torch.arange(x.shape[1]).expand(x.shape[0], -1), theta)


def _interleaved(x, positions, theta):
    D = x.shape[-1]
    perm = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])
    return good_rope(x[..., perm], positions, theta)[..., torch.argsort(perm)]


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda x, p, th: x.clone(), "nothing was rotated"),
        (_ignores_positions, "instead of the `positions` argument"),
        (lambda x, p, th: good_rope(x, p, 10000.0), "theta=10000"),
        (lambda x, p, th: good_rope(x, -p, th), "wrong way"),
        (_interleaved, "adjacent pairs"),
        (lambda x, p, th: good_rope(x, p, th).double(), "dtype torch.float64"),
        (lambda x, p, th: good_rope(x, p, th)[..., :-1], "shape"),
        (lambda x, p, th: good_rope(x, p, th) * 1.01, "first wrong index"),
        (lambda x, p, th: good_rope(x, p, th).tolist(), "torch.Tensor"),
    ],
)
def test_rope_checker_rejects_mistakes(bad, message):
    with pytest.raises(AssertionError, match=message):
        lab00.check_rope(bad, seed=1)


def test_rope_checker_rejects_in_place():
    def in_place(x, p, th):
        x.mul_(1.0).add_(0.5)
        return good_rope(x, p, th)

    with pytest.raises(AssertionError, match="in place"):
        lab00.check_rope(in_place, seed=2)


def test_rope_failure_reports_expected_and_got_without_source():
    with pytest.raises(AssertionError) as e:
        lab00.check_rope(lambda x, p, th: good_rope(x, p, th) + 1.0, seed=3)
    msg = str(e.value)
    assert "expected" in msg and "got" in msg and "b=0" in msg
    assert "rotate_half" not in msg and "cos" not in msg  # never shows the solution


# --- one KV-cached attention step --------------------------------------------------------------------------


def good_step(q, k_new, v_new, k_cache, v_cache):
    k, v = torch.cat([k_cache, k_new], 1), torch.cat([v_cache, v_new], 1)
    g = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vr), k, v


def test_step_checker_accepts_correct(capsys):
    lab00.check_cached_attention(good_step, seed=0)
    lab00.check_cached_attention(good_step)
    assert "check_cached_attention passed" in capsys.readouterr().out


def _no_scale(q, kn, vn, kc, vc):
    out, k, v = good_step(q * math.sqrt(q.shape[-1]), kn, vn, kc, vc)
    return out, k, v


def _repeat_not_interleave(q, kn, vn, kc, vc):
    k, v = torch.cat([kc, kn], 1), torch.cat([vc, vn], 1)
    g = q.shape[2] // k.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat(1, 1, g, 1).transpose(1, 2), v.repeat(1, 1, g, 1).transpose(1, 2)
    ).transpose(1, 2)
    return out, k, v


def _skip_self(q, kn, vn, kc, vc):
    out, _, _ = good_step(q, kc, vc, kc[:, :0], vc[:, :0]) if kc.shape[1] else good_step(q, kn, vn, kc, vc)
    return out, torch.cat([kc, kn], 1), torch.cat([vc, vn], 1)


def _ignore_cache(q, kn, vn, kc, vc):
    out, _, _ = good_step(q, kn, vn, kc[:, :0], vc[:, :0])
    return out, torch.cat([kc, kn], 1), torch.cat([vc, vn], 1)


def _prepend(q, kn, vn, kc, vc):
    out, _, _ = good_step(q, kn, vn, kc, vc)
    return out, torch.cat([kn, kc], 1), torch.cat([vn, vc], 1)


@pytest.mark.parametrize(
    "bad, message",
    [
        (_no_scale, "1/sqrt"),
        (_repeat_not_interleave, "wrong KV heads"),
        (_skip_self, "does not attend to itself"),
        (_ignore_cache, "cached tokens are ignored"),
        (_prepend, "in front"),
        (lambda q, kn, vn, kc, vc: (good_step(q, kn, vn, kc, vc)[0], kc, vc), "shape"),
        (lambda q, kn, vn, kc, vc: good_step(q, kn, vn, kc, vc)[0], "tuple of 3"),
        (lambda q, kn, vn, kc, vc: (good_step(q, kn, vn, kc, vc)[0].half(), *good_step(q, kn, vn, kc, vc)[1:]),
         "dtype torch.float16"),
    ],
)
def test_step_checker_rejects_mistakes(bad, message):
    with pytest.raises(AssertionError, match=message):
        lab00.check_cached_attention(bad, seed=1)


def test_step_checker_catches_a_step_that_only_breaks_inside_the_model():
    """Correct on the random cases but wrong once positions grow: only the tiny-model pass can see it."""
    calls = {"n": 0}

    def wrong_after_a_while(q, kn, vn, kc, vc):
        calls["n"] += 1
        out, k, v = good_step(q, kn, vn, kc, vc)
        return (out + 0.1 if kc.shape[1] >= 6 and q.shape[2] == 4 else out), k, v

    with pytest.raises(AssertionError, match="tiny model logits"):
        lab00.check_cached_attention(wrong_after_a_while, seed=0)
    assert calls["n"] > 3


# --- the learner's rope inside the model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    from lab_utils.models.loader import build_random
    from lab_utils.models.registry import REGISTRY

    return build_random(REGISTRY["tiny-random"].config, seed=1).eval()


def _prompt(model):
    return torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))


def test_the_model_runs_a_given_rope_bit_for_bit(tiny_model):
    ids = _prompt(tiny_model)
    with torch.no_grad():
        assert torch.equal(tiny_model(ids, rope=lab00.reference_rope), tiny_model(ids))


def test_rope_in_model_counts_every_call_and_the_claim_reports_it(tiny_model, capsys):
    n, layers = 4, tiny_model.config.num_hidden_layers
    got = lab00.check_rope_in_model(tiny_model, _prompt(tiny_model), good_rope, n=n)
    assert got == dict(calls=2 * layers * n, forwards=n, layers=layers, logits_match=True)
    assert f"your rope ran {2 * layers * n} times inside the model" in capsys.readouterr().out
    text, ok = lab00._rope_claim(got)
    assert ok and f"your rope ran {2 * layers * n} times inside the model" in text


@pytest.mark.parametrize("change, message", [
    ({"calls": 0}, "ran 0 times"),                     # a model that never called it
    ({"calls": 7}, "ran 7 times"),                     # called in some layers only
    ({"logits_match": False}, "changed its logits"),
])
def test_the_rope_claim_fails_when_the_model_did_not_run_it(tiny_model, change, message):
    good = dict(calls=2 * 3 * 4, forwards=4, layers=3, logits_match=True)
    text, ok = lab00._rope_claim({**good, **change})
    assert ok is False and message in text


def test_rope_claim_is_in_lab00_claims_and_can_fail():
    from tests.unit.test_claims_lab00 import good

    r = {**good(), "rope_in_model": dict(calls=0, forwards=6, layers=30, logits_match=True)}
    with pytest.raises(AssertionError, match="your rope ran 0 times"):
        lab00.assert_claims(r, show=False)


def test_rope_in_model_rejects_a_rope_that_only_breaks_at_an_offset(tiny_model):
    """Right for the first 7 positions (the prompt), wrong for the decode steps: only the model run sees it."""
    def wrong_after_the_prompt(x, positions, theta):
        return good_rope(x, positions.clamp(max=6), theta)

    with pytest.raises(AssertionError, match="changes the logits of the decode step at position 7"):
        lab00.check_rope_in_model(tiny_model, _prompt(tiny_model), wrong_after_the_prompt, n=6)


def test_rope_in_model_needs_a_decode_step(tiny_model):
    with pytest.raises(ValueError, match="n must be >= 2"):
        lab00.check_rope_in_model(tiny_model, _prompt(tiny_model), good_rope, n=1)


# --- the goodput claim when one side met no SLO in a round --------------------------------------------------


def _rounds(bat, seq):
    from tests.unit.test_claims_lab00 import _serving, loaded

    r = loaded()
    r["bat_rounds"] = [{**m, "request_goodput": g} for m, g in zip(r["bat_rounds"], bat)]
    r["seq_rounds"] = [{**m, "request_goodput": g} for m, g in zip(r["seq_rounds"], seq)]
    return r


def _goodput_line(r) -> tuple[str, bool | None]:
    return next((t, ok) for t, ok in lab00.claims(r) if t.startswith("the batch has higher goodput"))


def test_goodput_with_a_zero_side_prints_each_round_not_an_infinite_range():
    text, ok = _goodput_line(_rounds([0.4, 0.0, 0.3], [0.0, 0.2, 0.0]))  # ratios inf, 0, inf
    assert "inf" not in text and "0.00x" not in text
    assert "each round, batch vs one at a time: 0.40 vs 0.00, 0.00 vs 0.20, 0.30 vs 0.00 req/s" in text
    assert ok is None and "NOT JUDGED" in text


def test_goodput_where_only_the_batch_meets_the_slo_passes_and_says_so():
    text, ok = _goodput_line(_rounds([0.4, 0.5, 0.3], [0.0, 0.0, 0.0]))
    assert ok is True and "inf" not in text and "0.50 vs 0.00" in text


def test_goodput_where_only_one_at_a_time_meets_the_slo_fails():
    text, ok = _goodput_line(_rounds([0.0, 0.0, 0.0], [0.2, 0.1, 0.3]))
    assert ok is False and "0.00x" not in text and "0.00 vs 0.10" in text


def test_rope_in_model_names_a_known_mistake_seen_only_at_the_models_theta(tiny_model):
    """Right at the check's thetas, theta=10000 at the model's: the model run names the theta mistake."""
    theta = tiny_model.config.rope_theta

    def fixed_theta_at_the_models(x, positions, th):
        return good_rope(x, positions, 10000.0 if th == theta else th)

    if theta == 10000.0:
        pytest.skip("the tiny model uses theta 10000 itself")
    with pytest.raises(AssertionError, match="you used theta=10000 instead of the `theta` argument"):
        lab00.check_rope_in_model(tiny_model, _prompt(tiny_model), fixed_theta_at_the_models, n=3)
