"""`k3gen::act_quant_fp8[_out]` and `k3gen::fp8_block_gemm[_out]` (contracts: the ops' spec.py).

CUDA tensors launch the generated kernel of the handle's spec; CPU tensors run the op's FP32
reference (same contract, slow: for tests, tracing and machines without a GPU).
"""
from __future__ import annotations

import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.library.meta import same_device, want
from k3gen.library.table import launcher, spec_of

BLOCK = 128


def scale_dtype(spec) -> torch.dtype:
    """FP32 scales are float32, UE8M0 scales uint8 bytes (the two recipes cannot be mixed up)."""
    return torch.float32 if spec.recipe is ScaleRecipe.FP32 else torch.uint8


# -- act_quant_fp8 ---------------------------------------------------------------------------------
def check_act_quant(spec, x, codes=None, scales=None):
    m = x.shape[0] if x.dim() == 2 else -1
    want("x", x, torch.bfloat16, (m, spec.k))
    if codes is not None:
        want("codes", codes, torch.uint8, (m, spec.k))
        want("scales", scales, scale_dtype(spec), (m, spec.k // BLOCK))
        same_device(("x", x), ("codes", codes), ("scales", scales))
    return m


def _act_quant(handle, spec, x, codes, scales) -> None:
    if x.device.type == "cuda":
        launcher(handle, "act_quant_fp8")(x, codes, scales)
        return
    from k3gen.ops.act_quant_fp8.reference import act_quant_fp8 as ref
    c, s = ref(x, spec.recipe)
    codes.copy_(c)
    scales.copy_(s)


@torch.library.custom_op("k3gen::act_quant_fp8_out", mutates_args=("codes", "scales"))
def act_quant_fp8_out(handle: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    spec = spec_of(handle, "act_quant_fp8")
    check_act_quant(spec, x, codes, scales)
    _act_quant(handle, spec, x, codes, scales)


@act_quant_fp8_out.register_fake
def _(handle, x, codes, scales):
    check_act_quant(spec_of(handle, "act_quant_fp8"), x, codes, scales)


@torch.library.custom_op("k3gen::act_quant_fp8", mutates_args=())
def act_quant_fp8(handle: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    spec = spec_of(handle, "act_quant_fp8")
    m = check_act_quant(spec, x)
    codes = torch.empty(m, spec.k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(m, spec.k // BLOCK, dtype=scale_dtype(spec), device=x.device)
    _act_quant(handle, spec, x, codes, scales)
    return codes, scales


@act_quant_fp8.register_fake
def _(handle, x):
    spec = spec_of(handle, "act_quant_fp8")
    m = check_act_quant(spec, x)
    return (x.new_empty(m, spec.k, dtype=torch.uint8), x.new_empty(m, spec.k // BLOCK, dtype=scale_dtype(spec)))


# -- fp8_block_gemm --------------------------------------------------------------------------------
def check_gemm(spec, x_codes, x_scales, w_codes, w_scales, out=None):
    sdt = scale_dtype(spec)
    m = x_codes.shape[0] if x_codes.dim() == 2 else -1
    want("x_codes", x_codes, torch.uint8, (m, spec.k))
    want("x_scales", x_scales, sdt, (m, spec.k_blocks))
    want("w_codes", w_codes, torch.uint8, (spec.n, spec.k))
    want("w_scales", w_scales, sdt, (spec.n_blocks, spec.k_blocks))
    named = [("x_codes", x_codes), ("x_scales", x_scales), ("w_codes", w_codes), ("w_scales", w_scales)]
    if out is not None:
        want("out", out, torch.bfloat16, (m, spec.n))
        named.append(("out", out))
    same_device(*named)
    return m


def _gemm(handle, spec, x_codes, x_scales, w_codes, w_scales, out) -> None:
    if out.device.type == "cuda":
        launcher(handle, "fp8_block_gemm")(x_codes, x_scales, w_codes, w_scales, out)
        return
    from k3gen.ops.fp8_block_gemm.reference import fp8_block_gemm as ref
    out.copy_(ref(x_codes, x_scales, w_codes, w_scales, spec.recipe).to(torch.bfloat16))


@torch.library.custom_op("k3gen::fp8_block_gemm_out", mutates_args=("out",))
def fp8_block_gemm_out(handle: str, x_codes: torch.Tensor, x_scales: torch.Tensor, w_codes: torch.Tensor,
                       w_scales: torch.Tensor, out: torch.Tensor) -> None:
    spec = spec_of(handle, "fp8_block_gemm")
    check_gemm(spec, x_codes, x_scales, w_codes, w_scales, out)
    _gemm(handle, spec, x_codes, x_scales, w_codes, w_scales, out)


@fp8_block_gemm_out.register_fake
def _(handle, x_codes, x_scales, w_codes, w_scales, out):
    check_gemm(spec_of(handle, "fp8_block_gemm"), x_codes, x_scales, w_codes, w_scales, out)


@torch.library.custom_op("k3gen::fp8_block_gemm", mutates_args=())
def fp8_block_gemm(handle: str, x_codes: torch.Tensor, x_scales: torch.Tensor, w_codes: torch.Tensor,
                   w_scales: torch.Tensor) -> torch.Tensor:
    spec = spec_of(handle, "fp8_block_gemm")
    m = check_gemm(spec, x_codes, x_scales, w_codes, w_scales)
    out = torch.empty(m, spec.n, dtype=torch.bfloat16, device=x_codes.device)
    _gemm(handle, spec, x_codes, x_scales, w_codes, w_scales, out)
    return out


@fp8_block_gemm.register_fake
def _(handle, x_codes, x_scales, w_codes, w_scales):
    spec = spec_of(handle, "fp8_block_gemm")
    m = check_gemm(spec, x_codes, x_scales, w_codes, w_scales)
    return x_codes.new_empty(m, spec.n, dtype=torch.bfloat16)
