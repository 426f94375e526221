"""FP32 reference of fp8_block_gemm (contract: ops/fp8_block_gemm/spec.py), plus the weight and
activation quantizers the tests use to make inputs.

The quantizers only pad to whole 128 blocks and call reference.quant (the bit-level ground truth
shared with the kernels); padding with zeros leaves a partial block's amax unchanged, so a tensor
whose N or K is not a multiple of 128 gets exactly the scales of the contract.
"""
from __future__ import annotations

import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.numerics import e4m3_decode, fp8_group_quantize, fp8_quantize_with_scale, fp8_scale, ue8m0_decode

BLOCK = 128


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros(rows, cols, dtype=torch.float32, device=x.device)
    out[: x.shape[0], : x.shape[1]] = x.float()
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_values(scales: torch.Tensor, recipe: ScaleRecipe) -> torch.Tensor:
    """FP32 values of stored scales (FP32 as is, UE8M0 bytes decoded)."""
    if recipe is ScaleRecipe.FP32:
        if scales.dtype != torch.float32:
            raise ValueError(f"FP32 recipe needs float32 scales, got {scales.dtype}")
        return scales
    if scales.dtype != torch.uint8:
        raise ValueError(f"UE8M0 recipe needs uint8 scale bytes, got {scales.dtype}")
    return ue8m0_decode(scales)


def quantize_activations(x: torch.Tensor, recipe: ScaleRecipe):
    """x[M, K] -> (codes uint8 [M, K], scales [M, ceil(K/128)]), per token per 128 columns."""
    m, k = x.shape
    codes, scales = fp8_group_quantize(_pad_to(x, m, _cdiv(k, BLOCK) * BLOCK), BLOCK, recipe)
    return codes[:, :k].contiguous(), scales.contiguous()


def quantize_weights(w: torch.Tensor, recipe: ScaleRecipe):
    """w[N, K] -> (codes uint8 [N, K], scales [ceil(N/128), ceil(K/128)]), per 128x128 tile.

    UE8M0: s = 2^ceil(log2(amax / 448)) and the codes are re-quantized with that s (DeepGEMM)."""
    n, k = w.shape
    nb, kb = _cdiv(n, BLOCK), _cdiv(k, BLOCK)
    t = _pad_to(w, nb * BLOCK, kb * BLOCK).reshape(nb, BLOCK, kb, BLOCK).permute(0, 2, 1, 3)
    s = fp8_scale(t.abs().amax(dim=(-1, -2)), recipe)
    sf = scale_values(s, recipe)
    codes = fp8_quantize_with_scale(t, sf[..., None, None]).permute(0, 2, 1, 3).reshape(nb * BLOCK, kb * BLOCK)
    return codes[:n, :k].contiguous(), s.contiguous()


def dequantize_activations(codes: torch.Tensor, scales: torch.Tensor, recipe: ScaleRecipe,
                           dtype=torch.float32) -> torch.Tensor:
    m, k = codes.shape
    s = scale_values(scales, recipe).to(dtype).repeat_interleave(BLOCK, dim=1)[:, :k]
    return e4m3_decode(codes).to(dtype) * s


def dequantize_weights(codes: torch.Tensor, scales: torch.Tensor, recipe: ScaleRecipe,
                       dtype=torch.float32) -> torch.Tensor:
    n, k = codes.shape
    s = scale_values(scales, recipe).to(dtype)
    s = s.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]
    return e4m3_decode(codes).to(dtype) * s


def fp8_block_gemm(x_codes, x_scales, w_codes, w_scales, recipe: ScaleRecipe,
                   dtype=torch.float32) -> torch.Tensor:
    """Dequantize both operands and multiply: y[M, N] in `dtype` (FP32 reference; float64 for the
    tests' exact product). Not rounded to BF16, so callers see the kernel's rounding error."""
    x = dequantize_activations(x_codes, x_scales, recipe, dtype)
    w = dequantize_weights(w_codes, w_scales, recipe, dtype)
    return x @ w.T
