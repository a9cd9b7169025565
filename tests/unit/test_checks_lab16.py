"""Lab 16's checks: the reference kernels pass and are saved as the learner's part; each known wrong kernel is
rejected naming its own mistake (and no other wrong kernel's). The wrong kernels here are PyTorch loops written
like a Triton program (block by block, online softmax), independent of the checks' own PyTorch versions."""
from __future__ import annotations

import math

import pytest
import torch

from lab_utils.checks import lab16
from lab_utils.kernels import triton_env

triton, WHY = triton_env.load()
needs_triton = pytest.mark.skipif(triton is None, reason=WHY)


def loop_kernel(mistake: str | None = None, split: bool = False):
    """A decode 'kernel' as a loop over programs (sequence, head, split) with one deliberate `mistake`."""
    def launch(q, k_cache, v_cache, tables, ctx, bs, scale, num_splits=1):
        B, Hq, D = q.shape
        group = Hq // k_cache.shape[1]
        width = tables.shape[1]
        per = max(1, -(-width // num_splits))
        out = torch.zeros(B, Hq, D)
        for b in range(B):
            row = tables[0] if mistake == "table_row" else tables[b]
            n_blocks = -(-int(ctx[b]) // bs)
            for h in range(Hq):
                kvh = h % k_cache.shape[1] if mistake == "kv_head" else h // group
                outs, lses = [], []
                for lo in range(0, width, per):
                    m, l, acc = -math.inf, 0.0, torch.zeros(D)
                    for j in range(lo, min(lo + per, n_blocks)):
                        blk = j if mistake == "table" else int(row[j])
                        slots = blk * bs + torch.arange(bs)
                        s = k_cache[slots, kvh] @ q[b, h] * (1.0 if mistake == "scale" else scale)
                        if mistake != "tail":
                            s = torch.where(j * bs + torch.arange(bs) < int(ctx[b]), s, -math.inf)
                        v = v_cache[slots, kvh]
                        if mistake == "no_max":
                            p = torch.exp(s)
                            acc, l = acc + p @ v, l + float(p.sum())
                            continue
                        m_new = max(m, float(s.max()))
                        p, alpha = torch.exp(s - m_new), math.exp(m - m_new)
                        acc, l, m = acc * alpha + p @ v, l * alpha + float(p.sum()), m_new
                    if l > 0 or mistake == "no_max":
                        outs.append(acc / l)
                        lses.append(m + math.log(l) if mistake != "no_max" else 0.0)
                if mistake == "split_mean":
                    out[b, h] = torch.stack(outs).mean(0)
                else:
                    w = torch.softmax(torch.tensor(lses), 0)
                    out[b, h] = (w[:, None] * torch.stack(outs)).sum(0)
        return out.to(q.dtype)

    if split:
        return launch
    return lambda q, k, v, t, c, bs, scale: launch(q, k, v, t, c, bs, scale, 1)


SINGLE = {"tail": "tail_not_masked", "kv_head": "wrong_kv_head", "no_max": "no_max_subtraction",
          "table": "table_ignored", "table_row": "table_row_offset", "scale": "missing_scale"}


def _rejection(fn, split=False) -> str:
    run = lab16._check_outputs("kernel.paged_decode_split" if split else "kernel.paged_decode", fn, 5, 7,
                               (2, 3) if split else (None,))
    raise AssertionError(f"accepted ({run} cases)")


def _message(fn, split=False) -> str:
    with pytest.raises(AssertionError) as err:
        _rejection(fn, split)
    return str(err.value)


def test_correct_loop_kernel_passes():
    assert lab16._check_outputs("kernel.paged_decode", loop_kernel(), 6, 1) == 6
    assert lab16._check_outputs("kernel.paged_decode_split", loop_kernel(split=True), 5, 1, (2, 3, 8)) == 15


@pytest.mark.parametrize("mistake", sorted(SINGLE))
def test_each_mistake_is_named_and_no_other(mistake):
    msg = _message(loop_kernel(mistake))
    assert "kernel.paged_decode" in msg and "my_engine/kernel.py" in msg
    assert f"likely mistake: {SINGLE[mistake]}" in msg, msg
    others = [m.id for m in lab16.MISTAKES if m.id != SINGLE[mistake]] + ["no_max_subtraction"]
    assert not [o for o in others if o != SINGLE[mistake] and f"likely mistake: {o}" in msg], msg


def test_split_combined_without_lse_is_named():
    msg = _message(loop_kernel("split_mean", split=True), split=True)
    assert "likely mistake: split_without_lse" in msg, msg
    # a different wrong split kernel (tail unmasked) is named as that one, not as the combine
    msg = _message(loop_kernel("tail", split=True), split=True)
    assert "split_without_lse" not in msg and "tail_not_masked" in msg, msg


def test_an_unknown_mistake_shows_the_difference_alone():
    def off_by_a_bit(*args):
        return loop_kernel()(*args) + 1e-2

    msg = _message(off_by_a_bit)
    assert "values differ" in msg and "likely mistake" not in msg


def test_not_implemented_propagates():
    def todo(*args):
        raise NotImplementedError("write the kernel")

    with pytest.raises(NotImplementedError):
        lab16._check_outputs("kernel.paged_decode", todo, 2, 0)


def test_an_unwritten_kernel_compiled_by_triton_stops_at_its_hint():
    """Compiled (CUDA), Triton refuses the placeholder's `raise` with a compile error quoting the source: the
    check turns it into the NotImplementedError carrying the hint, as under the interpreter."""
    def compiled(*args):
        raise RuntimeError('at 4:4:\n    raise NotImplementedError("Contract: program (b, h) writes o")\n    ^\n'
                           'unsupported AST node type: Raise')

    with pytest.raises(NotImplementedError, match=r"^Contract: program \(b, h\) writes o$"):
        lab16._check_outputs("kernel.paged_decode", compiled, 2, 0)


@needs_triton
def test_reference_kernels_pass_and_are_saved(tmp_path, monkeypatch):
    from lab_utils.course import learner_parts
    from lab_utils.kernels import _decode_jit, paged_decode_triton as P

    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path))
    try:
        assert lab16.check_paged_decode(P.paged_decode, _decode_jit.paged_decode_kernel, cases_n=4, seed=3)
        assert lab16.check_paged_decode_split(P.paged_decode_split, _decode_jit.paged_decode_kernel,
                                              P.combine_splits, cases_n=4, seed=3, num_splits=(3,))
        text = (tmp_path / "kernel.py").read_text()
        assert "@triton.jit" in text and "def paged_decode(" in text and "def paged_decode_split(" in text
        learner_parts.forget()
        loaded = learner_parts._load_saved("kernel")
        assert set(loaded) == {"kernel.paged_decode", "kernel.paged_decode_split"}
    finally:
        learner_parts.forget()


def test_without_triton_the_check_says_skipped(monkeypatch, capsys):
    monkeypatch.setattr(triton_env, "load", lambda: (None, triton_env.SKIP + " (test)"))
    assert lab16.check_paged_decode(loop_kernel()) is False
    assert "skipped: needs triton" in capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny():
    from lab_utils.models.loader import build_random
    from lab_utils.models.registry import REGISTRY

    return build_random(REGISTRY["tiny-random"].config, seed=0).eval()


def test_engine_with_a_kernel_gives_the_reference_tokens(tiny):
    from lab_utils.course.parts import EngineParts

    run = lab16.check_kernel_in_engine(tiny, EngineParts({"kernel.paged_decode": loop_kernel()}), max_tokens=4)
    assert run["kernel"]["kernel_steps"] == 3 and run["kernel"]["tokens"] == run["reference"]["tokens"]


def test_engine_check_rejects_a_kernel_that_breaks_the_tokens(tiny):
    from lab_utils.course.parts import EngineParts

    def zeros(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
        return torch.zeros_like(q) + 5.0

    with pytest.raises(AssertionError, match="kernel.paged_decode"):
        lab16.check_kernel_in_engine(tiny, EngineParts({"kernel.paged_decode": zeros}), max_tokens=4)


@needs_triton
def test_engine_runs_the_reference_triton_kernel(tiny):
    run = lab16.check_kernel_in_engine(tiny, None, max_tokens=3)
    assert run["kernel"]["kernel_steps"] == 2
