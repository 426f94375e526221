"""`k3gen::kv_cache_write`, `k3gen::mla_decode[_out]`, `k3gen::mla_q_absorb[_out]`,
`k3gen::mla_vb_gate[_out]` (contracts: the ops' spec.py).

A KV cache is passed as a list of tensors in its KvLayout's order (`spec.layout.tensors()`);
kv_cache_write declares every one mutated (the NVFP4 HP tail ring included). mla_decode's split
count is a plan-time choice passed as `splits` (k3gen.api.mla_decode_plan), with its FP32
workspace (declared mutated) or, when None, a workspace the call allocates.

CUDA tensors launch the generated kernels of the handle's spec; CPU tensors run the FP32 references.
"""
from __future__ import annotations

from typing import Optional

import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import KvDtype
from k3gen.ir.layouts import MLA_LATENT, MLA_ROW
from k3gen.library.gemm import scale_dtype
from k3gen.library.meta import at_least, check_cache, same_device, want
from k3gen.library.table import launcher, spec_of

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
Q_LORA, NOPE, QK_HEAD, OUT_HEAD, V_HEAD = 1536, 128, 192, 576, 128
MAX_SPLITS = 65535


def _ring(spec, ring_slot, B) -> None:
    if spec.kv is KvDtype.NVFP4:
        if ring_slot is None:
            raise SpecError("ring_slot", None, f"int32 [{B}]", "NVFP4 KV keeps an HP tail ring per sequence")
        want("ring_slot", ring_slot, I32, (B,))


def _cache_dict(spec, cache) -> dict:
    return dict(zip(spec.layout.tensors(), cache))


# -- kv_cache_write --------------------------------------------------------------------------------
def check_kv_write(spec, rows, cu_rows, start_pos, block_table, cache, ring_slot, max_rows_per_seq):
    want("rows", rows, BF16, (None, MLA_ROW))
    want("start_pos", start_pos, I32, (None,))
    B = start_pos.shape[0]
    want("cu_rows", cu_rows, I32, (B + 1,))
    want("block_table", block_table, I32, (None, None), contiguous=False, inner_unit=True)
    at_least("block_table.shape[0]", block_table.shape[0], B, "one row per sequence")
    check_cache(spec, cache)
    _ring(spec, ring_slot, B)
    at_least("max_rows_per_seq", max_rows_per_seq, 0, "the most rows one sequence appends (a plan-time bound)")
    same_device(("rows", rows), ("cu_rows", cu_rows), ("start_pos", start_pos), ("block_table", block_table),
                ("ring_slot", ring_slot), *[(f"cache[{i}]", t) for i, t in enumerate(cache)])


@torch.library.custom_op("k3gen::kv_cache_write", mutates_args=("cache",))
def kv_cache_write(handle: str, rows: torch.Tensor, cu_rows: torch.Tensor, start_pos: torch.Tensor,
                   block_table: torch.Tensor, cache: list[torch.Tensor], ring_slot: Optional[torch.Tensor],
                   scale: float, max_rows_per_seq: int) -> None:
    spec = spec_of(handle, "kv_cache_write")
    check_kv_write(spec, rows, cu_rows, start_pos, block_table, cache, ring_slot, max_rows_per_seq)
    ring = ring_slot if spec.kv is KvDtype.NVFP4 else None
    if rows.device.type == "cuda":
        launcher(handle, "kv_cache_write")(rows, cu_rows, start_pos, block_table, _cache_dict(spec, cache),
                                           ring_slot=ring, scale=scale, max_rows_per_seq=max_rows_per_seq)
        return
    from k3gen.ops.kv_cache_write.reference import kv_cache_write as ref
    ref(spec.layout, _cache_dict(spec, cache), rows, cu_rows, start_pos, block_table, ring, scale)


@kv_cache_write.register_fake
def _(handle, rows, cu_rows, start_pos, block_table, cache, ring_slot, scale, max_rows_per_seq):
    check_kv_write(spec_of(handle, "kv_cache_write"), rows, cu_rows, start_pos, block_table, cache, ring_slot,
                   max_rows_per_seq)


