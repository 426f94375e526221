"""torch.library custom ops (`k3model::glu_act`, `k3model::mla_prefill`) for the kernels the model
launches that k3gen/library does not register yet (moe_route and attn_res are k3gen::, through k3gen.api). Same conventions
as k3gen/library (the kernel handle, a spec's canonical JSON, first; a fake implementation that
computes the shapes; declared mutations; CUDA launches the launcher, CPU tensors run the FP32
reference), so model/ops.py's KernelOps traces under torch.compile(fullgraph=True).

Why here: k3gen/library belongs to the engine-facing op surface (issue 24); these registrations
can move there as they are (rename the namespace) without touching the model's call sites
beyond `ops = torch.ops.k3model`.
"""
from __future__ import annotations

import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.library.table import launcher, spec_of

ops = torch.ops.k3model


def _scale_dtype(recipe) -> torch.dtype:
    return torch.float32 if recipe is ScaleRecipe.FP32 else torch.uint8


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


# -- mla_prefill -------------------------------------------------------------------------------------
def _prefill_out(handle: str, q: torch.Tensor) -> torch.Tensor:
    from k3gen.ops.mla_prefill.spec import V_HEAD, OutDtype
    s = spec_of(handle, "mla_prefill")
    dt = torch.float32 if s.out_dtype is OutDtype.FP32 else torch.bfloat16
    return q.new_empty(q.shape[0], s.heads, V_HEAD, dtype=dt)


@torch.library.custom_op("k3model::mla_prefill", mutates_args=())
def mla_prefill(handle: str, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int) -> torch.Tensor:
    """Causal prefill attention (k3gen/ops/mla_prefill/spec.py): q [Nq, H, 192], k_nope / v [Nk, H, 128],
    k_pe [Nk, 64] -> o [Nq, H, 128] (the spec's out_dtype)."""
    out = _prefill_out(handle, q)
    if q.device.type == "cuda":
        launcher(handle, "mla_prefill")(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, out, max_seqlen_q)
        return out
    from k3gen.ops.mla_prefill.reference import mla_prefill as ref
    return ref(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k).to(out.dtype)


@mla_prefill.register_fake
def _(handle, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q):
    return _prefill_out(handle, q)
