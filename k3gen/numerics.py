"""FP32 reference quantizers: E4M3, E2M1 (NVFP4 / MXFP4), UE8M0 and FP8 per-group.

These are the bit-level ground truth the CUDA kernels are tested against, so every rounding step
mirrors the device code (`include/k3gen/common/quant.cuh`) operation by operation:

- FP32 arithmetic only, one IEEE operation per step. Divisions go through `_div`, which always
  divides by a full tensor: torch's CUDA kernels turn `t / python_scalar` into a multiplication by
  the reciprocal, which rounds differently from the device's `__fdiv_rn`.
- NVFP4 scale: `E4M3_satfinite((amax / 6) * G)`, two FP32 roundings in that order, and codes are
  computed with the *stored* scale `d = float(stored) / G`, code 0 where `d == 0`.
- Codes are uint8 tensors; E2M1 codes are nibbles 0..15 (bit 3 = sign) before `pack_e2m1`.

Works on CPU and CUDA tensors alike. NaN inputs give unspecified (but finite-scale) results; the
callers feed finite BF16 data.
"""
from __future__ import annotations

import torch

from k3gen.ir.dtypes import ScaleRecipe

E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
FP8_GROUP = 128


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (kept), in one fixed order (zero-padded to a power of two, then the
    halves added until one is left): a row gets the same bits in any batch, on any device.
    torch's CUDA reductions pick their thread layout from the output count (block_height =
    min(pow2(rows), 16) lanes per row for a 3-row decode batch is not the 12-row verify batch's),
    so `x.square().mean(-1)` sums a decode row and its verify row in different orders; the H200
    measured speculative logits off greedy's by ~1e-3 at one token in ~300 (issue 27)."""
    n = x.shape[-1]
    p = 1 << max(0, (n - 1).bit_length())
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x


def _f32(x) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _full(like: torch.Tensor, v: float) -> torch.Tensor:
    return torch.full_like(like, v, dtype=torch.float32)


def _div(a: torch.Tensor, b) -> torch.Tensor:
    """IEEE FP32 a / b, never a reciprocal multiply (see module docstring)."""
    a = _f32(a)
    if not isinstance(b, torch.Tensor):
        b = _full(a, float(b))
    b = _f32(b).to(a.device)
    a, b = torch.broadcast_tensors(a, b)
    return torch.div(a, b.contiguous())


def _mul(a: torch.Tensor, b) -> torch.Tensor:
    a = _f32(a)
    if not isinstance(b, torch.Tensor):
        b = _full(a, float(torch.tensor(b, dtype=torch.float32)))
    return torch.mul(a, _f32(b).to(a.device))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return _f32(x).contiguous().view(torch.int32)


def _signbit(x: torch.Tensor) -> torch.Tensor:
    return _bits(x) < 0


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as FP32 for integer tensors e in the normal range [-126, 127]."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


# -- E4M3 ----------------------------------------------------------------------------------------
def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """RNE to E4M3 (bias 7, 3 mantissa bits) with satfinite at +-448; sign kept (-0 -> 0x80).

    Mirrors `cvt.rn.satfinite.e4m3x2.f32`: +-inf saturate to +-448, NaN -> 0x7F.
    """
    x = _f32(x)
    a = torch.clamp(x.abs(), max=E4M3_MAX)
    biased = (_bits(a) >> 23) & 0xFF
    # Below 2**-6 the format is subnormal with the fixed step 2**-9, i.e. exponent -6.
    e = torch.clamp(biased - 127, min=-6)
    step = _pow2(e - 3)
    mant = torch.round(a / step)  # a / 2**k is exact; torch.round is half-to-even
    code = ((e + 6) * 8 + mant.to(torch.int32))
    code = code | torch.where(_signbit(x), 0x80, 0).to(torch.int32)
    code = torch.where(torch.isnan(x), torch.full_like(code, 0x7F), code)
    return code.to(torch.uint8)


def e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    c = code.to(torch.int32)
    e = (c >> 3) & 0xF
    m = (c & 7).to(torch.float32)
    mag = torch.where(e == 0, m * 2.0 ** -9, (m + 8.0) * _pow2(torch.clamp(e, min=1) - 10))
    mag = torch.where((c & 0x7F) == 0x7F, torch.full_like(mag, float("nan")), mag)
    return torch.where((c & 0x80) != 0, -mag, mag)


