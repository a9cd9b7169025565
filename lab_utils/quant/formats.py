"""Number formats at the bit level, and integer quantization with scales and zero-points.

Floating point: a value is `(-1)^s × 1.m × 2^(e - bias)` (normal) or `(-1)^s × 0.m × 2^(1 - bias)` (subnormal,
when the exponent field is 0). The formats differ only in how many exponent (range) and mantissa (precision)
bits they spend, and in what the all-ones exponent means:

- IEEE-style (FP32, FP16, BF16, FP8 E5M2): exponent all ones is ±inf (mantissa 0) or NaN.
- FP8 E4M3 "fn" (finite, OCP spec, `torch.float8_e4m3fn`): no inf; only S.1111.111 is NaN, so the top binade is
  usable and the largest value is 1.75 × 2^8 = 448.

Encoding rounds to nearest, ties to even (the IEEE default). Overflow (the rounded value is above the largest
finite value) has two behaviours, chosen by `saturate`:

- `saturate=False`: IEEE formats give ±inf, E4M3 gives NaN with the sign kept (it has no inf), as a plain cast does.
- `saturate=True`: clamp to ±max (and ±inf to ±max). This is what FP8 quantization code does, and what
  `torch`'s cast to `float8_e4m3fn` does in torch 2.13 (2.11's gives NaN: clamp before casting, as the engine's
  `fp8_encode` does). Defaults: saturate for E4M3, not for the others.

Encoding starts from a Python float (a double) and rounds once. Casting a double through float32 first (what
`torch` does for float64 → float8) can round twice and land one step away: 1 + 2^-4 + 2^-30 is just above a tie
in E4M3, so it should round up to 1.125, but via float32 the 2^-30 is lost and the tie goes to even (1.0).

Integers: `q = clamp(round(x / scale) + zero_point, qmin, qmax)`, `x̂ = scale × (q - zero_point)`. Symmetric
quantization has zero_point 0 and the restricted range ±(2^(b-1) - 1) (so -128 is unused and the grid is symmetric);
asymmetric spends the full unsigned range [0, 2^b - 1] on [min, max] (always containing 0, so 0 is exact).
The scale is shared by the whole tensor, by each output channel (row of a weight), or by each group of
`group_size` consecutive inputs in a row. Inside the clipping range, round-to-nearest errs by at most scale / 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


# ----------------------------------------------------------------------------------------------------------------
# Floating-point formats
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FloatFormat:
    name: str
    exponent_bits: int
    mantissa_bits: int
    ieee_specials: bool  # True: exponent all ones = inf/NaN. False ("fn"): only all-ones exponent+mantissa is NaN
    torch_dtype_name: str | None = None
    saturate_default: bool = False

    # -- layout --------------------------------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def exp_all_ones(self) -> int:
        return 2**self.exponent_bits - 1

    @property
    def man_all_ones(self) -> int:
        return 2**self.mantissa_bits - 1

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite binade."""
        top = self.exp_all_ones - 1 if self.ieee_specials else self.exp_all_ones
        return top - self.bias

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal binade (subnormals share it)."""
        return 1 - self.bias

    @property
    def max_value(self) -> float:
        top_mantissa = self.man_all_ones if self.ieee_specials else self.man_all_ones - 1
        return (1 + top_mantissa / 2**self.mantissa_bits) * 2.0**self.emax

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mantissa_bits)

    @property
    def epsilon(self) -> float:
        """Gap between 1 and the next value: relative precision is about epsilon / 2."""
        return 2.0**-self.mantissa_bits

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.torch_dtype_name) if self.torch_dtype_name else None

    @property
    def max_bits(self) -> int:
        return self.encode(self.max_value)

    @property
    def nan_bits(self) -> int:
        """The canonical (positive, quiet) NaN this module produces."""
        if self.ieee_specials:
            return (self.exp_all_ones << self.mantissa_bits) | (1 << (self.mantissa_bits - 1))
        return (self.exp_all_ones << self.mantissa_bits) | self.man_all_ones

    def inf_bits(self, negative: bool = False) -> int:
        if not self.ieee_specials:
            raise ValueError(f"{self.name} has no infinity")
        return (int(negative) << (self.bits - 1)) | (self.exp_all_ones << self.mantissa_bits)

    # -- fields --------------------------------------------------------------------------------------------------
    def fields(self, bits: int) -> tuple[int, int, int]:
        """bits -> (sign, exponent field, mantissa field)."""
        self._check_bits(bits)
        m = self.mantissa_bits
        return (bits >> (self.bits - 1)) & 1, (bits >> m) & self.exp_all_ones, bits & self.man_all_ones

    def from_fields(self, sign: int, exponent: int, mantissa: int) -> int:
        if not (0 <= exponent <= self.exp_all_ones and 0 <= mantissa <= self.man_all_ones and sign in (0, 1)):
            raise ValueError(
                f"{self.name}: fields out of range (sign {sign} in 0..1, exponent {exponent} in 0..{self.exp_all_ones},"
                f" mantissa {mantissa} in 0..{self.man_all_ones})"
            )
        return (sign << (self.bits - 1)) | (exponent << self.mantissa_bits) | mantissa

    def _check_bits(self, bits: int) -> None:
        if not 0 <= int(bits) < 2**self.bits:
            raise ValueError(f"{self.name} bit pattern {bits} is outside 0..{2 ** self.bits - 1}")

    def is_nan_bits(self, bits: int) -> bool:
        s, e, m = self.fields(bits)
        if self.ieee_specials:
            return e == self.exp_all_ones and m != 0
        return e == self.exp_all_ones and m == self.man_all_ones

    # -- scalar decode / encode ----------------------------------------------------------------------------------
    def decode(self, bits: int) -> float:
        """Bit pattern (an int in 0 .. 2^bits - 1) -> its value as a Python float."""
        s, e, m = self.fields(int(bits))
        sign = -1.0 if s else 1.0
        if e == self.exp_all_ones and self.ieee_specials:
            return sign * math.inf if m == 0 else math.nan
        if e == self.exp_all_ones and m == self.man_all_ones:  # E4M3fn: the only NaN
            return math.nan
        if e == 0:  # subnormal: no implicit leading 1, exponent of the smallest normal binade
            return sign * math.ldexp(m, self.emin - self.mantissa_bits)
        return sign * math.ldexp(2**self.mantissa_bits + m, e - self.bias - self.mantissa_bits)

    def encode(self, x: float, saturate: bool | None = None) -> int:
        """Nearest representable value (ties to even) -> bit pattern. See the module docstring for overflow."""
        saturate = self.saturate_default if saturate is None else saturate
        x = float(x)
        if math.isnan(x):
            return self.nan_bits
        sign = 1 if math.copysign(1.0, x) < 0 else 0
        a = abs(x)
        if math.isinf(a):
            return self._overflow(sign, saturate)
        if a == 0.0:
            return sign << (self.bits - 1)
        # exponent of a's binade, never below the smallest normal one (subnormals use the same quantum)
        e = max(math.frexp(a)[1] - 1, self.emin)
        quantum = math.ldexp(1.0, e - self.mantissa_bits)  # spacing of representable values in this binade
        v = round(a / quantum) * quantum  # a / quantum is exact (power of two); round() ties to even
        if v > self.max_value:
            return self._overflow(sign, saturate)
        return (sign << (self.bits - 1)) | self._magnitude_bits(v)

    def _magnitude_bits(self, v: float) -> int:
        """Bits of a representable non-negative value (exact, no rounding left to do)."""
        if v < self.min_normal:
            return int(v / self.min_subnormal)  # exponent field 0
        e = math.frexp(v)[1] - 1
        mant = int(math.ldexp(v, self.mantissa_bits - e)) - 2**self.mantissa_bits
        return ((e + self.bias) << self.mantissa_bits) | mant

    def _overflow(self, sign: int, saturate: bool) -> int:
        if saturate:
            return (sign << (self.bits - 1)) | self._magnitude_bits(self.max_value)
        if self.ieee_specials:
            return self.inf_bits(bool(sign))
        return (sign << (self.bits - 1)) | self.nan_bits  # S.1111.111: a cast keeps the sign (torch 2.11)

    def round(self, x: float, saturate: bool | None = None) -> float:
        """The value `x` becomes when stored in this format."""
        return self.decode(self.encode(x, saturate))

    def explain(self, bits: int) -> str:
        """'0 | 0111 | 010  ->  +1.010b × 2^0 = 1.25': fields, the formula, and the value."""
        s, e, m = self.fields(bits)
        mbits = format(m, f"0{self.mantissa_bits}b")
        head = f"{s} | {format(e, f'0{self.exponent_bits}b')} | {mbits}"
        v = self.decode(bits)
        if math.isnan(v) or math.isinf(v):
            return f"{head}  ->  {v}"
        sign = "-" if s else "+"
        if e == 0:
            return f"{head}  ->  {sign}0.{mbits}b × 2^{self.emin} = {v!r} (subnormal)"
        return f"{head}  ->  {sign}1.{mbits}b × 2^{e - self.bias} = {v!r}"

    # -- tensor versions (vectorised, same rules) ----------------------------------------------------------------
    def round_tensor(self, x: torch.Tensor, saturate: bool | None = None) -> torch.Tensor:
        """Round every element to this format (ties to even).

        Works in float64, or in float32 for float32 inputs and formats of <= 16 bits (faster; still exact, since
        dividing by a power-of-two quantum is exact and the quotient stays far from float32's limits)."""
        saturate = self.saturate_default if saturate is None else saturate
        x = x.float() if (x.dtype == torch.float32 and self.bits <= 16) else x.double()
        a = x.abs()
        _, exp = torch.frexp(a)
        e = torch.clamp(exp.to(torch.int64) - 1, min=self.emin)
        quantum = torch.ldexp(torch.ones_like(a), (e - self.mantissa_bits).to(a.dtype))
        v = torch.round(a / quantum) * quantum  # torch.round: half to even
        over = v > self.max_value  # includes inf
        if saturate:
            v = torch.where(over, torch.full_like(v, self.max_value), v)
        else:
            v = torch.where(over, torch.full_like(v, math.inf if self.ieee_specials else math.nan), v)
        v = torch.where(torch.isnan(x), torch.full_like(v, math.nan), v)
        return torch.copysign(v, x)

    def encode_tensor(self, x: torch.Tensor, saturate: bool | None = None) -> torch.Tensor:
        """Elementwise `encode` -> int64 bit patterns."""
        v = self.round_tensor(x, saturate).double()
        sign = torch.signbit(v).to(torch.int64)
        a = v.abs()
        _, exp = torch.frexp(a)
        e = exp.to(torch.int64) - 1
        normal = a >= self.min_normal
        sub_m = torch.nan_to_num(a / self.min_subnormal, nan=0.0, posinf=0.0).to(torch.int64)
        scaled = torch.ldexp(a, (self.mantissa_bits - e).double())
        norm_m = torch.nan_to_num(scaled, nan=0.0, posinf=0.0).to(torch.int64) - 2**self.mantissa_bits
        mag = torch.where(normal, ((e + self.bias) << self.mantissa_bits) | norm_m, sub_m)
        if self.ieee_specials:
            mag = torch.where(torch.isinf(a), torch.full_like(mag, self.exp_all_ones << self.mantissa_bits), mag)
        mag = torch.where(torch.isnan(a), torch.full_like(mag, self.nan_bits), mag)
        sign = torch.where(torch.isnan(x), torch.zeros_like(sign), sign)  # a NaN input: the canonical NaN
        return (sign << (self.bits - 1)) | mag

    def decode_tensor(self, bits: torch.Tensor) -> torch.Tensor:
        """Elementwise `decode` of integer bit patterns -> float64 values."""
        b = bits.to(torch.int64) & (2**self.bits - 1)
        s = (b >> (self.bits - 1)) & 1
        e = (b >> self.mantissa_bits) & self.exp_all_ones
        m = (b & self.man_all_ones).double()
        normal = torch.ldexp(1 + m / 2**self.mantissa_bits, (e - self.bias).double())
        sub = m * self.min_subnormal
        v = torch.where(e == 0, sub, normal)
        if self.ieee_specials:
            top = e == self.exp_all_ones
            v = torch.where(top & (m == 0), torch.full_like(v, math.inf), v)
            v = torch.where(top & (m != 0), torch.full_like(v, math.nan), v)
        else:
            v = torch.where((e == self.exp_all_ones) & (m == self.man_all_ones), torch.full_like(v, math.nan), v)
        return torch.where(s == 1, -v, v)

    def all_values(self) -> torch.Tensor:
        """Every finite non-negative value of an 8-bit or 16-bit format, sorted (for number lines)."""
        if self.bits > 16:
            raise ValueError(f"{self.name} has 2^{self.bits} patterns; enumerate only formats of <= 16 bits")
        v = self.decode_tensor(torch.arange(2 ** (self.bits - 1)))
        return torch.unique(v[torch.isfinite(v)])


FP32 = FloatFormat("fp32", 8, 23, True, "float32")
FP16 = FloatFormat("fp16", 5, 10, True, "float16")
BF16 = FloatFormat("bf16", 8, 7, True, "bfloat16")
FP8_E4M3 = FloatFormat("fp8_e4m3", 4, 3, False, "float8_e4m3fn", saturate_default=True)
FP8_E5M2 = FloatFormat("fp8_e5m2", 5, 2, True, "float8_e5m2")
FLOAT_FORMATS: dict[str, FloatFormat] = {f.name: f for f in (FP32, FP16, BF16, FP8_E4M3, FP8_E5M2)}


def float_format(name: str) -> FloatFormat:
    aliases = {"e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2", "fp8": "fp8_e4m3", "float16": "fp16", "half": "fp16",
               "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
    key = aliases.get(name, name)
    if key not in FLOAT_FORMATS:
        raise ValueError(f"unknown float format {name!r}; known: {', '.join(FLOAT_FORMATS)}")
    return FLOAT_FORMATS[key]


def format_table() -> list[dict]:
    """One row per format: layout, range and precision. Integer rows use the symmetric range ±(2^(b-1)-1)."""
    rows = []
    for f in FLOAT_FORMATS.values():
        rows.append(dict(
            format=f.name, bits=f.bits, exponent_bits=f.exponent_bits, mantissa_bits=f.mantissa_bits, bias=f.bias,
            max=f.max_value, min_normal=f.min_normal, min_subnormal=f.min_subnormal, epsilon=f.epsilon,
            inf="yes" if f.ieee_specials else "no", overflow="inf" if f.ieee_specials else ("saturate" if f.saturate_default else "NaN"),
        ))
    for b in (8, 4):
        qmin, qmax = qrange(b, True)
        rows.append(dict(format=f"int{b}", bits=b, exponent_bits=0, mantissa_bits=b - 1, bias=0, max=float(qmax),
                         min_normal=1.0, min_subnormal=1.0, epsilon=1.0, inf="no", overflow="clamp"))
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Integer quantization
# ----------------------------------------------------------------------------------------------------------------
GRANULARITIES = ("tensor", "channel", "group")


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """Integer range: symmetric ±(2^(b-1) - 1) (restricted, zero-point 0), asymmetric [0, 2^b - 1]."""
    if not 2 <= bits <= 16:
        raise ValueError(f"bits={bits} is outside 2..16")
    return (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)


@dataclass
class QuantizedTensor:
    """Integers plus what it takes to read them back: x̂ = scale × (q − zero_point).

    For group-wise quantization `q` keeps the original shape and `scale`/`zero_point` have shape
    [..., n_groups], one per `group_size` consecutive elements of the last dimension.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    bits: int
    symmetric: bool
    granularity: str
    group_size: int | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int(self, dtype)

    def nbytes(self, packed: bool = True, scale_bytes: int = 2) -> int:
        """Storage: bits per element (packed) + one scale (and zero-point byte) per tensor/channel/group."""
        n = self.q.numel()
        q_bytes = math.ceil(n * self.bits / 8) if packed else n * self.q.element_size()
        zp = self.zero_point.numel() if self.zero_point is not None else 0
        return q_bytes + self.scale.numel() * scale_bytes + zp


def _grouped(x: torch.Tensor, granularity: str, group_size: int | None, axis: int) -> tuple[torch.Tensor, tuple]:
    """View `x` so that each scale covers one slice, and return the dims to reduce over (keepdim)."""
    if granularity == "tensor":
        return x, tuple(range(x.dim()))
    if granularity == "channel":
        axis = axis % x.dim()
        return x, tuple(d for d in range(x.dim()) if d != axis)
    if granularity == "group":
        if not group_size or group_size < 1:
            raise ValueError(f"group-wise quantization needs group_size >= 1, got {group_size}")
        n = x.shape[-1]
        if n % group_size:
            divisors = [d for d in range(1, n + 1) if n % d == 0 and d <= 512]
            raise ValueError(
                f"group_size={group_size} does not divide the last dimension {n}; pick one of {divisors[-8:]}"
            )
        return x.reshape(*x.shape[:-1], n // group_size, group_size), (x.dim(),)
    raise ValueError(f"granularity={granularity!r}; allowed: {', '.join(GRANULARITIES)}")


def compute_qparams(
    x: torch.Tensor, bits: int = 8, symmetric: bool = True, granularity: str = "channel",
    group_size: int | None = None, axis: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero-point) from the min/max of each tensor / channel / group: no clipping, round to nearest.

    Shapes keep the reduced dims (size 1) so they broadcast against the grouped view of `x`.
    """
    qmin, qmax = qrange(bits, symmetric)
    xg, dims = _grouped(x.float(), granularity, group_size, axis)
    if symmetric:
        amax = xg.abs().amax(dim=dims, keepdim=True)
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        return scale, None
    lo = xg.amin(dim=dims, keepdim=True).clamp(max=0)  # the range always contains 0, so 0 is exact
    hi = xg.amax(dim=dims, keepdim=True).clamp(min=0)
    scale = torch.where(hi > lo, (hi - lo) / (qmax - qmin), torch.ones_like(hi))
    zero_point = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    return scale, zero_point


def quantize_int(
    x: torch.Tensor, bits: int = 8, symmetric: bool = True, granularity: str = "channel",
    group_size: int | None = None, axis: int = 0, scale: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Round-to-nearest integer quantization. Pass `scale` (and `zero_point`) to reuse calibrated ones."""
    qmin, qmax = qrange(bits, symmetric)
    if scale is None:
        scale, zero_point = compute_qparams(x, bits, symmetric, granularity, group_size, axis)
    xg, _ = _grouped(x.float(), granularity, group_size, axis)
    scale = scale.float() if scale.dim() == xg.dim() else _expand_like(scale.float(), xg, granularity, axis)
    zp = None
    if not symmetric:
        zp = zero_point.float() if zero_point.dim() == xg.dim() else _expand_like(zero_point.float(), xg, granularity, axis)
    q = torch.round(xg / scale) + (0 if zp is None else zp)
    q = torch.clamp(q, qmin, qmax)
    dtype = torch.int8 if (symmetric and bits <= 8) else (torch.uint8 if bits <= 8 else torch.int32)
    return QuantizedTensor(
        q=q.reshape(x.shape).to(dtype),
        scale=scale.squeeze(-1) if granularity == "group" else scale,
        zero_point=None if zp is None else (zp.squeeze(-1) if granularity == "group" else zp),
        bits=bits, symmetric=symmetric, granularity=granularity, group_size=group_size,
    )


def _expand_like(p: torch.Tensor, xg: torch.Tensor, granularity: str, axis: int) -> torch.Tensor:
    """Accept compact parameter shapes ([out] per channel, [out, n_groups] per group, scalar per tensor)."""
    if granularity == "tensor":
        return p.reshape([1] * xg.dim())
    if granularity == "group":
        return p.reshape(*xg.shape[:-1], 1)
    shape = [1] * xg.dim()
    shape[axis % xg.dim()] = -1
    return p.reshape(shape)


def dequantize_int(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q = qt.q.float()
    if qt.granularity == "group":
        q = q.reshape(*q.shape[:-1], -1, qt.group_size)
        scale, zp = qt.scale.unsqueeze(-1), None if qt.zero_point is None else qt.zero_point.unsqueeze(-1)
    else:
        scale, zp = qt.scale, qt.zero_point
    x = (q - (0 if zp is None else zp)) * scale
    return x.reshape(qt.q.shape).to(dtype)


def fake_quant_int(x: torch.Tensor, bits: int = 8, symmetric: bool = True, granularity: str = "channel",
                   group_size: int | None = None, axis: int = 0) -> torch.Tensor:
    """quantize -> dequantize in one call, same dtype as `x`: what the model sees after quantization."""
    return quantize_int(x, bits, symmetric, granularity, group_size, axis).dequantize(x.dtype)


def fake_quant_float(x: torch.Tensor, fmt: FloatFormat | str, granularity: str = "channel",
                     group_size: int | None = None, axis: int = 0, scaled: bool = True) -> torch.Tensor:
    """Store `x` in a float format. `scaled=True` first maps each tensor/channel/group's max to the format's max
    (how FP8 weights are stored in practice), so range is never wasted and nothing overflows."""
    fmt = float_format(fmt) if isinstance(fmt, str) else fmt
    if not scaled:
        return fmt.round_tensor(x, saturate=True).to(x.dtype)
    xg, dims = _grouped(x.float(), granularity, group_size, axis)
    amax = xg.abs().amax(dim=dims, keepdim=True)
    scale = torch.where(amax > 0, amax / fmt.max_value, torch.ones_like(amax))
    return (fmt.round_tensor(xg / scale, saturate=True) * scale).reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# INT4 packing: two 4-bit values per byte
# ----------------------------------------------------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[..., n] integers in -8..7 (signed) or 0..15 (unsigned), n even -> [..., n/2] uint8.

    Element 2i goes to the low nibble of byte i, element 2i+1 to the high nibble (two's complement nibbles).
    """
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even last dimension, got {q.shape[-1]}")
    qi = q.to(torch.int16)
    if qi.numel() and (int(qi.min()) < -8 or int(qi.max()) > 15):
        raise ValueError(f"values must lie in -8..7 (signed) or 0..15 (unsigned); got {int(qi.min())}..{int(qi.max())}")
    lo, hi = qi[..., 0::2] & 0xF, qi[..., 1::2] & 0xF
    return (lo | (hi << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """Inverse of `pack_int4`: [..., n/2] uint8 -> [..., n] int8 (sign-extended when `signed`)."""
    p = packed.to(torch.int16)
    lo, hi = p & 0xF, (p >> 4) & 0xF
    out = torch.stack((lo, hi), dim=-1).flatten(-2)
    if signed:
        out = (out ^ 8) - 8  # sign-extend a 4-bit two's complement value
    return out.to(torch.int8 if signed else torch.uint8)


# ----------------------------------------------------------------------------------------------------------------
# Error metrics
# ----------------------------------------------------------------------------------------------------------------
def mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float(((x.double() - x_hat.double()) ** 2).mean())


def max_abs_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float((x.double() - x_hat.double()).abs().max())


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio, 10·log10(Σx² / Σ(x − x̂)²). Each extra integer bit adds about 6 dB."""
    noise = float(((x.double() - x_hat.double()) ** 2).sum())
    signal = float((x.double() ** 2).sum())
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def error_report(x: torch.Tensor, x_hat: torch.Tensor) -> dict:
    return dict(mse=mse(x, x_hat), sqnr_db=sqnr_db(x, x_hat), max_abs_error=max_abs_error(x, x_hat))
