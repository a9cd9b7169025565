"""Checks for lab 05's exercises: encode a float to FP8 E4M3 by hand; per-channel symmetric INT8 and back;
per-group INT4 and back; the FP8 KV cache's write (values -> E4M3 bytes) and read (bytes -> values).

The quantizers and the FP8 codec are engine parts (`lab_utils.course.parts`): once a check passes, the lab
submits them, and `check_quant_in_engine` runs the real engine with them (INT8 and INT4 linears built by the
learner's quantizers, an FP8 KV cache written and read by the learner's codec) against the engine's own.

Each check runs the learner's function on fresh random inputs (plus the edge cases that matter: ties,
subnormals, overflow, signed zero), compares with `lab_utils.quant.formats`, and on a mismatch raises
AssertionError saying which input, what was expected, what came back, and (when recognisable) which rule was
missed. It never shows the reference code.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lab_utils.checks.claims import Claim
from lab_utils.checks.part_named import checks_part
from lab_utils.quant.formats import FP8_E4M3, quantize_int

E4M3 = FP8_E4M3


# --- exercise 1: float -> E4M3 bits ----------------------------------------------------------------------------
def _describe(bits) -> str:
    if not isinstance(bits, int) or not 0 <= bits <= 255:
        return repr(bits)
    return f"0x{bits:02X} = {E4M3.explain(bits)}"


def _e4m3_cases(gen: torch.Generator) -> list[float]:
    fixed = [0.0, -0.0, 1.0, -1.0, 1.25, 448.0, -448.0, 1000.0, -1e6, 464.0, 470.0, math.inf, 2**-9, -(2**-9),
             2**-10, 3 * 2**-11, 2**-6, 2**-6 - 2**-10, 1 + 2**-4, 1 + 3 * 2**-4, 0.1, 3.14159, -2.71828]
    vals = E4M3.all_values()
    vals = vals[vals < E4M3.max_value]
    rnd = []
    i = torch.randint(0, vals.numel() - 1, (40,), generator=gen)
    rnd += ((vals[i] + vals[i + 1]) / 2).tolist()  # exact ties
    rnd += torch.exp2(torch.empty(80).uniform_(-12, 9.5, generator=gen)).tolist()  # every binade, subnormals, overflow
    signs = torch.where(torch.rand(len(rnd), generator=gen) < 0.5, -1.0, 1.0).tolist()
    return fixed + [s * v for s, v in zip(signs, rnd)]


def _e4m3_diagnosis(x: float, got, expected: int) -> str:
    if not isinstance(got, int) or isinstance(got, bool):
        return f"return a Python int bit pattern (0..255), not {type(got).__name__}"
    if not 0 <= got <= 255:
        return "the result must fit in 8 bits (0..255)"
    if math.isnan(x):
        return ""
    a = abs(x)
    gv, ev = E4M3.decode(got), E4M3.decode(expected)
    if (got >> 7) != (expected >> 7) and abs(gv) == abs(ev):
        return "the sign bit is wrong (bit 7 holds the sign, also for -0.0)"
    if a > E4M3.max_value or math.isinf(a):
        return f"{x!r} is beyond E4M3's largest finite value 448: saturate to ±448 (E4M3 has no infinity)"
    if math.isnan(gv):
        return "you produced the NaN pattern S.1111.111; E4M3's largest finite value is S.1111.110 = 448"
    lo = max(v for v in E4M3.all_values().tolist() if v <= a)
    hi = min([v for v in E4M3.all_values().tolist() if v >= a] or [E4M3.max_value])
    if lo < a < hi and a - lo == hi - a and abs(gv) in (lo, hi):
        return (f"{x!r} lies exactly halfway between {lo!r} and {hi!r}; round-to-nearest-even picks the one whose "
                f"mantissa field is even")
    if lo < a < hi and abs(gv) == lo and (a - lo) > (hi - a):
        return f"you rounded toward zero (truncated); {x!r} is nearer to {hi!r} than to {lo!r}"
    if lo < a < hi and abs(gv) == hi and (a - lo) < (hi - a):
        return f"you rounded away from zero; {x!r} is nearer to {lo!r} than to {hi!r}"
    if a < E4M3.min_normal and abs(gv) != abs(ev):
        return (f"{x!r} is below the smallest normal value 2^-6 = {E4M3.min_normal}: it is subnormal (exponent field "
                f"0, no implicit leading 1, steps of 2^-9)")
    return ("the pattern is sign (bit 7), exponent (bits 6-3, bias 7), mantissa (bits 2-0) of the E4M3 value nearest "
            f"to {x!r}: yours decodes to {gv!r}, the nearest is {ev!r}")


def check_encode_e4m3(fn: Callable[[float], int], seed: int | None = None) -> None:
    """`fn(x: float) -> int`: the E4M3 bit pattern of `x`, round to nearest even, saturating at ±448."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    cases = _e4m3_cases(gen)
    for x in cases:
        expected = E4M3.encode(x, saturate=True)
        got = fn(x)
        if isinstance(got, int) and not isinstance(got, bool) and got == expected:
            continue
        raise AssertionError(
            f"encode_e4m3({x!r}) returned {_describe(got)}\n   expected {_describe(expected)}"
            + (f"\n   hint: {d}" if (d := _e4m3_diagnosis(x, got, expected)) else "")
        )
    got = fn(math.nan)
    if not (isinstance(got, int) and 0 <= got <= 255 and E4M3.is_nan_bits(got)):
        raise AssertionError(f"encode_e4m3(nan) returned {_describe(got)}; NaN must encode as S.1111.111 (0x7F or 0xFF)")
    print(f"check_encode_e4m3 passed: {len(cases) + 1} values (ties, subnormals, overflow, signs) encode bit-exactly")


