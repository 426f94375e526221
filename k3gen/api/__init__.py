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


# -- MoE and Attention Residuals ---------------------------------------------------------------------
__all__ += ["ROUTE_OUTPUTS", "moe_route_workspace", "moe_route", "AttnResOut", "attn_res", "moe_experts_workspace",
            "moe_experts"]
ROUTE_OUTPUTS = ("ids", "weights", "counts", "offsets", "perm", "inv")


def moe_route_workspace(kernel, max_tokens: int, *, device=None) -> dict:
    """moe_route's output buffers for up to `max_tokens` tokens (allocated once, outside capture):
    ids [T_max, k] int32, weights [T_max, k] FP32, counts [E], offsets [E + 1], perm, inv [T_max k]."""
    spec = spec_of(_h(kernel), "moe_route")
    k, E = spec.top_k, spec.experts
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 < max_tokens * k < 2 ** 31:
        raise SpecError("max_tokens", max_tokens, f"1..{(2 ** 31 - 1) // k}", "32-bit slot indices")
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    i32 = dict(dtype=torch.int32, device=device)
    return {"ids": torch.empty(max_tokens, k, **i32), "weights": torch.empty(max_tokens, k, dtype=torch.float32,
                                                                             device=device),
            "counts": torch.empty(E, **i32), "offsets": torch.empty(E + 1, **i32),
            "perm": torch.empty(max_tokens * k, **i32), "inv": torch.empty(max_tokens * k, **i32)}


def moe_route(kernel, logits, bias, *, out: dict | None = None) -> dict:
    """The noaux_tc sigmoid router and the grouped token order (spec moe_route: E experts, top_k k,
    n_group / topk_group, renormalize, routed_scale).

    logits [T, E] FP32 (unit inner stride, any row stride: a multiple of 4 when E % 128 == 0),
    bias [E] FP32 (e_score_correction_bias). Returns a dict: ids [T, k] int32 (slot j = the j-th
    pick, ties to the lower expert), weights [T, k] FP32, counts [E], offsets [E + 1] int32 (exclusive
    prefix sum), perm [T k] (grouped position -> flat slot t * k + j), inv [T k] (its inverse): what
    moe_experts takes. With `out` (moe_route_workspace(max_tokens), T <= max_tokens) writes it and
    returns its views for this call's T (the rows past T untouched)."""
    h = _h(kernel)
    if out is None:
        return dict(zip(ROUTE_OUTPUTS, ops.moe_route(h, logits, bias)))
    if not isinstance(out, dict) or set(out) != set(ROUTE_OUTPUTS):
        raise SpecError("out", sorted(out) if isinstance(out, dict) else type(out).__name__, list(ROUTE_OUTPUTS),
                        "from k3gen.api.moe_route_workspace")
    ops.moe_route_out(h, logits, bias, *(out[n] for n in ROUTE_OUTPUTS))
    T, k = logits.shape[0], out["ids"].shape[1]
    return {"ids": out["ids"][:T], "weights": out["weights"][:T], "counts": out["counts"], "offsets": out["offsets"],
            "perm": out["perm"][:T * k], "inv": out["inv"][:T * k]}


class AttnResOut(NamedTuple):
    """attn_res's results: out [M, hidden] BF16 (the normed row), codes [M, hidden] uint8 and
    scales [M, hidden/128] (act_quant_fp8 of out; [0, ...] for a spec without FP8), mixed
    [M, hidden] FP32 (the mix before the norm; None unless asked for)."""
    out: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    mixed: Optional[torch.Tensor]


def attn_res(kernel, src, n: int, query, norm_w, *, delta=None, seal: bool = False, mixed: bool = False, out=None,
             codes=None, scales=None, mixed_out=None) -> AttnResOut:
    """The Attention Residuals mix fused with the next RMSNorm and (fp8 spec) act_quant_fp8 (spec
    attn_res: hidden, max_sources, eps, fp8 / recipe, delta).

    src [>= n, >= M, hidden] FP32: the source buffer, allocated once (unit inner stride, strides
    multiples of 4); sources 0..n-1 are mixed (n a plain int <= spec.max_sources), source n-1 being
    the running partial sum. query [hidden] FP32 (res_norm.weight * res_proj), norm_w [hidden] BF16.
    A spec with delta takes delta [M, hidden] (BF16 or FP32, the spec's) and first updates source n-1
    in place: += delta, or = delta with seal=True (src is mutated). Functional form: M =
    src.shape[1] (pass src[:, :M] for fewer rows), mixed=True also returns the FP32 mix. With `out`
    [M, hidden] BF16 (and codes, scales for an fp8 spec; mixed_out optional) writes them, M =
    out.shape[0]."""
    h = _h(kernel)
    if out is None:
        if codes is not None or scales is not None or mixed_out is not None:
            raise SpecError("out", None, ["a tensor"], "codes / scales / mixed_out are written only with out=")
        o, c, s, x = ops.attn_res(h, src, n, query, norm_w, delta, bool(seal), bool(mixed))
        return AttnResOut(o, c, s, x if mixed else None)
    ops.attn_res_out(h, src, n, query, norm_w, delta, bool(seal), codes, scales, mixed_out, out)
    return AttnResOut(out, codes, scales, mixed_out)


