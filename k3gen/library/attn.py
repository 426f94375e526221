"""`k3gen::attn_res[_out]` (contract: k3gen/ops/attn_res/spec.py).

The source buffer src [>= n, >= M, hidden] FP32 is allocated once per forward by the caller; a
call mixes its sources 0..n-1 (n a plain int: the stream's count, known at plan time) over rows
0..M-1. A spec with delta first updates source n-1 in place (src += delta, or = delta when
`seal`), so `src` is declared mutated by both forms (a spec without delta leaves it as it is).

The functional form mixes every row of src (M = src.shape[1]: pass a row slice src[:, :M] for
fewer) and returns (out, codes, scales, mixed) with a fixed schema for every spec: codes and
scales are [0, hidden] / [0, hidden/128] when the spec writes no FP8, mixed is [0, hidden] unless
`want_mixed` (the signature the model's attn_res op had). The `_out` form writes
caller-owned buffers for M = out.shape[0] rows (codes, scales for an FP8 spec; mixed optional).

CUDA tensors launch the generated kernel of the handle's spec; CPU tensors run the FP32 reference.
"""
from __future__ import annotations

from typing import Optional

import torch

from k3gen.errors import SpecError
from k3gen.library.gemm import scale_dtype
from k3gen.library.meta import same_device, want
from k3gen.library.table import launcher, spec_of
from k3gen.ops.attn_res.spec import ResDelta

BF16, F32 = torch.bfloat16, torch.float32


def _scale_dtype(spec) -> torch.dtype:
    return scale_dtype(spec) if spec.fp8 else F32


def _src(spec, src, M) -> None:
    """FP32 [*, >= M, hidden], unit inner stride, 4-element strides (the kernel's 16-byte loads;
    the start's alignment is the launcher's check, fake tensors have no address)."""
    h = spec.hidden
    ok = isinstance(src, torch.Tensor) and src.dtype == F32 and src.dim() == 3 and src.shape[2] == h
    if ok:
        ok = src.stride(2) == 1 and src.stride(1) % 4 == 0 and src.stride(0) % 4 == 0 \
            and src.shape[1] >= M
    if not ok:
        got = (tuple(src.shape), tuple(src.stride()), str(src.dtype)) if isinstance(src, torch.Tensor) \
            else type(src).__name__
        raise SpecError("src", got, [f"float32 [>= n, >= {M}, {h}]"], "unit inner stride, 4-element strides")


def check_attn_res(spec, src, n, query, norm_w, delta, seal, codes=None, scales=None, mixed=None, out=None):
    """Returns M: out.shape[0] (_out form) or src.shape[1] (functional form)."""
    h = spec.hidden
    if out is not None:
        M = out.shape[0] if out.dim() == 2 else -1
        want("out", out, BF16, (M, h))
    else:
        M = src.shape[1] if isinstance(src, torch.Tensor) and src.dim() == 3 else -1
    _src(spec, src, M)
    if isinstance(n, bool) or not 1 <= n <= min(spec.max_sources, src.shape[0]):
        raise SpecError("n", n, f"1..{min(spec.max_sources, src.shape[0])}",
                        "valid sources (spec max_sources, src.shape[0])")
    want("query", query, F32, (h,))
    want("norm_w", norm_w, BF16, (h,))
    if spec.delta is ResDelta.NONE:
        if delta is not None or seal:
            raise SpecError("delta", "given" if delta is not None else "seal=True", [None],
                            f"spec {spec.slug()} fuses no partial-sum update")
    else:
        if delta is None:
            raise SpecError("delta", None, [f"{spec.delta.value} [{M}, {h}]"], f"spec {spec.slug()} adds a delta")
        want("delta", delta, BF16 if spec.delta is ResDelta.BF16 else F32, (M, h))
    if out is not None:
        if spec.fp8:
            if codes is None or scales is None:
                raise SpecError("codes/scales", None, ["uint8 codes and scales"], f"spec {spec.slug()} writes FP8")
            want("codes", codes, torch.uint8, (M, h))
            want("scales", scales, scale_dtype(spec), (M, spec.groups))
        elif codes is not None or scales is not None:
            raise SpecError("codes/scales", "given", [None], f"spec {spec.slug()} writes no FP8")
        if mixed is not None:
            want("mixed", mixed, F32, (M, h))
    same_device(("src", src), ("query", query), ("norm_w", norm_w), ("delta", delta), ("codes", codes),
                ("scales", scales), ("mixed", mixed), ("out", out))
    return M


