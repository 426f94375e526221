"""FP32 reference of moe_experts (contract: k3gen/ops/moe_experts/spec.py), from the formulas, on the CPU.

- Weights dequantized with numerics.py's decoders: MXFP4 e2m1 * ue8m0; NVFP4 (e2m1 * e4m3) * global
  (the gate's global on rows 0..I-1 of w13, the up's on I..2I-1).
- x: BF16 values, or FP8 codes * their per-token-128 scales (numerics.fp8_group_dequantize).
- Per computed slot (t, j) with e = ids[t, j] - base in [0, E): g, u = W13[e] x[t] (FP32), h = act(g, u)
  rounded to BF16, y = W2[e] h (FP32); out[t] = sum over j in slot order of weights[t, j] * y (one FP32
  multiply-add at a time, starting from 0). Returns (out BF16, out FP32).
"""
from __future__ import annotations

import torch

from k3gen.numerics import (e2m1_decode, e4m3_decode, fp8_group_dequantize, ue8m0_decode, unpack_e2m1)
from k3gen.ops.moe_experts.spec import ActFormat, GluAct, WeightFormat


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of scale bytes stored as uint8 or float8_e4m3fn (the loaders keep E4M3 as float8)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def dequantize(fmt: WeightFormat, codes: torch.Tensor, scales: torch.Tensor,
               row_globals: torch.Tensor | None = None) -> torch.Tensor:
    """Packed E2M1 [..., rows, K/2] with scales [..., rows, K/g] -> FP32 [..., rows, K]. NVFP4:
    row_globals [..., rows] FP32 multiplies (e2m1 * e4m3), an exact product, rounded once."""
    v = e2m1_decode(unpack_e2m1(codes.cpu()))
    s = as_bytes(scales.cpu())
    g = v.shape[-1] // s.shape[-1]
    sv = ue8m0_decode(s) if fmt is WeightFormat.MXFP4 else e4m3_decode(s)
    out = (v.unflatten(-1, (s.shape[-1], g)) * sv.unsqueeze(-1)).flatten(-2)
    if fmt is WeightFormat.NVFP4:
        out = out * row_globals.cpu().float().unsqueeze(-1)
    return out


def w13_globals(gs13: torch.Tensor, inter: int) -> torch.Tensor:
    """[E, 2] (gate, up) -> per-row [E, 2I]."""
    return gs13.cpu().float().repeat_interleave(inter, dim=1)


def dequantize_experts(spec, w13, s13, w2, s2, gs13=None, gs2=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(W13 [E, 2I, W], W2 [E, W, I]) FP32."""
    nv = spec.weights is WeightFormat.NVFP4
    W13 = dequantize(spec.weights, w13, s13, w13_globals(gs13, spec.inter) if nv else None)
    W2 = dequantize(spec.weights, w2, s2, gs2.cpu().float().expand(-1, spec.hidden) if nv else None)
    return W13, W2


def activations(spec, x: torch.Tensor, x_scales: torch.Tensor | None) -> torch.Tensor:
    if spec.act is ActFormat.BF16:
        return x.cpu().float()
    return fp8_group_dequantize(x.cpu(), x_scales.cpu(), 128, spec.recipe)


def glu(spec, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if spec.glu is GluAct.SILU:
        return g * torch.sigmoid(g) * u
    b, lb = spec.situ_beta, spec.situ_linear_beta
    return b * torch.tanh(g / b) * torch.sigmoid(g) * (lb * torch.tanh(u / lb))


def moe_experts(spec, x, w13, s13, w2, s2, ids, weights, *, gs13=None, gs2=None, x_scales=None,
                expert_base: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out BF16 [T, W], out FP32 [T, W]) on the CPU. Only the routed experts are dequantized (the
    weights may stay on the GPU: each one used is copied over alone)."""
    xf = activations(spec, x, x_scales)
    ids, weights = ids.cpu().long(), weights.cpu().float()
    T, k = ids.shape
    I = spec.inter
    nv = spec.weights is WeightFormat.NVFP4
    y = torch.zeros(T, k, spec.hidden, dtype=torch.float32)
    local = ids - expert_base
    ok = (local >= 0) & (local < spec.experts)
    for e in torch.unique(local[ok]).tolist():
        W13 = dequantize(spec.weights, w13[e], s13[e], w13_globals(gs13[e:e + 1], I)[0] if nv else None)
        W2 = dequantize(spec.weights, w2[e], s2[e], gs2[e].cpu().float().expand(spec.hidden) if nv else None)
        t_idx, j_idx = ((local == e) & ok).nonzero(as_tuple=True)
        gu = xf[t_idx] @ W13.T                                      # [n, 2I]
        h = glu(spec, gu[:, :I], gu[:, I:]).to(torch.bfloat16).float()
        y[t_idx, j_idx] = h @ W2.T
    out = torch.zeros(T, spec.hidden, dtype=torch.float32)
    for j in range(k):
        term = torch.where(ok[:, j:j + 1], weights[:, j:j + 1] * y[:, j], torch.zeros(()))
        out = out + term
    return out.to(torch.bfloat16), out