# --- exercise 2: per-channel symmetric INT8 and back -------------------------------------------------------------
def _weights(gen: torch.Generator) -> torch.Tensor:
    out_f, in_f = int(torch.randint(5, 24, (), generator=gen)), int(torch.randint(8, 70, (), generator=gen))
    w = torch.randn(out_f, in_f, generator=gen) * torch.exp(2 * torch.randn(out_f, 1, generator=gen))  # uneven rows
    w[1] = 0.0  # an all-zero row: the scale must not become 0 or NaN
    w[2, 3] = w[2].abs().max() * 1.0 + 1.0  # a positive row maximum ...
    w[3, 0] = -(w[3].abs().max() + 1.0)  # ... and a negative one
    return w


# dequantize_int8 is checked with the INT8 quantizer but is no engine part (Int8Linear multiplies by the scale itself)
DEQUANT_INT8 = "dequantize_int8 (lab 05, an exercise kept in the notebook: not an engine part)"


@checks_part("quant.quantize_per_channel_int8")
def check_int8_per_channel(quantize_fn: Callable, dequantize_fn: Callable, seed: int | None = None) -> None:
    """`quantize_fn(w [out, in]) -> (q int8 [out, in], scale [out, 1])` (symmetric, ±127, one scale per row);
    `dequantize_fn(q, scale) -> w_hat` float32."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    for trial in range(3):
        w = _weights(gen)
        ref = quantize_int(w, bits=8, symmetric=True, granularity="channel", axis=0)
        out = quantize_fn(w.clone())
        if not (isinstance(out, tuple) and len(out) == 2):
            raise AssertionError(f"quantize_fn should return a tuple (q, scale), got {type(out).__name__}")
        q, scale = out
        for name, t in (("q", q), ("scale", scale)):
            if not isinstance(t, torch.Tensor):
                raise AssertionError(f"{name} should be a torch.Tensor, got {type(t).__name__}")
        if q.shape != w.shape:
            raise AssertionError(f"q has shape {tuple(q.shape)} but the weight is {tuple(w.shape)}: one integer per weight")
        if q.dtype != torch.int8:
            raise AssertionError(f"q has dtype {q.dtype}; store the integers as torch.int8 (1 byte each)")
        if scale.shape != (w.shape[0], 1):
            what = ("one scale for the whole tensor (per-tensor)" if scale.numel() == 1 else
                    "one scale per input column" if scale.numel() == w.shape[1] and w.shape[1] != w.shape[0] else
                    f"shape {tuple(scale.shape)}")
            raise AssertionError(f"scale has shape {tuple(scale.shape)} ({what}); per-channel means one scale per output "
                                 f"row, shape [out, 1] = {(w.shape[0], 1)}, so it broadcasts over the row")
        if scale.dtype != torch.float32:
            raise AssertionError(f"scale has dtype {scale.dtype}; the contract says float32 (the layer keeps its "
                                 f"per-row scales in float32: they are tiny, and a rounded scale puts its error on "
                                 f"every output of the row)")
        if not torch.isfinite(scale).all() or (scale <= 0).any():
            r = int((~torch.isfinite(scale) | (scale <= 0)).nonzero()[0, 0])
            raise AssertionError(f"scale[{r}] = {scale[r].item()}: row {r} is all zeros and the scale must stay positive "
                                 f"and finite (any positive value works when there is nothing to represent)")
        nz = ref.scale.squeeze(1) != 1.0
        distinct_rows = not torch.allclose(ref.scale[nz], ref.scale[nz][:1], rtol=1e-5, atol=0)
        if distinct_rows and torch.equal(scale, scale[:1].expand_as(scale)):  # per-tensor, repeated in every row
            raise AssertionError(f"every row has the same scale ({scale[0, 0].item():.6g}): that is one scale for the "
                                 f"whole tensor (per-tensor), repeated in each row; per-channel gives each output row "
                                 f"its own scale, the largest |value| of that row / 127 (row 0: "
                                 f"{ref.scale[0, 0].item():.6g})")
        bad = nz & ~torch.isclose(scale.squeeze(1), ref.scale.squeeze(1), rtol=1e-5, atol=0)
        if bad.any():
            r = int(bad.nonzero()[0, 0])
            ratio = (ref.scale[r] / scale[r]).item()
            hint = (" (it looks like you divided by 128 or 255; the symmetric INT8 range is ±127)" if
                    abs(ratio - 128 / 127) < 1e-3 or abs(ratio - 255 / 127) < 1e-3 else
                    " (it looks like you used the largest value, not the largest |value|: negative weights count)"
                    if w[r].max() < w[r].abs().max() else
                    " (a row's scale is the largest |w| of that row / 127, from the weights as given)")
            raise AssertionError(f"scale of row {r}: expected {ref.scale[r].item():.6g}, got {scale[r].item():.6g}{hint}")
        if int(q.min()) < -127:
            raise AssertionError(f"q contains {int(q.min())}; symmetric INT8 uses -127..127 so the grid is symmetric")
        wrong = q != ref.q
        if wrong.any():
            r, c = (int(i) for i in wrong.nonzero()[0])
            x = (w[r, c] / ref.scale[r, 0]).item()
            hint = (" (round to nearest, not toward zero: int() / .to(int8) truncate)" if int(q[r, c]) == math.trunc(x)
                    else " (each q is w / its row's scale rounded to the nearest integer, ties to even as torch.round, "
                         "then clamped to -127..127)")
            raise AssertionError(f"q[{r}, {c}] = {int(q[r, c])} but w/scale = {x:.4f} should round to {int(ref.q[r, c])}{hint}")
        w_hat = dequantize_fn(ref.q.clone(), ref.scale.clone())
        if not isinstance(w_hat, torch.Tensor) or w_hat.shape != w.shape:
            raise AssertionError(f"{DEQUANT_INT8}: dequantize_fn should return a tensor of shape {tuple(w.shape)}, got "
                                 f"{tuple(w_hat.shape) if isinstance(w_hat, torch.Tensor) else type(w_hat).__name__}")
        if w_hat.dtype != torch.float32:
            raise AssertionError(f"{DEQUANT_INT8}: dequantize_fn returned dtype {w_hat.dtype}; return float32 values")
        expected = ref.dequantize()
        wrong = ~torch.isclose(w_hat, expected, rtol=1e-6, atol=1e-12)
        if wrong.any():
            r, c = (int(i) for i in wrong.nonzero()[0])
            raise AssertionError(f"{DEQUANT_INT8}: dequantize: element [{r}, {c}] is {w_hat[r, c].item():.6g}, expected "
                                 f"{expected[r, c].item():.6g} (q = {int(ref.q[r, c])}, scale = {ref.scale[r, 0].item():.6g})")
        err = (w - w_hat).abs()
        if (err > ref.scale / 2 * (1 + 1e-5) + 1e-12).any():  # holds when the above passed; kept as the stated bound
            raise AssertionError("round trip error exceeds scale/2 somewhere")
    _int8_from_bf16(quantize_fn, gen)
    print("check_int8_per_channel passed: scales, int8 values and the round trip match on 3 random weights; "
          "every |w - w_hat| <= scale/2; bfloat16 weights (a GPU model's) give float32 scales")
    from lab_utils.course import learner_parts

    learner_parts.submit("quant.quantize_per_channel_int8", quantize_fn)


def _int8_from_bf16(quantize_fn: Callable, gen: torch.Generator) -> None:
    """bfloat16 weights, as a model on a GPU holds them: the scales still come out float32 and equal to the engine's
    (a row's max|w| / 127 computed in bfloat16 keeps 8 bits of mantissa: each scale off by up to 2^-9)."""
    from lab_utils.quant.linear import quantize_per_channel_int8

    w = _weights(gen).bfloat16()
    q_ref, s_ref = quantize_per_channel_int8(w)
    q, scale = quantize_fn(w.clone())
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise AssertionError(f"for bfloat16 weights (a model on a GPU holds them so) your scale is {got}; the "
                             f"contract says float32 whatever the weight's dtype\n   hint: max|row| / 127 computed in "
                             f"the weight's dtype is rounded to bfloat16 (8 bits of mantissa); compute the scale in "
                             f"float32")
    if not torch.equal(scale, s_ref) or not torch.equal(q.to(torch.int8), q_ref):
        r = int((~torch.isclose(scale.reshape(-1), s_ref.reshape(-1), rtol=0, atol=0)).nonzero()[0, 0]) \
            if not torch.equal(scale, s_ref) else int((q.to(torch.int8) != q_ref).nonzero()[0, 0])
        raise AssertionError(f"for bfloat16 weights, row {r}: scale {scale[r, 0].item():.8g} (expected "
                             f"{s_ref[r, 0].item():.8g}), q differs from w / scale rounded\n   hint: divide in float32: "
                             f"w / scale with w in bfloat16 rounds the quotient to bfloat16 before it is rounded to an "
                             f"integer")


# --- exercise 3: per-group symmetric INT4 and back ---------------------------------------------------------------
def _int4_case(gen: torch.Generator) -> tuple[torch.Tensor, int]:
    g = [8, 16, 32, 64][int(torch.randint(0, 4, (), generator=gen))]
    out_f, n_groups = int(torch.randint(3, 12, (), generator=gen)), int(torch.randint(1, 5, (), generator=gen))
    w = torch.randn(out_f, n_groups * g, generator=gen) * torch.exp(torch.randn(out_f, n_groups * g // g, generator=gen)
                                                                    ).repeat_interleave(g, dim=1) * 0.05
    w[0, :g] = 0.0  # an all-zero group: its scale must stay positive
    w[1, -1] = -(w[1].abs().max() + 0.01)  # a group whose largest |w| is negative
    return w, g


@checks_part("quant.quantize_per_group_int4", "quant.dequantize_int4")
def check_int4_per_group(quantize_fn: Callable, dequantize_fn: Callable, seed: int | None = None,
                         cases: int = 12) -> None:
    """`quantize_fn(w [out, in], group_size) -> (q int8 [out, in] in -7..7, scale float16 [out, in / group_size])`:
    one scale per `group_size` consecutive inputs of a row, max|group| / 7 rounded *up* to an fp16 value, q computed
    with that stored scale; `dequantize_fn(q, scale, group_size) -> w_hat` in scale's dtype."""
    from lab_utils.quant.linear import dequantize_int4, quantize_per_group_int4

    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    for c in range(cases):
        w, gs = _int4_case(gen)
        n_groups = w.shape[1] // gs
        q_ref, s_ref = quantize_per_group_int4(w, gs)
        out = quantize_fn(w.clone(), gs)
        where = f"case {c}: w {tuple(w.shape)}, group_size={gs}"
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
            raise AssertionError(f"{where}: quantize_fn should return a tuple of two tensors (q, scale)")
        q, scale = out
        if q.shape != w.shape or q.dtype != torch.int8:
            raise AssertionError(f"{where}: q is {q.dtype} {tuple(q.shape)}; expected torch.int8 {tuple(w.shape)} "
                                 f"(one integer per weight; the engine packs two per byte)")
        if tuple(scale.shape) != (w.shape[0], n_groups):
            what = ("one scale per row (per-channel)" if scale.numel() == w.shape[0] else
                    f"{scale.numel()} scales" if scale.numel() != w.shape[0] * n_groups else "another shape")
            raise AssertionError(f"{where}: scale has shape {tuple(scale.shape)} ({what}); per-group means one scale "
                                 f"per {gs} consecutive inputs of each row: shape [out, in // group_size] = "
                                 f"{(w.shape[0], n_groups)}")
        if scale.dtype != torch.float16:
            raise AssertionError(f"{where}: scale is {scale.dtype}; the layer stores its scales in fp16 (2 bytes per "
                                 f"group): return them as torch.float16, rounded up from max|group| / 7")
        sf, rf = scale.float(), s_ref.float()
        if not torch.isfinite(sf).all() or (sf <= 0).any():
            r, g = (int(i) for i in (~torch.isfinite(sf) | (sf <= 0)).nonzero()[0])
            raise AssertionError(f"{where}: scale[{r}, {g}] = {sf[r, g].item()}; an all-zero group still needs a "
                                 f"positive, finite scale (any will do: 1.0)")
        bad = sf != rf
        if bad.any():
            r, g = (int(i) for i in bad.nonzero()[0])
            amax = float(w[r, g * gs:(g + 1) * gs].abs().max())
            exact = amax / 7
            if abs(sf[r, g].item() - torch.tensor(exact).half().item()) == 0 and rf[r, g] > sf[r, g]:
                hint = ("you rounded max|group| / 7 to the *nearest* fp16 value, here below it: the group's largest "
                        "weight would need 7.00x; round the scale up (torch.nextafter towards inf when .half() "
                        "came out smaller)")
            elif abs(sf[r, g].item() * 8 / 7 - rf[r, g].item()) / rf[r, g].item() < 2e-3 or \
                    abs(sf[r, g].item() * 15 / 7 - rf[r, g].item()) / rf[r, g].item() < 2e-3:
                hint = "symmetric INT4 uses -7..7: divide max|group| by 7 (not 8 or 15)"
            elif abs(sf[r, g].item() - float(w[r].abs().max()) / 7) / rf[r, g].item() < 2e-3:
                hint = "that is the row's largest |w|: each group of group_size inputs gets its own scale"
            else:
                hint = ("a group is group_size consecutive inputs of one row: w.reshape(out, in // group_size, "
                        "group_size), largest |value| over the last dim")
            raise AssertionError(f"{where}: scale[{r}, {g}] = {sf[r, g].item():.8g}, expected {rf[r, g].item():.8g} "
                                 f"(max|group| / 7 = {exact:.8g})\n   hint: {hint}")
        if int(q.min()) < -7 or int(q.max()) > 7:
            raise AssertionError(f"{where}: q holds {int(q.min())}..{int(q.max())}; symmetric INT4 uses -7..7")
        wrong = q != q_ref
        if wrong.any():
            r, col = (int(i) for i in wrong.nonzero()[0])
            x = (w[r, col] / rf[r, col // gs]).item()
            x32 = (w[r, col] / (w[r, col // gs * gs:(col // gs + 1) * gs].abs().max() / 7)).item()
            hint = ("round to nearest, not toward zero" if int(q[r, col]) == math.trunc(x) else
                    "compute q with the scale you store (the fp16 one): q = round(w / stored scale), so that "
                    "q x stored scale is what the layer will compute" if int(q[r, col]) == round(x32) else
                    f"column {col} belongs to group {col // gs} (col // group_size): q = round(w / that group's "
                    f"stored scale), clamped to -7..7")
            raise AssertionError(f"{where}: q[{r}, {col}] = {int(q[r, col])}, but w / stored scale = {x:.4f} rounds "
                                 f"to {int(q_ref[r, col])}" + (f"\n   hint: {hint}" if hint else ""))
        for dtype in (torch.float32, torch.bfloat16):
            s_in = s_ref.to(dtype)
            w_hat = dequantize_fn(q_ref.clone(), s_in.clone(), gs)
            expected = dequantize_int4(q_ref, s_in, gs)
            if not isinstance(w_hat, torch.Tensor) or w_hat.shape != w.shape:
                raise AssertionError(f"{where}: dequantize_fn should return a tensor of shape {tuple(w.shape)}, got "
                                     f"{tuple(w_hat.shape) if isinstance(w_hat, torch.Tensor) else type(w_hat).__name__}")
            if w_hat.dtype != dtype:
                raise AssertionError(f"{where}: dequantize_fn(q, scale in {dtype}, {gs}) returned {w_hat.dtype}; return "
                                     f"the scale's dtype (the layer's compute dtype: the forward multiplies by it)")
            diff = w_hat.float() != expected.float()
            if diff.any():
                r, col = (int(i) for i in diff.nonzero()[0])
                hint = ("input column j belongs to group j // group_size: reshape q to [out, in // group_size, "
                        "group_size] and multiply by scale.unsqueeze(-1)")
                raise AssertionError(f"{where}, scale in {dtype}: w_hat[{r}, {col}] = {w_hat[r, col].item():.6g}, "
                                     f"expected {expected[r, col].item():.6g} (q = {int(q_ref[r, col])}, scale of its "
                                     f"group = {s_in[r, col // gs].item():.6g})\n   hint: {hint}")
    print(f"check_int4_per_group passed: {cases} random weights (group sizes 8-64, an all-zero group), scales "
          "bit-exact in fp16, integers and the round trip equal to the engine's")
    from lab_utils.course import learner_parts

    learner_parts.submit("quant.quantize_per_group_int4", quantize_fn)
    learner_parts.submit("quant.dequantize_int4", dequantize_fn)


# --- exercise 4: the FP8 KV cache's write and read ----------------------------------------------------------------
def _kv_values(gen: torch.Generator) -> torch.Tensor:
    x = torch.exp2(torch.empty(3, 4, 16).uniform_(-12, 9.5, generator=gen))  # every binade, subnormals, overflow
    x = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -x, x)
    mids = E4M3.all_values().float()
    mids = mids[mids < E4M3.max_value]
    i = torch.randint(0, mids.numel() - 1, (16,), generator=gen)
    x[0, 0] = (mids[i] + mids[i + 1]) / 2  # exact ties
    x[0, 1, :4] = torch.tensor([0.0, -0.0, 1000.0, -1e6])
    return x


@checks_part("kv_cache.fp8_encode", "kv_cache.fp8_decode")
def check_fp8_kv(encode_fn: Callable, decode_fn: Callable, seed: int | None = None) -> None:
    """`encode_fn(x) -> uint8` (FP8 E4M3 bit patterns of x, saturating at ±448), `decode_fn(bits, dtype) -> values`
    in `dtype`: the KV cache's write and read when `kv_cache_dtype="fp8"`."""
    from lab_utils.engine.kv.kv_cache import fp8_decode, fp8_encode

    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    for trial in range(3):
        x = _kv_values(gen)
        want = fp8_encode(x)
        got = encode_fn(x.clone())
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            raise AssertionError(f"encode should return a tensor of shape {tuple(x.shape)} (one byte per value), got "
                                 f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
        if got.dtype != torch.uint8:
            hint = (" (float8_e4m3fn values: reinterpret their bits with .view(torch.uint8); the cache stores bytes)"
                    if got.dtype == torch.float8_e4m3fn else "")
            raise AssertionError(f"encode returned {got.dtype}; return the bit patterns as torch.uint8{hint}")
        bad = got != want
        if bad.any():
            idx = tuple(int(i) for i in bad.nonzero()[0])
            v = float(x[idx])
            hint = ""
            as_ints = want.view(torch.float8_e4m3fn).to(torch.uint8)  # the values converted, not their bits
            if torch.equal(got, as_ints):  # every byte is a converted value, not a bit pattern
                hint = ("you converted the values to integers; the byte must hold the value's bit pattern: "
                        ".view(torch.uint8) reinterprets, .to(torch.uint8) converts")
            elif abs(v) > 448:
                hint = "beyond ±448: saturate (clamp) first; E4M3 has no infinity"
            elif int(got[idx]) == int(want[idx]) ^ 0x80:
                hint = "bit 7 is the sign: 1 for a negative value (-0.0 included)"
            elif abs(v) < 2.0 ** -6:
                hint = ("below 2^-6 E4M3 is subnormal (exponent field 0): the value is mantissa x 2^-9, rounded to the "
                        "nearest multiple of 2^-9")
            elif abs(int(got[idx]) - int(want[idx])) == 1:
                hint = ("one step off: round to the nearest E4M3 value, and a value exactly halfway between two takes "
                        "the one with the even mantissa (round half to even)")
            else:
                hint = "the byte is sign (bit 7), exponent (bits 6-3, bias 7), mantissa (bits 2-0)"
            raise AssertionError(f"encode({v!r}) gave byte 0x{int(got[idx]):02X}, expected {_describe(int(want[idx]))}"
                                 + (f"\n   hint: {hint}" if hint else ""))
    bits = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8).reshape(2, 127)
    for dtype in (torch.float32, torch.bfloat16):
        want = fp8_decode(bits, dtype)
        got = decode_fn(bits.clone(), dtype)
        if not isinstance(got, torch.Tensor) or got.shape != bits.shape:
            raise AssertionError(f"decode should return a tensor of shape {tuple(bits.shape)}, got "
                                 f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
        if got.dtype != dtype:
            raise AssertionError(f"decode(bits, {dtype}) returned {got.dtype}; return values in the dtype asked for "
                                 f"(the model's compute dtype)")
        bad = ~((got == want) | (torch.isnan(got) & torch.isnan(want)))
        if bad.any():
            r, c = (int(i) for i in bad.nonzero()[0])
            b = int(bits[r, c])
            s_, e_, m_ = E4M3.fields(b)
            if torch.equal(got.float(), bits.float()):
                hint = ("those are the byte values 0..255: decode the bit pattern (sign, 4 exponent bits, 3 mantissa "
                        "bits), e.g. bits.view(torch.float8_e4m3fn).to(dtype), or by hand")
            elif s_ and float(got[r, c]) == -float(want[r, c]):
                hint = "bit 7 is the sign"
            elif e_ == 0:
                hint = "exponent field 0 is subnormal: no implicit leading 1, value = mantissa x 2^-9"
            else:
                hint = "normal values are (1 + mantissa / 8) x 2^(exponent - 7)"
            raise AssertionError(f"decode(0x{b:02X}) = {float(got[r, c])!r}, expected {_describe(b)}\n   hint: {hint}")
    print("check_fp8_kv passed: 3 random K/V tensors (ties, subnormals, overflow, signs) encode to the same bytes; "
          "all 254 finite E4M3 patterns decode exactly (fp32 and bf16)")
    from lab_utils.course import learner_parts

    learner_parts.submit("kv_cache.fp8_encode", encode_fn)
    learner_parts.submit("kv_cache.fp8_decode", decode_fn)


QUANT_PARTS = ("quant.quantize_per_channel_int8", "quant.quantize_per_group_int4", "quant.dequantize_int4",
               "kv_cache.fp8_encode", "kv_cache.fp8_decode")


def check_quant_in_engine(parts, num_requests: int = 8, seed: int = 0) -> dict:
    """The real engine on the tiny random model, with the engine's own quantizers and FP8 codec and with `parts`:
    INT8 weights, INT4 weights (group 64), and an FP8 KV cache, each on the same greedy workload. Same tokens,
    every block back. Returns a summary. The model's linear weights are scaled up 10x: otherwise a 2-layer random
    model's next token is decided by its (tied) embedding alone, and even INT4 weights would not change a token."""
    import random

    from lab_utils.engine.config import EngineConfig
    from lab_utils.engine.engine import LLMEngine
    from lab_utils.course.parts import EngineParts, LearnerPartError
    from lab_utils.engine.sampling_params import SamplingParams
    from lab_utils.models.loader import build_random
    from lab_utils.models.registry import REGISTRY

    rng = random.Random(seed)
    model = build_random(REGISTRY["tiny-random"].config, seed=0).eval()
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and "lm_head" not in name:
                m.weight.mul_(10.0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 24))] for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=rng.randint(6, 12), ignore_eos=True) for _ in range(num_requests)]
    setups = {"INT8 weights": dict(quantization="int8"), "INT4 weights (group 64)": dict(quantization="int4"),
              "FP8 KV cache": dict(kv_cache_dtype="fp8")}
    summary = {}
    for label, cfg in setups.items():
        tokens = {}
        for who, p in (("reference", EngineParts()), ("yours", parts)):
            try:
                engine = LLMEngine((model, None), EngineConfig(num_gpu_blocks=48, block_size=4, max_num_seqs=4,
                                                               max_num_batched_tokens=32, **cfg), device="cpu", parts=p)
                outs = engine.generate(prompts, params)
            except LearnerPartError as err:
                raise AssertionError(f"the engine with {label} and your parts stopped: {err}") from None
            except ValueError as err:
                raise AssertionError(f"the engine with {label} could not use your parts: {err}") from None
            engine.block_manager.check_all_free()
            tokens[who] = [o.token_ids for o in outs]
        bad = [i for i, (a, b) in enumerate(zip(tokens["reference"], tokens["yours"])) if a != b]
        assert not bad, (f"with {label} the engine running your parts generated other tokens than with its own for "
                         f"{len(bad)} of {num_requests} requests (first: request {bad[0]}: {tokens['yours'][bad[0]][:6]}"
                         f"... vs {tokens['reference'][bad[0]][:6]}...)")
        summary[label] = sum(len(t) for t in tokens["yours"])
    used = [n for n in QUANT_PARTS if parts.is_learners(n)]
    print(f"the real engine (tiny model) ran your parts ({', '.join(used) or 'none: reference only'}): "
          + ", ".join(f"{k}: {v} tokens" for k, v in summary.items()) + ", each equal to the engine's own, 0 blocks leaked")
    return {"tokens": summary, "yours": used}


# --- the lab's closing claims --------------------------------------------------------------------------------


def claims(r: dict) -> list[Claim]:
    """Lab 05's claims from the run's measurements `r` (built in the notebook's claims cell).

    `ppl`: perplexity per configuration label; `kv_ppl`: perplexity per KV format; `kv_tokens`: tokens per KV format
    in the budget (arithmetic, so its claim is labelled a check of the model); `model`: the lab's MODEL (with random
    weights the perplexity orderings are NOT JUDGED: they say how a trained model degrades)."""
    from lab_utils.checks.claims import need, trained_only

    need(r, "ppl", "fp32_ppl", "qat_label", "qat_losses", "qat_steps", "stored_int8_ppl", "saved8", "saved4",
         "int8_share", "int4_share", "kv_ppl", "kv_tokens", "kv_budget_gib", "engine_parts")
    p, f32, q = r["ppl"], r["fp32_ppl"], r["qat_label"]
    qat, ptq, losses = p["QAT " + q], p[q], r["qat_losses"]
    int8_gap = p["int8 per-channel"] / f32 - 1
    kv, kt = r["kv_ppl"], r["kv_tokens"]

    def trained(claim: Claim) -> Claim:
        return trained_only(claim, r.get("model"))

    out = [
        trained((f"INT8 per-channel weights: perplexity within 5% of FP32 (measured {int8_gap:+.2%})",
                 int8_gap < 0.05)),
        trained((f"per-channel beats per-tensor INT8: {p['int8 per-channel']:.2f} vs {p['int8 per-tensor']:.2f}",
                 p["int8 per-tensor"] > p["int8 per-channel"])),
        trained((f"finer INT4 groups help: per-channel {p['int4 per-channel']:.1f} > g64 {p['int4 g64']:.1f} > g32 "
                 f"{p['int4 g32']:.1f}", p["int4 g32"] < p["int4 g64"] < p["int4 per-channel"])),
        trained((f"static per-tensor INT8 activations cost more than INT8 weights alone: "
                 f"{p['int8 per-channel A:int8']:.1f} vs {p['int8 per-channel']:.2f}",
                 p["int8 per-channel A:int8"] > p["int8 per-channel"])),
        trained((f"QAT beats PTQ at {q} after {r['qat_steps']} steps: {qat:.2f} vs {ptq:.2f} (FP32 {f32:.2f})",
                 qat < ptq)),
        # judged on any weights: distillation towards any teacher lowers its loss
        (f"QAT's distillation loss falls ({sum(losses[:2]) / 2:.3f} -> {sum(losses[-2:]) / 2:.3f}, first vs last 2 "
         "steps)", len(losses) >= 2 and sum(losses[-2:]) < sum(losses[:2])),
    ]
    if "GPTQ int4 g64" in p:
        out.append(trained((f"GPTQ beats round-to-nearest at INT4 g64: {p['GPTQ int4 g64']:.2f} vs "
                            f"{p['int4 g64']:.2f}", p["GPTQ int4 g64"] < p["int4 g64"])))
    out += [
        (f"the engine ran your parts ({', '.join(sorted(r['engine_parts'])) or 'none'}): its INT8 and INT4 "
         "linears quantized by your functions, INT4 weights dequantized by yours in every forward, its FP8 KV cache "
         "written and read by your codec",
         bool(r["engine_parts"]) and all(r["engine_parts"].values())),
        (f"the stored INT8 model (Int8Linear) matches its simulation: perplexity {r['stored_int8_ppl']:.3f} vs "
         f"{p['int8 per-channel']:.3f} (within 0.5%)", abs(r["stored_int8_ppl"] / p["int8 per-channel"] - 1) < 0.005),
        (f"stored INT8 saves {r['saved8']:.1%} of the linear layers' FP32 bytes (> 74%), INT4 g64 {r['saved4']:.1%} "
         f"(> 85%); whole model {r['int8_share']:.0%} / {r['int4_share']:.0%} of FP32 (embeddings stay FP32)",
         r["saved8"] > 0.74 and r["saved4"] > 0.85),
        trained((f"FP8 E4M3 KV cache: perplexity within 5% of FP32 (measured {kv['fp8_e4m3'] / f32 - 1:+.2%})",
                 kv["fp8_e4m3"] / f32 - 1 < 0.05)),
        trained((f"per-vector INT8 KV is at least as accurate as FP8 E4M3: {kv['int8']:.3f} vs {kv['fp8_e4m3']:.3f}",
                 kv["int8"] <= kv["fp8_e4m3"] * 1.01)),
        (f"check of the model (byte arithmetic, not a measurement): in {r['kv_budget_gib']} GiB an FP8 KV cache holds "
         f"{kt['fp8_e4m3'] / kt['fp32']:.2f}x the tokens of FP32 and {kt['fp8_e4m3'] / kt['bf16']:.2f}x those of "
         "BF16, the precision a GPU serves in",
         abs(kt["fp8_e4m3"] / kt["fp32"] - 4) < 0.01 and abs(kt["fp8_e4m3"] / kt["bf16"] - 2) < 0.01),
    ]
    return out


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 05's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
