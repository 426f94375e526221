"""`k3gen::glu_act[_out]` (contract: k3gen/ops/glu_act/spec.py): SiTU / SiLU of the gate half times
the up half of gu [M, 2I] BF16, quantized to FP8 per 128 columns -> codes [M, I] uint8, scales
[M, I / 128] (the spec's recipe: FP32, or UE8M0 bytes).

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