# -- E2M1 ----------------------------------------------------------------------------------------
# Decision points of RNE on the grid 0, .5, 1, 1.5, 2, 3, 4, 6. At a tie the even code wins, so
# ties at .25, 1.25, 2.5, 5 round down (`>`) and ties at .75, 1.75, 3.5 round up (`>=`).
_E2M1_UP_STRICT = (0.25, 1.25, 2.5, 5.0)
_E2M1_UP_EQUAL = (0.75, 1.75, 3.5)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """RNE to E2M1 with satfinite at 6; bit 3 is the input's sign bit (-0.1 -> 0x8).

    Same bits as `cvt.rn.satfinite.e2m1x2.f32` for non-NaN input; NaN gives magnitude 0.
    """
    x = _f32(x)
    a = x.abs()
    code = torch.zeros_like(a, dtype=torch.int32)
    for t in _E2M1_UP_STRICT:
        code += (a > t).to(torch.int32)
    for t in _E2M1_UP_EQUAL:
        code += (a >= t).to(torch.int32)
    code = code | torch.where(_signbit(x), 8, 0).to(torch.int32)
    return code.to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """Values of E2M1 codes (bit 3 sign). Computed from the bits, not looked up in a table built
    from host data: a host-to-device copy is illegal inside CUDA-graph capture."""
    c = code.to(torch.int32)
    e = ((c >> 1) & 3).to(torch.float32)
    m = (c & 1).to(torch.float32)
    # e == 0: subnormal m * 0.5; else 2^(e-1) * (1 + m / 2). Every value is exact in FP32.
    mag = torch.where(e == 0, m * 0.5, torch.exp2(e - 1.0) * (1.0 + m * 0.5))
    return torch.where((c & 8) != 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2k] nibbles -> [..., k] bytes, even element in the low nibble."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def e2m1_quantize_step(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Codes of x with dequant step d (broadcastable): E2M1(x / d), 0 where d == 0."""
    x = _f32(x)
    d = _f32(d).to(x.device).expand_as(x)
    q = e2m1_encode(_div(x, torch.where(d == 0, torch.ones_like(d), d)))
    return torch.where(d == 0, torch.zeros_like(q), q)


# -- UE8M0 ---------------------------------------------------------------------------------------
def ue8m0_encode(s: torch.Tensor) -> torch.Tensor:
    """Biased exponent byte of 2**ceil(log2(s)), clamped to [2**-127, 2**127] (never 0xFF NaN).

    s <= 0 gives byte 0 (2**-127): a finite scale for all-zero blocks. The ceiling is exact, also
    for FP32 subnormal s. NaN s gives 0xFF.
    """
    s = _f32(s)
    b = _bits(torch.clamp(s, min=0.0))
    biased, mant = (b >> 23) & 0xFF, b & 0x7FFFFF
    k = biased - 127 + (mant != 0).to(torch.int32)
    # Subnormal s lies in (0, 2**-126): the ceiling is -126 above 2**-127, else <= -127.
    k = torch.where(biased == 0, torch.where(mant > (1 << 22), -126, -127).to(torch.int32), k)
    byte = torch.clamp(k + 127, 0, 254)
    byte = torch.where(torch.isnan(s), torch.full_like(byte, 255), byte)
    return byte.to(torch.uint8)


def ue8m0_decode(byte: torch.Tensor) -> torch.Tensor:
    b = byte.to(torch.int32)
    # 2**-127 is an FP32 subnormal, so build it separately from the normal range.
    v = torch.where(b == 0, torch.full_like(b, 2.0 ** -127, dtype=torch.float32),
                    _pow2(torch.clamp(b, 1, 254) - 127))
    return torch.where(b == 255, torch.full_like(v, float("nan")), v)


# -- block helpers -------------------------------------------------------------------------------
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the block {block}")
    return _f32(x).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    return _blocks(x, block).abs().amax(dim=-1)