# -- mla_decode ------------------------------------------------------------------------------------
def check_decode(spec, q, cache, block_table, lengths, ring_slot, splits, part_o, part_lse, out=None):
    T, H = spec.tokens, spec.heads
    want("lengths", lengths, I32, (None,))
    B = lengths.shape[0]
    want("q", q, BF16, (B, T, H, MLA_ROW))
    want("block_table", block_table, I32, (None, None), contiguous=False, inner_unit=True)
    at_least("block_table.shape[0]", block_table.shape[0], B, "one row per sequence")
    check_cache(spec, cache)
    _ring(spec, ring_slot, B)
    if not 1 <= splits <= MAX_SPLITS:
        raise SpecError("splits", splits, f"1..{MAX_SPLITS}", "from k3gen.api.mla_decode_plan")
    if (part_o is None) != (part_lse is None):
        raise SpecError("part_o/part_lse", (part_o is not None, part_lse is not None), "both or neither")
    if part_o is not None:
        want("part_o", part_o, F32, (None, splits, T * H, MLA_LATENT))
        want("part_lse", part_lse, F32, (part_o.shape[0], splits, T * H))
        at_least("part_o.shape[0]", part_o.shape[0], B, "a workspace planned for the largest batch")
    if out is not None:
        want("out", out, BF16, (B, T, H, MLA_LATENT))
    same_device(("q", q), ("block_table", block_table), ("lengths", lengths), ("ring_slot", ring_slot),
                ("part_o", part_o), ("part_lse", part_lse), ("out", out),
                *[(f"cache[{i}]", t) for i, t in enumerate(cache)])
    return B


def _decode(handle, spec, q, cache, block_table, lengths, ring_slot, scale, splits, part_o, part_lse, out) -> None:
    ring = ring_slot if spec.kv is KvDtype.NVFP4 else None
    if out.device.type == "cuda":
        from k3gen.ops.mla_decode.launcher import SplitPlan
        B, ht = q.shape[0], spec.tokens * spec.heads
        if splits > 1 and part_o is None:
            part_o = torch.empty(B, splits, ht, MLA_LATENT, dtype=F32, device=q.device)
            part_lse = torch.empty(B, splits, ht, dtype=F32, device=q.device)
        plan = SplitPlan(B if part_o is None else part_o.shape[0], 0, splits,
                         part_o if splits > 1 else None, part_lse if splits > 1 else None)
        launcher(handle, "mla_decode")(q, _cache_dict(spec, cache), block_table, lengths, out, ring_slot=ring,
                                       scale=scale, plan=plan)
        return
    from k3gen.ops.mla_decode.reference import mla_decode as ref
    out.copy_(ref(spec.layout, _cache_dict(spec, cache), q, block_table, lengths, ring_slot=ring,
                  scale=scale).to(BF16))


@torch.library.custom_op("k3gen::mla_decode_out", mutates_args=("part_o", "part_lse", "out"))
def mla_decode_out(handle: str, q: torch.Tensor, cache: list[torch.Tensor], block_table: torch.Tensor,
                   lengths: torch.Tensor, ring_slot: Optional[torch.Tensor], scale: float, splits: int,
                   part_o: Optional[torch.Tensor], part_lse: Optional[torch.Tensor], out: torch.Tensor) -> None:
    spec = spec_of(handle, "mla_decode")
    check_decode(spec, q, cache, block_table, lengths, ring_slot, splits, part_o, part_lse, out)
    _decode(handle, spec, q, cache, block_table, lengths, ring_slot, scale, splits, part_o, part_lse, out)


@mla_decode_out.register_fake
def _(handle, q, cache, block_table, lengths, ring_slot, scale, splits, part_o, part_lse, out):
    check_decode(spec_of(handle, "mla_decode"), q, cache, block_table, lengths, ring_slot, splits, part_o,
                 part_lse, out)


@torch.library.custom_op("k3gen::mla_decode", mutates_args=("part_o", "part_lse"))
def mla_decode(handle: str, q: torch.Tensor, cache: list[torch.Tensor], block_table: torch.Tensor,
               lengths: torch.Tensor, ring_slot: Optional[torch.Tensor], scale: float, splits: int,
               part_o: Optional[torch.Tensor], part_lse: Optional[torch.Tensor]) -> torch.Tensor:
    spec = spec_of(handle, "mla_decode")
    B = check_decode(spec, q, cache, block_table, lengths, ring_slot, splits, part_o, part_lse)
    out = torch.empty(B, spec.tokens, spec.heads, MLA_LATENT, dtype=BF16, device=q.device)
    _decode(handle, spec, q, cache, block_table, lengths, ring_slot, scale, splits, part_o, part_lse, out)
    return out


@mla_decode.register_fake
def _(handle, q, cache, block_table, lengths, ring_slot, scale, splits, part_o, part_lse):
    spec = spec_of(handle, "mla_decode")
    B = check_decode(spec, q, cache, block_table, lengths, ring_slot, splits, part_o, part_lse)
    return q.new_empty(B, spec.tokens, spec.heads, MLA_LATENT, dtype=BF16)


