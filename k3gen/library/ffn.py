"""`k3gen::glu_act[_out]` (contract: k3gen/ops/glu_act/spec.py): SiTU / SiLU of the gate half times
the up half of gu [M, 2I] BF16, quantized to FP8 per 128 columns -> codes [M, I] uint8, scales
[M, I / 128] (the spec's recipe: FP32, or UE8M0 bytes). `k3gen::router_logits[_out]` (contract:
k3gen/ops/router_logits/spec.py): the MoE router's FP32 logits [M, E] of x [M, H] BF16 and w [E, H] BF16.

CUDA tensors launch the generated kernel of the handle's spec; CPU tensors run the FP32 reference.
"""
from __future__ import annotations

import torch

from k3gen.library.gemm import BLOCK, scale_dtype
from k3gen.library.meta import same_device, want
from k3gen.library.table import launcher, spec_of


def check_glu(spec, gu, codes=None, scales=None):
    m = gu.shape[0] if gu.dim() == 2 else -1
    want("gu", gu, torch.bfloat16, (m, 2 * spec.inter))
    if codes is not None:
        want("codes", codes, torch.uint8, (m, spec.inter))
        want("scales", scales, scale_dtype(spec), (m, spec.inter // BLOCK))
        same_device(("gu", gu), ("codes", codes), ("scales", scales))
    return m


def _glu(handle, spec, gu, codes, scales) -> None:
    if gu.device.type == "cuda":
        launcher(handle, "glu_act")(gu, codes, scales)
        return
    from k3gen.ops.glu_act.reference import glu_act_spec
    c, s = glu_act_spec(spec, gu)
    codes.copy_(c)
    scales.copy_(s)


@torch.library.custom_op("k3gen::glu_act_out", mutates_args=("codes", "scales"))
def glu_act_out(handle: str, gu: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    spec = spec_of(handle, "glu_act")
    check_glu(spec, gu, codes, scales)
    _glu(handle, spec, gu, codes, scales)


@glu_act_out.register_fake
def _(handle, gu, codes, scales):
    check_glu(spec_of(handle, "glu_act"), gu, codes, scales)


@torch.library.custom_op("k3gen::glu_act", mutates_args=())
def glu_act(handle: str, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    spec = spec_of(handle, "glu_act")
    m = check_glu(spec, gu)
    codes = torch.empty(m, spec.inter, dtype=torch.uint8, device=gu.device)
    scales = torch.empty(m, spec.inter // BLOCK, dtype=scale_dtype(spec), device=gu.device)
    _glu(handle, spec, gu, codes, scales)
    return codes, scales


@glu_act.register_fake
def _(handle, gu):
    spec = spec_of(handle, "glu_act")
    m = check_glu(spec, gu)
    return gu.new_empty(m, spec.inter, dtype=torch.uint8), gu.new_empty(m, spec.inter // BLOCK,
                                                                       dtype=scale_dtype(spec))


# -- router_logits (contract: k3gen/ops/router_logits/spec.py): FP32 [M, E] logits of x [M, H] BF16
# against w [E, H] (BF16, or FP32 holding BF16 values), in the kernel's fixed summation order (the CPU
# path replays it bit for bit).
def check_router(spec, x, w, out=None):
    m = x.shape[0] if x.dim() == 2 else -1
    want("x", x, torch.bfloat16, (m, spec.hidden))
    want("w", w, torch.bfloat16 if spec.weight.value == "bf16" else torch.float32, (spec.experts, spec.hidden))
    if out is not None:
        want("out", out, torch.float32, (m, spec.experts))
    same_device(("x", x), ("w", w), ("out", out))
    return m


def _router(handle, x, w, out) -> None:
    if x.device.type == "cuda":
        launcher(handle, "router_logits")(x, w, out)
        return
    from k3gen.ops.router_logits.reference import router_logits as ref
    out.copy_(ref(x, w))


@torch.library.custom_op("k3gen::router_logits_out", mutates_args=("out",))
def router_logits_out(handle: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    check_router(spec_of(handle, "router_logits"), x, w, out)
    _router(handle, x, w, out)


@router_logits_out.register_fake
def _(handle, x, w, out):
    check_router(spec_of(handle, "router_logits"), x, w, out)


@torch.library.custom_op("k3gen::router_logits", mutates_args=())
def router_logits(handle: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    spec = spec_of(handle, "router_logits")
    m = check_router(spec, x, w)
    out = torch.empty(m, spec.experts, dtype=torch.float32, device=x.device)
    _router(handle, x, w, out)
    return out


@router_logits.register_fake
def _(handle, x, w):
    spec = spec_of(handle, "router_logits")
    return x.new_empty(check_router(spec, x, w), spec.experts, dtype=torch.float32)
