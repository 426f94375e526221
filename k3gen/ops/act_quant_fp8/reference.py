"""FP32 reference of act_quant_fp8 (contract: ops/act_quant_fp8/spec.py).

Written with plain torch operations, independently of the kernel's bit tricks, so a GPU test
comparing the two bitwise checks the algorithm and not a transcription of it:

- amax and t = amax / 448 in FP32 (IEEE division of tensors, never a reciprocal multiply).
- UE8M0: ceil(log2 t) in float64, which is exact for every FP32 t (a non-power-of-two FP32
  value is at least 2^-24 relative away from the neighbouring powers of two, far above float64
  rounding), clamped to [-127, 127].
- E4M3: clamp to +-448, then torch's `.to(torch.float8_e4m3fn)`, which rounds to nearest even
  (tests/nogpu/ops/test_cute_compile.py checks it against ml_dtypes and k3gen.numerics).

Runs on CPU or CUDA tensors; NaN propagates into the group's scale (codes of such a group are
NaN codes, 0x7F or 0xFF).
"""
from __future__ import annotations

import torch

from k3gen.ir.dtypes import ScaleRecipe

GROUP = 128
E4M3_MAX = 448.0


def e4m3_rn_satfinite(q: torch.Tensor) -> torch.Tensor:
    """FP32 -> E4M3 bytes, round-to-nearest-even, saturating at +-448."""
    return q.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def ue8m0_ceil(t: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte of 2^ceil(log2 t) for t >= 0: t == 0 -> 0 (2^-127), NaN -> 255."""
    e = torch.ceil(torch.log2(t.double())).clamp(-127, 127)
    b = (e + 127).to(torch.int32)
    return torch.where(torch.isnan(t), torch.full_like(b, 255), b).to(torch.uint8)


def ue8m0_value(b: torch.Tensor) -> torch.Tensor:
    """FP32 value 2^(b - 127) of UE8M0 bytes (0 -> the subnormal 2^-127, 255 -> NaN)."""
    v = torch.exp2(b.double() - 127.0).float()
    return torch.where(b == 255, torch.full_like(v, float("nan")), v)


def act_quant_fp8(x: torch.Tensor, recipe: ScaleRecipe = ScaleRecipe.FP32):
    """x[M, K] -> (codes uint8 [M, K], scales [M, K/128]: FP32, or UE8M0 bytes for UE8M0)."""
    m, k = x.shape
    if k % GROUP:
        raise ValueError(f"K={k} is not a multiple of {GROUP}")
    xg = x.float().reshape(m, k // GROUP, GROUP)
    amax = xg.abs().amax(dim=-1)
    t = torch.div(amax, torch.full_like(amax, E4M3_MAX))
    if recipe is ScaleRecipe.FP32:
        zero = (t == 0).unsqueeze(-1)
        q = torch.div(xg, torch.where(zero, torch.ones_like(t.unsqueeze(-1)), t.unsqueeze(-1)))
        codes = torch.where(zero, torch.zeros((), dtype=torch.uint8, device=x.device),
                            e4m3_rn_satfinite(q))
        scales = t
    else:
        scales = ue8m0_ceil(t)
        codes = e4m3_rn_satfinite(torch.div(xg, ue8m0_value(scales).unsqueeze(-1)))
    return codes.reshape(m, k), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, recipe: ScaleRecipe = ScaleRecipe.FP32):
    """codes * scale per group, FP32 (for error checks against x)."""
    m, k = codes.shape
    v = codes.view(torch.float8_e4m3fn).float().reshape(m, k // GROUP, GROUP)
    s = scales.float() if recipe is ScaleRecipe.FP32 else ue8m0_value(scales)
    return (v * s.unsqueeze(-1)).reshape(m, k)