# -- mla_q_absorb ----------------------------------------------------------------------------------
def _head_weights(name, w, heads, rows) -> None:
    want(name, w, BF16, (heads, rows, MLA_LATENT), contiguous=False, inner_unit=True)
    if w.shape[1] > 1 and w.stride(1) != MLA_LATENT:
        raise SpecError(f"{name}.stride", tuple(w.stride()), f"(*, {MLA_LATENT}, 1)", "rows contiguous")


def check_q_absorb(spec, q_a, norm_w, wqb_codes, wqb_scales, w_uk, out=None):
    H = spec.heads
    B = q_a.shape[0] if q_a.dim() == 2 else -1
    want("q_a", q_a, BF16, (B, None), contiguous=False, inner_unit=True)
    at_least("q_a.shape[1]", q_a.shape[1], Q_LORA, "the q_a columns come first")
    want("norm_w", norm_w, BF16, (Q_LORA,))
    g = spec.gemm_spec
    want("wqb_codes", wqb_codes, torch.uint8, (g.n, g.k))
    want("wqb_scales", wqb_scales, scale_dtype(spec), (g.n_blocks, g.k_blocks))
    _head_weights("w_uk", w_uk, H, NOPE)
    if out is not None:
        want("out", out, BF16, (B, H, OUT_HEAD))
    same_device(("q_a", q_a), ("norm_w", norm_w), ("wqb_codes", wqb_codes), ("wqb_scales", wqb_scales),
                ("w_uk", w_uk), ("out", out))
    return B


def _q_absorb(handle, spec, q_a, norm_w, wqb_codes, wqb_scales, w_uk, out) -> None:
    if out.device.type == "cuda":
        op = launcher(handle, "mla_q_absorb")
        op(q_a, norm_w, wqb_codes, wqb_scales, w_uk, out, workspace=op.workspace(q_a.shape[0], q_a.device))
        return
    from k3gen.ops.mla_q_absorb.reference import mla_q_absorb as ref
    out.copy_(ref(q_a, norm_w, wqb_codes, wqb_scales, w_uk, spec.recipe, spec.eps).to(BF16))


@torch.library.custom_op("k3gen::mla_q_absorb_out", mutates_args=("out",))
def mla_q_absorb_out(handle: str, q_a: torch.Tensor, norm_w: torch.Tensor, wqb_codes: torch.Tensor,
                     wqb_scales: torch.Tensor, w_uk: torch.Tensor, out: torch.Tensor) -> None:
    spec = spec_of(handle, "mla_q_absorb")
    check_q_absorb(spec, q_a, norm_w, wqb_codes, wqb_scales, w_uk, out)
    _q_absorb(handle, spec, q_a, norm_w, wqb_codes, wqb_scales, w_uk, out)


@mla_q_absorb_out.register_fake
def _(handle, q_a, norm_w, wqb_codes, wqb_scales, w_uk, out):
    check_q_absorb(spec_of(handle, "mla_q_absorb"), q_a, norm_w, wqb_codes, wqb_scales, w_uk, out)


