"""torch.library custom ops (`k3model::`) for the FFN and residual-stream kernels the model
launches that k3gen/library does not register yet: moe_route, attn_res, glu_act. Same conventions
as k3gen/library (the kernel handle, a spec's canonical JSON, first; a fake implementation that
computes the shapes; declared mutations; CUDA launches the launcher, CPU tensors run the FP32
reference), so model/ops.py's KernelOps traces under torch.compile(fullgraph=True).

Why here: k3gen/library belongs to the engine-facing op surface (issue 24); these registrations
can move there as they are (rename the namespace) without touching the model's call sites
beyond `ops = torch.ops.k3model`.
"""
from __future__ import annotations

from typing import Optional

import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.library.table import launcher, spec_of

ops = torch.ops.k3model


def _scale_dtype(recipe) -> torch.dtype:
    return torch.float32 if recipe is ScaleRecipe.FP32 else torch.uint8


# -- moe_route ---------------------------------------------------------------------------------------
@torch.library.custom_op("k3model::moe_route", mutates_args=())
def moe_route(handle: str, logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor, torch.Tensor,
                                                                              torch.Tensor, torch.Tensor]:
    """logits [T, E] FP32, bias [E] -> (ids [T, k] int32, weights [T, k] FP32, counts [E],
    offsets [E + 1], perm [T k], inv [T k]) (k3gen/ops/moe_route/spec.py)."""
    spec = spec_of(handle, "moe_route")
    T = logits.shape[0]
    if logits.device.type == "cuda":
        lau = launcher(handle, "moe_route")
        ws = lau.workspace(T, device=logits.device)     # fresh outputs of exactly T tokens (T >= 1)
        lau(logits, bias, ws)
        return tuple(ws[n] for n in ("ids", "weights", "counts", "offsets", "perm", "inv"))
    from k3gen.ops.moe_route.reference import route_spec
    r = route_spec(spec, logits, bias)
    return tuple(t.to(logits.device) for t in (r.ids, r.weights, r.counts, r.offsets, r.perm, r.inv))


@moe_route.register_fake
def _(handle, logits, bias):
    s = spec_of(handle, "moe_route")
    T, k, E = logits.shape[0], s.top_k, s.experts
    i32 = dict(dtype=torch.int32)
    return (logits.new_empty(T, k, **i32), logits.new_empty(T, k), logits.new_empty(E, **i32),
            logits.new_empty(E + 1, **i32), logits.new_empty(T * k, **i32), logits.new_empty(T * k, **i32))


# -- attn_res ----------------------------------------------------------------------------------------
@torch.library.custom_op("k3model::attn_res", mutates_args=("src",))
def attn_res(handle: str, src: torch.Tensor, n: int, query: torch.Tensor, norm_w: torch.Tensor,
             delta: Optional[torch.Tensor], seal: bool, want_mixed: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor, torch.Tensor]:
    """Mix sources 0..n-1 of src [N_max, M, hidden] FP32 (after the spec's delta update of source
    n-1, in place) -> (out [M, hidden] BF16 normed, codes [M, hidden] uint8, scales [M, hidden/128],
    mixed [M, hidden] FP32 with want_mixed, else [0, hidden])."""
    s = spec_of(handle, "attn_res")
    M, h = src.shape[1], s.hidden
    out = torch.empty(M, h, dtype=torch.bfloat16, device=src.device)
    codes = torch.empty(M, h, dtype=torch.uint8, device=src.device)
    scales = torch.empty(M, s.groups, dtype=_scale_dtype(s.recipe), device=src.device)
    mixed = torch.empty(M if want_mixed else 0, h, dtype=torch.float32, device=src.device)
    if src.device.type == "cuda":
        launcher(handle, "attn_res")(src, n, query, norm_w, out, codes=codes, scales=scales, delta=delta, seal=seal,
                                     mixed=mixed if want_mixed else None)
        return out, codes, scales, mixed
    from k3gen.ops.act_quant_fp8.reference import act_quant_fp8
    from k3gen.ops.attn_res import reference as R
    if delta is not None:
        src[n - 1].copy_(R.partial_update(None if seal else src[n - 1], delta, seal))
    x = R.mix(src[:n], query, s.eps)
    out.copy_(R.norm(x, norm_w, s.eps))
    c, sc = act_quant_fp8(out, s.recipe)
    codes.copy_(c)
    scales.copy_(sc)
    if want_mixed:
        mixed.copy_(x)
    return out, codes, scales, mixed


@attn_res.register_fake
def _(handle, src, n, query, norm_w, delta, seal, want_mixed):
    s = spec_of(handle, "attn_res")
    M, h = src.shape[1], s.hidden
    return (src.new_empty(M, h, dtype=torch.bfloat16), src.new_empty(M, h, dtype=torch.uint8),
            src.new_empty(M, s.groups, dtype=_scale_dtype(s.recipe)), src.new_empty(M if want_mixed else 0, h))


# -- glu_act -----------------------------------------------------------------------------------------
@torch.library.custom_op("k3model::glu_act", mutates_args=())
def glu_act(handle: str, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gu [M, 2I] BF16 -> (codes [M, I] uint8, scales [M, I/128]) (k3gen/ops/glu_act/spec.py)."""
    s = spec_of(handle, "glu_act")
    M = gu.shape[0]
    if gu.device.type == "cuda":
        codes = torch.empty(M, s.inter, dtype=torch.uint8, device=gu.device)
        scales = torch.empty(M, s.groups, dtype=_scale_dtype(s.recipe), device=gu.device)
        launcher(handle, "glu_act")(gu, codes, scales)
        return codes, scales
    from k3gen.ops.glu_act.reference import glu_act_spec
    return glu_act_spec(s, gu)


@glu_act.register_fake
def _(handle, gu):
    s = spec_of(handle, "glu_act")
    M = gu.shape[0]
    return gu.new_empty(M, s.inter, dtype=torch.uint8), gu.new_empty(M, s.groups, dtype=_scale_dtype(s.recipe))
