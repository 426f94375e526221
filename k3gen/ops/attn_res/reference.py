"""FP32 reference of attn_res (the contract is the docstring of k3gen.ops.attn_res.spec).

model/arch.attn_res_mix's formula, softmax_i(q . RMSNorm(V_i)) mixing the V_i, followed by
model/layers.rms_norm and act_quant_fp8, with every operation an FP32 operation rounded once, in
the kernel's order, so a GPU result can be checked bit for bit as well as against the tolerance
table. The order:

- A row sum S(y) over hidden (`ordered_sum`): hidden is cut into `slices` slices (spec.slices), a
  slice into warps of 32 threads of 4 consecutive columns. Per thread ((y0 + y1) + y2) + y3; per
  warp an xor butterfly over the lanes at distances 16, 8, 4, 2, 1 (lane l adds lane l ^ o); then
  the warps of a slice in order; then the slices in order. The order depends on hidden alone.
- r_i = 1 / sqrt(S(V_i * V_i) / hidden + eps); score_i = r_i * S(V_i * q) (both sums of a source
  are taken in one pass, so one cluster exchange serves them).
- softmax: p_i = FP32(exp(FP64(score_i - max_j score_j))), the sum p_0 + p_1 + ... in source order,
  alpha_i = p_i / sum (IEEE division).
- x = (alpha_0 V_0 + alpha_1 V_1) + ... in source order, each product rounded.
- out = BF16((x * rn) * w), rn = 1 / sqrt(S(x * x) / hidden + eps); codes/scales =
  act_quant_fp8(out) (ops/act_quant_fp8/reference.py).

torch's CPU kernels round every elementwise operation once and no FMA is formed across separate
torch operations, so this is exact FP32 arithmetic in the stated order; the square root is the one
exception (see `rstd`).
"""
from __future__ import annotations

import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.act_quant_fp8.reference import act_quant_fp8
from k3gen.ops.attn_res.spec import slices_for


def ordered_sum(y: torch.Tensor, slices: int) -> torch.Tensor:
    """S(y) over the last dim (FP32), in the kernel's order (module docstring)."""
    *lead, h = y.shape
    warps = h // slices // 128
    v = y.float().reshape(*lead, slices, warps, 32, 4)
    t = ((v[..., 0] + v[..., 1]) + v[..., 2]) + v[..., 3]
    lanes = torch.arange(32)
    for o in (16, 8, 4, 2, 1):
        t = t + t[..., lanes ^ o]
    t = t[..., 0]                       # every lane holds the same sum
    s = t[..., 0]
    for w in range(1, warps):
        s = s + t[..., w]
    out = s[..., 0]
    for c in range(1, slices):
        out = out + s[..., c]
    return out


def rstd(ss: torch.Tensor, hidden: int, eps: float) -> torch.Tensor:
    """1 / sqrt(ss / hidden + eps), each operation rounded once (IEEE). The square root is taken in
    float64 and rounded to FP32, which is the correctly rounded FP32 root: torch's FP32 sqrt on the
    CPU (a vectorized approximation) misses it by an ulp now and then, where the GPU's is exact.
    Divisions by full tensors, never by a Python scalar."""
    mean = torch.div(ss, torch.full_like(ss, float(hidden)))
    root = torch.sqrt((mean + torch.tensor(eps, dtype=torch.float32)).double()).float()
    return torch.div(torch.ones_like(root), root)


def mix(V: torch.Tensor, query: torch.Tensor, eps: float, slices: int | None = None) -> torch.Tensor:
    """Sources V [n, M, hidden] FP32 and the pseudo-query q [hidden] -> the mixed rows x [M, hidden]."""
    V = V.float().cpu()
    n, _, h = V.shape
    slices = slices or slices_for(h)
    q = query.float().cpu()
    r = rstd(ordered_sum(V * V, slices), h, eps)                       # [n, M]
    score = r * ordered_sum(V * q, slices)                             # [n, M]
    p = torch.exp((score - score.max(0).values).double()).float()
    total = p[0]
    for i in range(1, n):
        total = total + p[i]
    alpha = p / total
    x = alpha[0][:, None] * V[0]
    for i in range(1, n):
        x = x + alpha[i][:, None] * V[i]
    return x


def norm(x: torch.Tensor, norm_w: torch.Tensor, eps: float, slices: int | None = None) -> torch.Tensor:
    """BF16((x * rn) * w) with the kernel's row sum."""
    h = x.shape[-1]
    rn = rstd(ordered_sum(x * x, slices or slices_for(h)), h, eps)
    return ((x * rn[:, None]) * norm_w.float().cpu()).to(torch.bfloat16)


def partial_update(partial: torch.Tensor | None, delta: torch.Tensor, seal: bool) -> torch.Tensor:
    """The partial sum after adding a layer output: FP32(delta) to start a block, else partial + FP32(delta)."""
    d = delta.float().cpu()
    return d.clone() if seal else partial.float().cpu() + d


def attn_res(V: torch.Tensor, query: torch.Tensor, norm_w: torch.Tensor, eps: float = 1e-5,
             recipe: ScaleRecipe | None = None) -> dict:
    """The op's outputs for sources V [n, M, hidden]: {"mixed", "out"} and, with a recipe,
    {"codes", "scales"} (CPU tensors)."""
    x = mix(V, query, eps)
    out = norm(x, norm_w, eps)
    res = {"mixed": x, "out": out}
    if recipe is not None:
        res["codes"], res["scales"] = act_quant_fp8(out, recipe)
    return res
