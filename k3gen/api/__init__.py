"""k3gen's public op API: one function per fused op, over the `k3gen::` torch.library ops.

The stable surface an engine calls (the README's "Using k3gen from your engine"). Each function
takes the kernel first: an OpSpec, or its handle from `prepare(spec)` (a `str`, the spec's
canonical JSON; pass handles inside torch.compile, where building a spec's JSON would be traced).
The kernel is chosen when the spec is built (its variant, schedule and formats are fields);
nothing is autotuned at call time. Every call is CUDA-graph safe on CUDA tensors once the kernel
is prepared: no allocation beyond the outputs (and workspaces the docstring names), no host sync.
CPU tensors run the op's FP32 reference (same contract, slow).

Conventions: D = heads * 128; "BF16 [B, >= 4D] rows" accept any row stride with unit inner stride;
every other tensor is contiguous. `out=` writes a caller-owned buffer (what a CUDA graph or an
engine's preallocated workspace wants) and returns it. Bad arguments raise SpecError
(k3gen.errors) naming the argument, its value and what is allowed.

This module is named `k3gen.api` because `k3gen.ops` is the op-definition package (one folder per
op: spec, variants, template, reference, launcher; docs/DESIGN.md).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

import k3gen.library  # noqa: F401  (registers the k3gen:: ops)
from k3gen.errors import SpecError
from k3gen.library import meta
from k3gen.library.table import as_handle, handle_of, launcher, spec_of

__all__ = ["prepare", "spec_of", "act_quant_fp8", "fp8_block_gemm", "fp8_linear", "kda_decode", "kda_prefill",
           "kda_verify", "kda_commit", "kv_cache_write", "MlaDecodePlan", "mla_decode_plan", "mla_decode",
           "mla_q_absorb", "mla_vb_gate"]

ops = torch.ops.k3gen


def prepare(spec, *, load: bool | None = None) -> str:
    """The handle of `spec`; with `load` (default: when CUDA is available) its cubin is resolved
    (K3GEN_PREBUILT bundle, cache, then JIT unless K3GEN_DISABLE_JIT) and loaded now, as it must
    be before any CUDA-graph capture or torch.compile(mode="reduce-overhead") run."""
    h = handle_of(spec)
    if load is None:
        load = torch.cuda.is_available()
    if load:
        launcher(h)
    return h


def _h(kernel) -> str:
    if isinstance(kernel, str):
        return kernel
    from k3gen.ir.spec import OpSpec
    if not isinstance(kernel, OpSpec):
        raise SpecError("kernel", type(kernel).__name__, "an OpSpec or its handle from k3gen.api.prepare")
    return as_handle(kernel)


# -- FP8 projections -------------------------------------------------------------------------------
def act_quant_fp8(kernel, x, *, codes=None, scales=None):
    """Per-token, per-128-column E4M3 quantization (spec act_quant_fp8, K = spec.k).

    x [M, K] BF16 -> (codes [M, K] uint8 E4M3 bytes, scales [M, K/128]: float32 for the FP32
    recipe, uint8 UE8M0 bytes for UE8M0). With `codes` and `scales` given, writes them."""
    h = _h(kernel)
    if codes is None and scales is None:
        return ops.act_quant_fp8(h, x)
    if codes is None or scales is None:
        raise SpecError("codes/scales", (codes is None, scales is None), "both or neither")
    ops.act_quant_fp8_out(h, x, codes, scales)
    return codes, scales


def fp8_block_gemm(kernel, x_codes, x_scales, w_codes, w_scales, *, out=None):
    """out [M, N] BF16 = dequant(x) @ dequant(W)^T with FP8 block scales (spec fp8_block_gemm:
    N, K static, M any). x_codes [M, K] uint8, x_scales [M, K/128] (act_quant_fp8's), w_codes
    [N, K] uint8, w_scales [ceil(N/128), ceil(K/128)] per 128x128 tile; scales of the spec's recipe."""
    h = _h(kernel)
    if out is None:
        return ops.fp8_block_gemm(h, x_codes, x_scales, w_codes, w_scales)
    ops.fp8_block_gemm_out(h, x_codes, x_scales, w_codes, w_scales, out)
    return out


def fp8_linear(quant, gemm, x, w_codes, w_scales):
    """x [M, K] BF16 through act_quant_fp8 (`quant`) and fp8_block_gemm (`gemm`): [M, N] BF16."""
    codes, scales = act_quant_fp8(quant, x)
    return fp8_block_gemm(gemm, codes, scales, w_codes, w_scales)


# -- KDA -------------------------------------------------------------------------------------------
def kda_decode(kernel, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w, *, out=None):
    """One KDA decode step (spec kda_decode) for B = slots.shape[0] sequences: short conv + SiLU,
    q/k L2 norm, f_b projection and forget gate, the delta rule, o = S^T q, gated RMSNorm.

    qkvg [B, >= 4D] BF16 rows [q | k | v | g_out] (raw, pre-conv), fa [B, 128] BF16 (f_a output),
    beta_logit [B, H] BF16 (rows of a [f_a | b] projection may be views); slots [B] int32 (negative:
    padding, zeros out, nothing touched). Weights: conv_w [3D, 4] BF16 (tap 0 oldest), fb_w
    [D, 128] BF16, dt_bias [D], a_log [H], norm_w [128] FP32. Mutates in place at slots[b]: ssm
    [S, H, 128(V), 128(K)] (spec.ssm dtype; V-first, i.e. S^T, FLA's state_v_first layout) and
    conv [S, 3D, 3] BF16 (last 3 raw inputs, oldest first). Returns out [B, H, 128] BF16."""
    h = _h(kernel)
    if out is None:
        return ops.kda_decode(h, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w)
    ops.kda_decode_out(h, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w, out)
    return out


def kda_prefill(kernel, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, conv_w, fb_w, dt_bias, a_log,
                norm_w, *, out=None):
    """The prompt tokens of a varlen batch through the fused KDA step (spec kda_prefill).

    qkvg [N, >= 4D], fa [N, 128], beta_logit [N, H] BF16 rows as kda_decode; cu_seqlens [B + 1]
    int32 (0 .. N, non-decreasing), slots [B] int32, resume [B] int32 (non-zero: continue from the
    slot's state and conv window; zero: start from S = 0). Mutates ssm and conv at slots (the state
    once, after the last token). Weights as kda_decode. Returns out [N, H, 128] BF16."""
    h = _h(kernel)
    args = (qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, conv_w, fb_w, dt_bias, a_log, norm_w)
    if out is None:
        return ops.kda_prefill(h, *args)
    ops.kda_prefill_out(h, *args, out)
    return out


def kda_verify(kernel, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, conv_w, fb_w, dt_bias, a_log,
               norm_w, *, out=None):
    """The speculative verify step (spec kda_verify, M = spec.drafts, T = 1 + M tokens per sequence).

    Row b * T + t of qkvg [B*T, >= 4D], fa [B*T, 128], beta_logit [B*T, H] is token t of sequence b
    (the golden token, then M drafts). Starts from ssm[s] (pending[s] == 0) or draft_rec[s, P - 1]
    (P = pending[s], read only). Mutates at slots: ssm [S, H, 128, 128] (state after the golden
    token), draft_rec [S, M, H, 128, 128] FP32 (after each draft), conv_ext [S, 3D, 3 + M] FP32
    (raw conv inputs). After sampling call kda_commit. Returns out [B, T, H, 128] BF16."""
    h = _h(kernel)
    args = (qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, conv_w, fb_w, dt_bias, a_log, norm_w)
    if out is None:
        return ops.kda_verify(h, *args)
    ops.kda_verify_out(h, *args, out)
    return out


def kda_commit(pending, slots, accepted) -> None:
    """After a verify step: pending[slots[b]] = accepted[b] - 1 (clamped at 0), accepted [B] the
    tokens kept of each row's 1 + M (golden included). Torch ops on the device, no kernel."""
    from k3gen.ops.kda_verify.reference import commit
    commit(pending, slots, accepted)


# -- MLA -------------------------------------------------------------------------------------------
def kv_cache_write(kernel, rows, cu_rows, start_pos, block_table, cache, *, max_rows_per_seq: int,
                   ring_slot=None, scale: float = 1.0) -> None:
    """Append MLA cache rows to the paged KV cache in place (spec kv_cache_write: its KvLayout).

    rows [N, 576] BF16 ([RMSNorm(c_kv) 512 | k_pe 64]); sequence b owns rows cu_rows[b] ..
    cu_rows[b+1]-1 ([B + 1] int32), written at positions start_pos[b] + i ([B] int32); page
    block_table[b, p // page] ([>= B, pages] int32, unit inner stride). `cache`: the layout's
    tensors (a dict by name, or a list in `spec.layout.tensors()` order), all mutated; NVFP4 also
    needs ring_slot [B] int32 (its HP tail ring row). `scale`: the FP8 per-tensor scale or the
    NVFP4 global scale G. `max_rows_per_seq` bounds the rows of one sequence (a plan-time int: the
    kernel's grid, no host sync)."""
    h = _h(kernel)
    if isinstance(max_rows_per_seq, bool) or not isinstance(max_rows_per_seq, (int, torch.SymInt)):
        raise SpecError("max_rows_per_seq", max_rows_per_seq, "an int (plan time)", "no host sync in the call")
    ops.kv_cache_write(h, rows, cu_rows, start_pos, block_table, meta.cache_list(h, cache), ring_slot,
                       float(scale), max_rows_per_seq)


class MlaDecodePlan(NamedTuple):
    """mla_decode's split count and FP32 split workspace (None with one split), for batches of up
    to part_o.shape[0] sequences; a captured graph keeps the workspace it was captured with."""
    splits: int
    part_o: Optional[torch.Tensor] = None     # [batch, splits, T*H, 512] FP32
    part_lse: Optional[torch.Tensor] = None   # [batch, splits, T*H] FP32


def mla_decode_plan(kernel, batch: int, max_len: int, *, splits: int | None = None, device=None) -> MlaDecodePlan:
    """Plan mla_decode for up to `batch` sequences of up to `max_len` tokens: the split count
    (from the batch shape and the SM count only, so a graph stays valid for any lengths) and its
    workspace. Call outside capture. On a machine without CUDA the plan is one split (the CPU
    reference does not split)."""
    h = _h(kernel)
    spec = spec_of(h, "mla_decode")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise SpecError("batch", batch, ">= 1")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return MlaDecodePlan(1 if splits is None else splits)
    p = launcher(h, "mla_decode").plan(batch, max_len, splits=splits, device=device)
    return MlaDecodePlan(p.splits, p.part_o, p.part_lse)


def mla_decode(kernel, q, cache, block_table, lengths, *, plan: MlaDecodePlan, ring_slot=None, scale: float = 1.0,
               out=None):
    """Absorbed MLA attention over the paged latent cache (spec mla_decode: T = spec.tokens query
    tokens, H = spec.heads, the cache's KvLayout).

    q [B, T, H, 576] BF16 (per head [q_lat 512 | q_pe 64]), lengths [B] int32 (cached tokens, the
    T new ones included; bottom-right causal), block_table [>= B, pages] int32, cache as
    kv_cache_write (read only), ring_slot [B] int32 for NVFP4, `scale` the FP8 per-tensor scale or
    NVFP4 G, `plan` from mla_decode_plan (its workspace is written). Returns out [B, T, H, 512] BF16."""
    h = _h(kernel)
    if not isinstance(plan, MlaDecodePlan):
        raise SpecError("plan", type(plan).__name__, "an MlaDecodePlan (k3gen.api.mla_decode_plan)",
                        "the split count is chosen at plan time")
    cl = meta.cache_list(h, cache)
    args = (h, q, cl, block_table, lengths, ring_slot, float(scale), plan.splits, plan.part_o, plan.part_lse)
    if out is None:
        return ops.mla_decode(*args)
    ops.mla_decode_out(*args, out)
    return out


def mla_q_absorb(kernel, q_a, norm_w, wqb_codes, wqb_scales, w_uk, *, out=None):
    """The MLA query path of a decode step (spec mla_q_absorb): RMSNorm(q_a) * norm_w, E4M3
    quantization, the Q-B FP8 GEMM, then per head [q_nope @ W_UK[h] (512) | q_pe (64)].

    q_a [B, >= 1536] BF16 (unit inner stride; the q_a columns first), norm_w [1536] BF16, Q-B
    codes [H*192, 1536] uint8 and block scales (spec.recipe), w_uk [H, 128, 512] BF16 (rows
    contiguous, any head stride: kv_b.view(H, 256, 512)[:, :128]). Allocates a small workspace.
    Returns out [B, H, 576] BF16."""
    h = _h(kernel)
    if out is None:
        return ops.mla_q_absorb(h, q_a, norm_w, wqb_codes, wqb_scales, w_uk)
    ops.mla_q_absorb_out(h, q_a, norm_w, wqb_codes, wqb_scales, w_uk, out)
    return out


def mla_vb_gate(kernel, o_lat, w_uv, gate, *, out=None):
    """The V-B projection and output gate (spec mla_vb_gate): out[b, h] = (o_lat[b, h] @ W_UV[h]^T)
    * sigmoid(gate[b, h*128:(h+1)*128]). o_lat [B, H, 512] BF16, w_uv [H, 128, 512] BF16 (rows
    contiguous: kv_b.view(H, 256, 512)[:, 128:]), gate [B, >= H*128] BF16 (unit inner stride).
    Returns out [B, H, 128] BF16."""
    h = _h(kernel)
    if out is None:
        return ops.mla_vb_gate(h, o_lat, w_uv, gate)
    ops.mla_vb_gate_out(h, o_lat, w_uv, gate, out)
    return out