@torch.library.custom_op("k3gen::mla_q_absorb", mutates_args=())
def mla_q_absorb(handle: str, q_a: torch.Tensor, norm_w: torch.Tensor, wqb_codes: torch.Tensor,
                 wqb_scales: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    spec = spec_of(handle, "mla_q_absorb")
    B = check_q_absorb(spec, q_a, norm_w, wqb_codes, wqb_scales, w_uk)
    out = torch.empty(B, spec.heads, OUT_HEAD, dtype=BF16, device=q_a.device)
    _q_absorb(handle, spec, q_a, norm_w, wqb_codes, wqb_scales, w_uk, out)
    return out


@mla_q_absorb.register_fake
def _(handle, q_a, norm_w, wqb_codes, wqb_scales, w_uk):
    spec = spec_of(handle, "mla_q_absorb")
    B = check_q_absorb(spec, q_a, norm_w, wqb_codes, wqb_scales, w_uk)
    return q_a.new_empty(B, spec.heads, OUT_HEAD, dtype=BF16)


# -- mla_vb_gate -----------------------------------------------------------------------------------
def check_vb_gate(spec, o_lat, w_uv, gate, out=None):
    H = spec.heads
    B = o_lat.shape[0] if o_lat.dim() == 3 else -1
    want("o_lat", o_lat, BF16, (B, H, MLA_LATENT))
    _head_weights("w_uv", w_uv, H, V_HEAD)
    want("gate", gate, BF16, (B, None), contiguous=False, inner_unit=True)
    at_least("gate.shape[1]", gate.shape[1], H * V_HEAD, "the gate slice of the A projection")
    if out is not None:
        want("out", out, BF16, (B, H, V_HEAD))
    same_device(("o_lat", o_lat), ("w_uv", w_uv), ("gate", gate), ("out", out))
    return B


def _vb_gate(handle, spec, o_lat, w_uv, gate, out) -> None:
    if out.device.type == "cuda":
        launcher(handle, "mla_vb_gate")(o_lat, w_uv, gate, out)
        return
    from k3gen.ops.mla_vb_gate.reference import mla_vb_gate as ref
    out.copy_(ref(o_lat, w_uv, gate).to(BF16))


@torch.library.custom_op("k3gen::mla_vb_gate_out", mutates_args=("out",))
def mla_vb_gate_out(handle: str, o_lat: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor,
                    out: torch.Tensor) -> None:
    spec = spec_of(handle, "mla_vb_gate")
    check_vb_gate(spec, o_lat, w_uv, gate, out)
    _vb_gate(handle, spec, o_lat, w_uv, gate, out)


@mla_vb_gate_out.register_fake
def _(handle, o_lat, w_uv, gate, out):
    check_vb_gate(spec_of(handle, "mla_vb_gate"), o_lat, w_uv, gate, out)


@torch.library.custom_op("k3gen::mla_vb_gate", mutates_args=())
def mla_vb_gate(handle: str, o_lat: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    spec = spec_of(handle, "mla_vb_gate")
    B = check_vb_gate(spec, o_lat, w_uv, gate)
    out = torch.empty(B, spec.heads, V_HEAD, dtype=BF16, device=o_lat.device)
    _vb_gate(handle, spec, o_lat, w_uv, gate, out)
    return out


@mla_vb_gate.register_fake
def _(handle, o_lat, w_uv, gate):
    spec = spec_of(handle, "mla_vb_gate")
    B = check_vb_gate(spec, o_lat, w_uv, gate)
    return o_lat.new_empty(B, spec.heads, V_HEAD, dtype=BF16)


# -- mla_prefill -----------------------------------------------------------------------------------
def check_prefill(spec, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, out=None):
    from k3gen.ops.mla_prefill.spec import OutDtype
    H = spec.heads
    nq = q.shape[0] if q.dim() == 3 else -1
    nk = k_nope.shape[0] if k_nope.dim() == 3 else -1
    want("q", q, BF16, (nq, H, QK_HEAD), contiguous=False, inner_unit=True)
    want("k_nope", k_nope, BF16, (nk, H, NOPE), contiguous=False, inner_unit=True)
    want("k_pe", k_pe, BF16, (nk, QK_HEAD - NOPE), contiguous=False, inner_unit=True)
    want("v", v, BF16, (nk, H, V_HEAD), contiguous=False, inner_unit=True)
    b = cu_seqlens_q.shape[0] if cu_seqlens_q.dim() == 1 else -1
    want("cu_seqlens_q", cu_seqlens_q, I32, (b,))
    want("cu_seqlens_k", cu_seqlens_k, I32, (b,))
    at_least("cu_seqlens_q.shape[0]", b, 1, "B + 1 offsets")
    if out is not None:
        want("out", out, F32 if spec.out_dtype is OutDtype.FP32 else BF16, (nq, H, V_HEAD))
    same_device(("q", q), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                ("cu_seqlens_k", cu_seqlens_k), ("out", out))
    return nq


def _prefill_dtype(spec):
    from k3gen.ops.mla_prefill.spec import OutDtype
    return F32 if spec.out_dtype is OutDtype.FP32 else BF16


def _prefill(handle, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, out, max_seqlen_q) -> None:
    if out.device.type == "cuda":
        launcher(handle, "mla_prefill")(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, out, max_seqlen_q)
        return
    from k3gen.ops.mla_prefill.reference import mla_prefill as ref
    out.copy_(ref(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k).to(out.dtype))


@torch.library.custom_op("k3gen::mla_prefill_out", mutates_args=("out",))
def mla_prefill_out(handle: str, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                    out: torch.Tensor) -> None:
    spec = spec_of(handle, "mla_prefill")
    check_prefill(spec, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, out)
    _prefill(handle, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, out, max_seqlen_q)


@mla_prefill_out.register_fake
def _(handle, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out):
    check_prefill(spec_of(handle, "mla_prefill"), q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, out)


@torch.library.custom_op("k3gen::mla_prefill", mutates_args=())
def mla_prefill(handle: str, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int) -> torch.Tensor:
    spec = spec_of(handle, "mla_prefill")
    nq = check_prefill(spec, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k)
    out = torch.empty(nq, spec.heads, V_HEAD, dtype=_prefill_dtype(spec), device=q.device)
    _prefill(handle, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, out, max_seqlen_q)
    return out


@mla_prefill.register_fake
def _(handle, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q):
    spec = spec_of(handle, "mla_prefill")
    nq = check_prefill(spec, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k)
    return q.new_empty(nq, spec.heads, V_HEAD, dtype=_prefill_dtype(spec))