def moe_experts_workspace(kernel, max_tokens: int, *, device=None) -> dict:
    """moe_experts' intermediate buffers for up to `max_tokens` tokens (allocated once, outside
    capture): h [T_max k, I] BF16 (the activated gate_up rows) and y [T_max k, W] FP32 (per-slot sums)."""
    spec = spec_of(_h(kernel), "moe_experts")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 < max_tokens * spec.top_k < 2 ** 31:
        raise SpecError("max_tokens", max_tokens, f"1..{(2 ** 31 - 1) // spec.top_k}", "32-bit slot indices")
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    n = max_tokens * spec.top_k
    return {"h": torch.empty(n, spec.inter, dtype=torch.bfloat16, device=device),
            "y": torch.empty(n, spec.hidden, dtype=torch.float32, device=device)}


def moe_experts(kernel, x, w13, s13, w2, s2, route: dict, *, gs13=None, gs2=None, x_scales=None, expert_base: int = 0,
                ws: dict | None = None, f32: bool = False, out=None, out_f32=None):
    """The routed experts of a MoE layer on FP4 weights as loaded (spec moe_experts: MXFP4 / NVFP4
    weights, BF16 / FP8 activations, W = hidden, I = inter, E local experts of the router's R).

    x [T, W] BF16, or E4M3 codes uint8 [T, W] with x_scales [T, W/128] (act_quant_fp8's, the spec's
    recipe). w13 uint8 [E, 2I, W/2] ([gate | up] rows, E2M1 pairs), w2 uint8 [E, W, I/2], s13 / s2
    their scale bytes (uint8 or float8_e4m3fn; [.., K/32] UE8M0 for MXFP4, [.., K/16] E4M3 for NVFP4),
    gs13 [E, 2] / gs2 [E, 1] FP32 (NVFP4 only). route: moe_route's dict (ids, weights, offsets, perm
    are read). expert_base: the router's number of local expert 0 (EP). ws: moe_experts_workspace
    (mutated; None: the call allocates one). Returns out [T, W] BF16 = sum_j weights[t, j] *
    expert(x[t]); with f32 (or out_f32 [T, W] FP32 given) (out, out_f32), the FP32 sum before
    rounding (for a TP / EP reduction). `out` [T, W] BF16 writes a caller's buffer."""
    h = _h(kernel)
    if not isinstance(route, dict) or any(n not in route for n in ("ids", "weights", "offsets", "perm")):
        raise SpecError("route", sorted(route) if isinstance(route, dict) else type(route).__name__,
                        ["ids", "weights", "offsets", "perm"], "the dict k3gen.api.moe_route returns")
    if ws is not None and (not isinstance(ws, dict) or set(ws) != {"h", "y"}):
        raise SpecError("ws", sorted(ws) if isinstance(ws, dict) else type(ws).__name__, ["h", "y"],
                        "from k3gen.api.moe_experts_workspace")
    wh, wy = (None, None) if ws is None else (ws["h"], ws["y"])
    args = (x, w13, s13, w2, s2, route["ids"], route["weights"], route["offsets"], route["perm"], gs13, gs2, x_scales,
            expert_base, wh, wy)
    if out is None:
        if out_f32 is not None:
            raise SpecError("out", None, ["a tensor"], "out_f32 is written only with out=")
        o, o32 = ops.moe_experts(h, *args, bool(f32))
        return (o, o32) if f32 else o
    ops.moe_experts_out(h, *args, out_f32, out)
    return out if out_f32 is None else (out, out_f32)


# -- prefill attention and the GLU activation --------------------------------------------------------
__all__ += ["mla_prefill", "glu_act"]


def mla_prefill(kernel, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, *, out=None):
    """Causal prefill attention of the unabsorbed MLA form (spec mla_prefill: H = spec.heads).

    q [Nq, H, 192] BF16 ([q_nope 128 | q_pe 64] per head), k_nope [Nk, H, 128], k_pe [Nk, 64] (one
    rope key shared by the heads), v [Nk, H, 128] BF16 (unit inner stride, any row and head strides);
    cu_seqlens_q / cu_seqlens_k [B + 1] int32: sequence b's queries are its last len_q keys (a cached
    prefix of len_k - len_q keys before them, bottom-right causal); `max_seqlen_q` a host int >=
    every query length (plan time: the grid). Returns out [Nq, H, 128] (the spec's out_dtype, FP32
    by default)."""
    h = _h(kernel)
    if out is None:
        return ops.mla_prefill(h, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    ops.mla_prefill_out(h, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out)
    return out


def glu_act(kernel, gu, *, codes=None, scales=None):
    """SiTU (or SiLU) of the gate half times the up half, quantized for the next FP8 GEMM (spec
    glu_act: inter = I, act, recipe): gu [M, 2I] BF16 ([gate | up]) -> codes [M, I] uint8 (E4M3),
    scales [M, I / 128] (FP32, or UE8M0 bytes). `codes=` / `scales=` write caller-owned buffers."""
    h = _h(kernel)
    if codes is None and scales is None:
        return ops.glu_act(h, gu)
    if codes is None or scales is None:
        raise SpecError("codes/scales", (codes is None, scales is None), "both or neither")
    ops.glu_act_out(h, gu, codes, scales)
    return codes, scales


# -- the MoE router's logits -------------------------------------------------------------------------
__all__ += ["router_logits"]


def router_logits(kernel, x, w, *, out=None):
    """FP32 router logits (spec router_logits: hidden = H, experts = E): x [M, H] BF16 (the FFN input
    rows), w [E, H] BF16 (the router weight) -> [M, E] FP32, every logit in the kernel's fixed
    summation order (row-invariant). `out=` writes a caller-owned buffer."""
    h = _h(kernel)
    if out is None:
        return ops.router_logits(h, x, w)
    ops.router_logits_out(h, x, w, out)
    return out