def _attn_res(handle, spec, src, n, query, norm_w, delta, seal, codes, scales, mixed, out) -> None:
    if out.device.type == "cuda":
        launcher(handle, "attn_res")(src, n, query, norm_w, out, codes=codes, scales=scales, mixed=mixed,
                                     delta=delta, seal=seal)
        return
    from k3gen.ops.act_quant_fp8.reference import act_quant_fp8
    from k3gen.ops.attn_res import reference as ref
    M = out.shape[0]
    if delta is not None:
        part = src[n - 1, :M]
        part.copy_(ref.partial_update(None if seal else part, delta, seal))
    x = ref.mix(src[:n, :M], query, spec.eps, spec.slices)
    out.copy_(ref.norm(x, norm_w, spec.eps, spec.slices))
    if spec.fp8:
        c, s = act_quant_fp8(out, spec.recipe)
        codes.copy_(c)
        scales.copy_(s)
    if mixed is not None:
        mixed.copy_(x)


@torch.library.custom_op("k3gen::attn_res_out", mutates_args=("src", "codes", "scales", "mixed", "out"))
def attn_res_out(handle: str, src: torch.Tensor, n: int, query: torch.Tensor, norm_w: torch.Tensor,
                 delta: Optional[torch.Tensor], seal: bool, codes: Optional[torch.Tensor],
                 scales: Optional[torch.Tensor], mixed: Optional[torch.Tensor], out: torch.Tensor) -> None:
    spec = spec_of(handle, "attn_res")
    check_attn_res(spec, src, n, query, norm_w, delta, seal, codes, scales, mixed, out)
    _attn_res(handle, spec, src, n, query, norm_w, delta, seal, codes, scales, mixed, out)


@attn_res_out.register_fake
def _(handle, src, n, query, norm_w, delta, seal, codes, scales, mixed, out):
    check_attn_res(spec_of(handle, "attn_res"), src, n, query, norm_w, delta, seal, codes, scales, mixed, out)


def _fresh(spec, M, want_mixed, new):
    """(out, codes, scales, mixed) of M rows (empty placeholders for what the call does not write)."""
    h = spec.hidden
    rows = M if spec.fp8 else 0
    return (new((M, h), BF16), new((rows, h), torch.uint8), new((rows, spec.groups), _scale_dtype(spec)),
            new((M if want_mixed else 0, h), F32))


@torch.library.custom_op("k3gen::attn_res", mutates_args=("src",))
def attn_res(handle: str, src: torch.Tensor, n: int, query: torch.Tensor, norm_w: torch.Tensor,
             delta: Optional[torch.Tensor], seal: bool, want_mixed: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor, torch.Tensor]:
    spec = spec_of(handle, "attn_res")
    M = check_attn_res(spec, src, n, query, norm_w, delta, seal)
    out, codes, scales, mixed = _fresh(spec, M, want_mixed, lambda s, d: torch.empty(s, dtype=d, device=src.device))
    _attn_res(handle, spec, src, n, query, norm_w, delta, seal, codes if spec.fp8 else None,
              scales if spec.fp8 else None, mixed if want_mixed else None, out)
    return out, codes, scales, mixed


@attn_res.register_fake
def _(handle, src, n, query, norm_w, delta, seal, want_mixed):
    spec = spec_of(handle, "attn_res")
    M = check_attn_res(spec, src, n, query, norm_w, delta, seal)
    return _fresh(spec, M, want_mixed, lambda s, d: src.new_empty(s, dtype=d))
