"""FP32 reference of mla_q_absorb (contract: ops/mla_q_absorb/spec.py).

Built from the pieces the contract names, so each rounding point is explicit: BF16 after the
norm (the quantizer's input), E4M3 codes + scales from reference.quant, BF16 after Q-B and after
absorption.
"""
from __future__ import annotations

import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.numerics import row_sum
from k3gen.ops.fp8_block_gemm.reference import dequantize_activations, dequantize_weights, quantize_activations

Q_LORA, NOPE, ROPE, LATENT = 1536, 128, 64, 512


def rms_norm_bf16(q_a: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x = q_a.float()
    # Summed in numerics.row_sum's fixed order: the model's torch-side norms (the MLA latent's, the
    # final one) call this on decode and verify batches, whose rows must get the same bits.
    rstd = torch.rsqrt(row_sum(x * x) / x.shape[-1] + eps)
    return ((x * rstd) * w.float()).to(torch.bfloat16)


def mla_q_absorb(q_a, norm_w, wqb_codes, wqb_scales, w_uk, recipe: ScaleRecipe, eps: float = 1e-5,
                 return_q: bool = False):
    """q_a [B, 1536] BF16, norm_w [1536], Q-B weights (codes [H*192, 1536], block scales),
    w_uk [H, 128, 512] BF16 -> [B, H, 576] (FP32 values of the BF16 result)."""
    b = q_a.shape[0]
    h = w_uk.shape[0]
    qn = rms_norm_bf16(q_a[:, :Q_LORA], norm_w, eps)
    codes, scales = quantize_activations(qn, recipe)
    # Products in FP64 rounded to FP32: an FP32 GEMM's reduction order depends on the row count, so
    # a row's result would depend on its batch; the model's reference path (model/ops.py RefOps)
    # needs verify rows to equal decode rows, and the kernel is row-invariant too.
    xd = dequantize_activations(codes, scales, recipe).double()
    wd = dequantize_weights(wqb_codes, wqb_scales, recipe).double()
    q = (xd @ wd.T).float().to(torch.bfloat16).float()
    q = q.view(b, h, NOPE + ROPE)
    lat = torch.einsum("bhd,hdc->bhc", q[..., :NOPE].double(), w_uk.double()).float().to(torch.bfloat16).float()
    out = torch.cat([lat, q[..., NOPE:]], dim=-1)
    return (out, q) if return_q else out