# -- NVFP4 ---------------------------------------------------------------------------------------
def nvfp4_scale(amax: torch.Tensor, G: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored E4M3 scale code, dequant step d = float(stored) / G) for block maxima `amax`."""
    code = e4m3_encode(_mul(_div(amax, 6.0), G))
    d = _div(e4m3_decode(code), G)
    return code, d


def nvfp4_quantize(x: torch.Tensor, G: float, block: int = NVFP4_BLOCK):
    """x [..., K] -> (packed E2M1 codes [..., K/2], E4M3 scale codes [..., K/block])."""
    xb = _blocks(x, block)
    code, d = nvfp4_scale(xb.abs().amax(dim=-1), G)
    q = e2m1_quantize_step(xb, d.unsqueeze(-1))
    return pack_e2m1(q.flatten(-2)), code


def nvfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, G: float,
                     block: int = NVFP4_BLOCK) -> torch.Tensor:
    v = e2m1_decode(unpack_e2m1(packed))
    v = v.reshape(*v.shape[:-1], v.shape[-1] // block, block)
    d = _div(e4m3_decode(scales), G).unsqueeze(-1)
    return (v * d).flatten(-2)


# -- MXFP4 ---------------------------------------------------------------------------------------
def mxfp4_scale(amax: torch.Tensor, rounding: str = "ceil") -> torch.Tensor:
    """UE8M0 byte of a block. "ceil": 2**ceil(log2(amax / 6)), never clips (DeepGEMM style).
    "floor": the OCP MX rule 2**(floor(log2 amax) - 2), which may saturate values to 6."""
    amax = _f32(amax)
    if rounding == "ceil":
        return ue8m0_encode(_div(amax, E2M1_MAX))
    if rounding != "floor":
        raise ValueError(f"rounding={rounding!r}; allowed: ceil, floor")
    b = _bits(amax)
    biased = (b >> 23) & 0xFF
    k = torch.where(biased == 0, torch.full_like(biased, -127), biased - 127 - 2)
    return torch.clamp(k + 127, 0, 254).to(torch.uint8)


def mxfp4_quantize(x: torch.Tensor, block: int = MXFP4_BLOCK, rounding: str = "ceil"):
    """x [..., K] -> (packed E2M1 codes [..., K/2], UE8M0 bytes [..., K/block])."""
    xb = _blocks(x, block)
    sb = mxfp4_scale(xb.abs().amax(dim=-1), rounding)
    q = e2m1_quantize_step(xb, ue8m0_decode(sb).unsqueeze(-1))
    return pack_e2m1(q.flatten(-2)), sb


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, block: int = MXFP4_BLOCK):
    v = e2m1_decode(unpack_e2m1(packed))
    v = v.reshape(*v.shape[:-1], v.shape[-1] // block, block)
    return (v * ue8m0_decode(scales).unsqueeze(-1)).flatten(-2)


# -- FP8 per group -------------------------------------------------------------------------------
def fp8_scale(amax: torch.Tensor, recipe: ScaleRecipe = ScaleRecipe.FP32) -> torch.Tensor:
    """Per-group scale: FP32 amax / 448, or the UE8M0 byte of 2**ceil(log2(amax / 448))."""
    s = _div(amax, E4M3_MAX)
    return s if recipe is ScaleRecipe.FP32 else ue8m0_encode(s)


def fp8_quantize_with_scale(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """E4M3(x / s) with s broadcastable FP32; code 0 where s == 0."""
    x = _f32(x)
    s = _f32(s).to(x.device).expand_as(x)
    q = e4m3_encode(_div(x, torch.where(s == 0, torch.ones_like(s), s)))
    return torch.where(s == 0, torch.zeros_like(q), q)


def fp8_group_quantize(x: torch.Tensor, group: int = FP8_GROUP,
                       recipe: ScaleRecipe = ScaleRecipe.FP32):
    """x [..., K] -> (E4M3 codes [..., K], scales [..., K/group]: FP32, or UE8M0 bytes)."""
    xb = _blocks(x, group)
    s = fp8_scale(xb.abs().amax(dim=-1), recipe)
    sf = s if recipe is ScaleRecipe.FP32 else ue8m0_decode(s)
    return fp8_quantize_with_scale(xb, sf.unsqueeze(-1)).flatten(-2), s


def fp8_group_dequantize(codes: torch.Tensor, scales: torch.Tensor, group: int = FP8_GROUP,
                         recipe: ScaleRecipe = ScaleRecipe.FP32) -> torch.Tensor:
    v = e4m3_decode(codes)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // group, group)
    sf = _f32(scales) if recipe is ScaleRecipe.FP32 else ue8m0_decode(scales)
    return (v * sf.unsqueeze(-1)).flatten(-2)
