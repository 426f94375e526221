"""`k3gen::moe_route[_out]` and `k3gen::moe_experts[_out]` (contracts: the ops' spec.py).

moe_route: logits [T, E] FP32 (unit inner stride, any row stride that is a multiple of spec.vec)
and bias [E] -> ids [T, k] int32, weights [T, k] FP32, counts [E], offsets [E + 1], perm [T k],
inv [T k] int32. The functional form returns fresh tensors of exactly T tokens; the `_out` form
writes a caller's workspace sized once for T_max >= T tokens (ids/weights [T_max, k], perm/inv
[T_max k]: the call writes the leading T rows, T k entries), all six declared mutated.

moe_experts: the launcher's `route` dict is four explicit tensors (ids, weights, offsets, perm;
counts and inv are not read) and the expert weights are the tensors model/weight_types
.ExpertWeights holds as loaded (w13, s13, w2, s2, and gs13, gs2 for NVFP4). Its intermediate
workspace (ws_h [>= T k, I] BF16, ws_y [>= T k, W] FP32, from k3gen.api.moe_experts_workspace) is
declared mutated; None: the call allocates one. The functional form returns (out [T, W] BF16,
out_f32 [T, W] FP32 with want_f32, else [0, W]); the `_out` form writes out and, when given,
out_f32. expert_base (EP: the router's number of this rank's expert 0) is a plain int.

CUDA tensors launch the generated kernels of the handle's spec; CPU tensors run the FP32 references.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.library.meta import at_least, same_device, want
from k3gen.library.table import launcher, spec_of

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
ROUTE_OUTPUTS = ("ids", "weights", "counts", "offsets", "perm", "inv")
MAX_SLOTS = 2 ** 31     # 32-bit slot indices (both ops)
MAX_GRID_Y = 65535


# -- moe_route -------------------------------------------------------------------------------------
def check_route(spec, logits, bias, ws=None):
    """Returns T. `ws`: the six _out buffers in ROUTE_OUTPUTS order (or None)."""
    E, k = spec.experts, spec.top_k
    T = logits.shape[0] if isinstance(logits, torch.Tensor) and logits.dim() == 2 else -1
    want("logits", logits, F32, (T, E), contiguous=False, inner_unit=True)
    if logits.stride(0) % spec.vec:
        raise SpecError("logits.stride", tuple(logits.stride()), f"(multiple of {spec.vec}, 1)",
                        "whole 16-byte row loads (E a multiple of 128)")
    if T * k >= MAX_SLOTS:
        raise SpecError("logits.shape[0]", T, f"< {MAX_SLOTS // k}", "32-bit slot indices")
    want("bias", bias, F32, (E,))
    named = [("logits", logits), ("bias", bias)]
    if ws is not None:
        ids, weights, counts, offsets, perm, inv = ws
        want("ids", ids, I32, (None, k))
        at_least("ids.shape[0]", ids.shape[0], T, "a workspace sized for the most tokens (T_max)")
        n = ids.shape[0]
        want("weights", weights, F32, (n, k))
        want("counts", counts, I32, (E,))
        want("offsets", offsets, I32, (E + 1,))
        want("perm", perm, I32, (n * k,))
        want("inv", inv, I32, (n * k,))
        named += list(zip(ROUTE_OUTPUTS, ws))
    same_device(*named)
    return T


def _route(handle, spec, logits, bias, ws) -> None:
    if logits.device.type == "cuda":
        launcher(handle, "moe_route")(logits, bias, dict(zip(ROUTE_OUTPUTS, ws)))
        return
    from k3gen.ops.moe_route.reference import route_spec
    r = route_spec(spec, logits, bias)
    T, k = logits.shape[0], spec.top_k
    ids, weights, counts, offsets, perm, inv = ws
    ids[:T].copy_(r.ids)
    weights[:T].copy_(r.weights)
    counts.copy_(r.counts)
    offsets.copy_(r.offsets)
    perm[:T * k].copy_(r.perm)
    inv[:T * k].copy_(r.inv)


def _route_fresh(spec, T, new):
    E, k = spec.experts, spec.top_k
    return (new((T, k), I32), new((T, k), F32), new((E,), I32), new((E + 1,), I32), new((T * k,), I32),
            new((T * k,), I32))


@torch.library.custom_op("k3gen::moe_route_out", mutates_args=ROUTE_OUTPUTS)
def moe_route_out(handle: str, logits: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  counts: torch.Tensor, offsets: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> None:
    spec = spec_of(handle, "moe_route")
    ws = (ids, weights, counts, offsets, perm, inv)
    check_route(spec, logits, bias, ws)
    _route(handle, spec, logits, bias, ws)


@moe_route_out.register_fake
def _(handle, logits, bias, ids, weights, counts, offsets, perm, inv):
    check_route(spec_of(handle, "moe_route"), logits, bias, (ids, weights, counts, offsets, perm, inv))


@torch.library.custom_op("k3gen::moe_route", mutates_args=())
def moe_route(handle: str, logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor, torch.Tensor,
                                                                              torch.Tensor, torch.Tensor]:
    spec = spec_of(handle, "moe_route")
    T = check_route(spec, logits, bias)
    ws = _route_fresh(spec, T, lambda s, d: torch.empty(s, dtype=d, device=logits.device))
    _route(handle, spec, logits, bias, ws)
    return ws


@moe_route.register_fake
def _(handle, logits, bias):
    spec = spec_of(handle, "moe_route")
    T = check_route(spec, logits, bias)
    return _route_fresh(spec, T, lambda s, d: logits.new_empty(s, dtype=d))


# -- moe_experts -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def max_tokens(spec) -> int:
    """The most tokens one call takes: the expert GEMMs' grid.y (spec.max_items) and 32-bit slots
    (the launcher's bound, computed from the spec alone: no cubin needed)."""
    t = 1
    while spec.max_items(2 * t) <= MAX_GRID_Y and 2 * t * spec.top_k < MAX_SLOTS:
        t *= 2
    return t


def _scale_bytes(name, t, shape) -> None:
    """E4M3 / UE8M0 scale bytes, stored as uint8 or float8_e4m3fn (as the loaders keep them)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise SpecError(f"{name}.dtype", str(getattr(t, "dtype", type(t).__name__)), ["uint8", "float8_e4m3fn"],
                        "scale bytes")
    want(name, t, t.dtype, shape)


def check_experts(spec, x, w13, s13, w2, s2, ids, weights, offsets, perm, gs13, gs2, x_scales, expert_base, ws_h,
                  ws_y, out_f32=None, out=None):
    """Returns T."""
    from k3gen.ops.moe_experts.spec import ActFormat, WeightFormat
    E, W, I, k, R, g = spec.experts, spec.hidden, spec.inter, spec.top_k, spec.route_experts, spec.group
    T = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else -1
    if spec.act is ActFormat.BF16:
        want("x", x, BF16, (T, W))
        if x_scales is not None:
            raise SpecError("x_scales", "a tensor", [None], "BF16 activations carry no scales")
    else:
        want("x", x, torch.uint8, (T, W))
        if x_scales is None:
            raise SpecError("x_scales", None, ["a tensor"], "FP8 activations need their scales (act_quant_fp8)")
        want("x_scales", x_scales, F32 if spec.recipe is ScaleRecipe.FP32 else torch.uint8, (T, W // 128))
    want("w13", w13, torch.uint8, (E, 2 * I, W // 2))
    want("w2", w2, torch.uint8, (E, W, I // 2))
    _scale_bytes("s13", s13, (E, 2 * I, W // g))
    _scale_bytes("s2", s2, (E, W, I // g))
    if spec.weights is WeightFormat.NVFP4:
        if gs13 is None or gs2 is None:
            raise SpecError("gs13/gs2", None, ["FP32 tensors"], "NVFP4 experts need their global scales")
        want("gs13", gs13, F32, (E, 2))
        want("gs2", gs2, F32, (E, 1))
    elif gs13 is not None or gs2 is not None:
        raise SpecError("gs13/gs2", "a tensor", [None], "MXFP4 experts have no global scales")
    want("ids", ids, I32, (T, k))
    want("weights", weights, F32, (T, k))
    want("offsets", offsets, I32, (R + 1,))
    want("perm", perm, I32, (T * k,))
    if isinstance(expert_base, bool) or not 0 <= expert_base <= R - E:
        raise SpecError("expert_base", expert_base, f"0..{R - E}", f"experts [base, base + {E}) of the router's {R}")
    if (ws_h is None) != (ws_y is None):
        raise SpecError("ws_h/ws_y", (ws_h is not None, ws_y is not None), "both or neither")
    if ws_h is not None:
        want("ws_h", ws_h, BF16, (None, I))
        at_least("ws_h.shape[0]", ws_h.shape[0], T * k, "T * top_k slots (moe_experts_workspace(max_tokens))")
        want("ws_y", ws_y, F32, (ws_h.shape[0], W))
    if T > max_tokens(spec):
        raise SpecError("x.shape[0]", T, f"<= {max_tokens(spec)}", "grid.y of the expert GEMMs")
    if out_f32 is not None:
        want("out_f32", out_f32, F32, (T, W))
    if out is not None:
        want("out", out, BF16, (T, W))
    same_device(("x", x), ("w13", w13), ("s13", s13), ("w2", w2), ("s2", s2), ("ids", ids), ("weights", weights),
                ("offsets", offsets), ("perm", perm), ("gs13", gs13), ("gs2", gs2), ("x_scales", x_scales),
                ("ws_h", ws_h), ("ws_y", ws_y), ("out_f32", out_f32), ("out", out))
    return T


def _experts(handle, spec, x, w13, s13, w2, s2, ids, weights, offsets, perm, gs13, gs2, x_scales, expert_base, ws_h,
             ws_y, out_f32, out) -> None:
    if out.device.type == "cuda":
        n = x.shape[0] * spec.top_k
        if ws_h is None:
            ws_h = torch.empty(n, spec.inter, dtype=BF16, device=out.device)
            ws_y = torch.empty(n, spec.hidden, dtype=F32, device=out.device)
        route = {"ids": ids, "weights": weights, "offsets": offsets, "perm": perm}
        launcher(handle, "moe_experts")(x, w13, s13, w2, s2, route, out, gs13=gs13, gs2=gs2, x_scales=x_scales,
                                        out_f32=out_f32, ws={"h": ws_h, "y": ws_y}, expert_base=expert_base)
        return
    from k3gen.ops.moe_experts.reference import moe_experts as ref
    o, o32 = ref(spec, x, w13, s13, w2, s2, ids, weights, gs13=gs13, gs2=gs2, x_scales=x_scales,
                 expert_base=expert_base)
    out.copy_(o)
    if out_f32 is not None:
        out_f32.copy_(o32)


@torch.library.custom_op("k3gen::moe_experts_out", mutates_args=("ws_h", "ws_y", "out_f32", "out"))
def moe_experts_out(handle: str, x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                    s2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                    perm: torch.Tensor, gs13: Optional[torch.Tensor], gs2: Optional[torch.Tensor],
                    x_scales: Optional[torch.Tensor], expert_base: int, ws_h: Optional[torch.Tensor],
                    ws_y: Optional[torch.Tensor], out_f32: Optional[torch.Tensor], out: torch.Tensor) -> None:
    spec = spec_of(handle, "moe_experts")
    args = (x, w13, s13, w2, s2, ids, weights, offsets, perm, gs13, gs2, x_scales, expert_base, ws_h, ws_y)
    check_experts(spec, *args, out_f32, out)
    _experts(handle, spec, *args, out_f32, out)


@moe_experts_out.register_fake
def _(handle, x, w13, s13, w2, s2, ids, weights, offsets, perm, gs13, gs2, x_scales, expert_base, ws_h, ws_y,
      out_f32, out):
    check_experts(spec_of(handle, "moe_experts"), x, w13, s13, w2, s2, ids, weights, offsets, perm, gs13, gs2,
                  x_scales, expert_base, ws_h, ws_y, out_f32, out)


@torch.library.custom_op("k3gen::moe_experts", mutates_args=("ws_h", "ws_y"))
def moe_experts(handle: str, x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                s2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, perm: torch.Tensor,
                gs13: Optional[torch.Tensor], gs2: Optional[torch.Tensor], x_scales: Optional[torch.Tensor],
                expert_base: int, ws_h: Optional[torch.Tensor], ws_y: Optional[torch.Tensor],
                want_f32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    spec = spec_of(handle, "moe_experts")
    args = (x, w13, s13, w2, s2, ids, weights, offsets, perm, gs13, gs2, x_scales, expert_base, ws_h, ws_y)
    T = check_experts(spec, *args)
    out = torch.empty(T, spec.hidden, dtype=BF16, device=x.device)
    out_f32 = torch.empty(T if want_f32 else 0, spec.hidden, dtype=F32, device=x.device)
    _experts(handle, spec, *args, out_f32 if want_f32 else None, out)
    return out, out_f32


@moe_experts.register_fake
def _(handle, x, w13, s13, w2, s2, ids, weights, offsets, perm, gs13, gs2, x_scales, expert_base, ws_h, ws_y,
      want_f32):
    spec = spec_of(handle, "moe_experts")
    T = check_experts(spec, x, w13, s13, w2, s2, ids, weights, offsets, perm, gs13, gs2, x_scales, expert_base,
                      ws_h, ws_y)
    return x.new_empty(T, spec.hidden, dtype=BF16), x.new_empty(T if want_f32 else 0, spec.hidden, dtype=F32)
