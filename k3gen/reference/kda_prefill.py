"""PyTorch reference of kda_prefill (contract: the docstring of k3gen/ir/ops/kda_prefill.py): the
decode token loop over each sequence of a varlen batch, FP32, the state rounded to its storage
dtype once at the end (as the kernel, which keeps it in registers)."""
from __future__ import annotations

import torch

from ..ir.dtypes import GateKind
from ..ir.layouts import KDA_DK
from .kda_decode import KdaWeights, kda_token_loop


@torch.no_grad()
def kda_prefill(qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, w: KdaWeights, out=None, *,
                gate: GateKind = GateKind.BOUNDED, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Returns out [N, H, 128] BF16 (N = cu_seqlens[-1]); updates ssm/conv in place at `slots`.
    `dtype` float64 gives a drift reference (the pools still get their storage dtypes)."""
    N, H = qkvg.shape[0], w.heads
    D = H * KDA_DK
    if out is None:
        out = torch.empty(N, H, KDA_DK, dtype=torch.bfloat16, device=qkvg.device)
    out.zero_()
    cu = [int(x) for x in cu_seqlens.tolist()]
    for b, slot in enumerate(int(x) for x in slots.tolist()):
        lo, hi = cu[b], cu[b + 1]
        if slot < 0 or slot >= ssm.shape[0] or hi <= lo:
            continue
        if int(resume[b]):
            s0, w0 = ssm[slot].to(dtype), conv[slot].to(dtype)
        else:
            s0 = torch.zeros(H, KDA_DK, KDA_DK, dtype=dtype, device=qkvg.device)
            w0 = torch.zeros(3 * D, 3, dtype=dtype, device=qkvg.device)
        o, s, win, _ = kda_token_loop(qkvg[None, lo:hi], fa[None, lo:hi], beta_logit[None, lo:hi], s0[None],
                                      w0[None], w, gate=gate, dtype=dtype)
        ssm[slot] = s[0].to(ssm.dtype)
        conv[slot] = win[0].to(conv.dtype)
        out[lo:hi] = o[0].to(torch.bfloat16)
    return out
