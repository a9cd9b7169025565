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
