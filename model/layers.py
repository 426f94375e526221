"""Kimi K3 layers over `Ops` (model/ops.py): KDA, MLA (absorbed decode/verify; unabsorbed
prefill writing the same cache rows), the latent MoE, the dense MLP, RMSNorm. The activation and
the router are model/arch.py's formulas.

Shapes: a step carries B sequences of T tokens each (decode T = 1, verify T = 1 + M), rows
ordered b * T + t; prefill carries N tokens of varlen sequences (cu_seqlens). The residual stream
is FP32; every projection input is BF16, a layer's input (`xn`) comes as a QAct (model/ffn_ops.py:
BF16 rows and their FP8 quantization, made by the stream's mix).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3gen.ops.mla_q_absorb.reference import rms_norm_bf16

from model import arch
from model.mla_attention import cached_prefix as mla_cached_prefix
from model.config import ModelConfig
from model.moe_torch import _mm  # noqa: F401  (FP64 products rounded to FP32: tests' row-invariant LM head)
from model.ffn_ops import QAct, bf16, rows as n_rows
from model.ops import Ops
from model.weights import DenseMlpWeights, KdaLayerWeights, MlaLayerWeights, MoeWeights

BF16 = torch.bfloat16
Q_LORA, KV_LORA, ROPE = 1536, 512, 64
KV_A_OFF = Q_LORA                 # [q_a 1536 | c_kv 512 | k_pe 64 | pad 64 | g H*128]
G_OFF = Q_LORA + 640              # without a q LoRA (a separate q_proj) the A-projection starts at c_kv
NOPE, QK_HEAD = 128, 192


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """BF16(x * rsqrt(mean(x^2) + eps) * w), math in FP32, the sum of squares row-invariant
    (k3gen.numerics.row_sum): the kernel path's torch-side norms feed verify and decode."""
    return rms_norm_bf16(x, w, eps)


@dataclass
class Step:
    """Device tensors of one decode/verify step (graph inputs are views of static buffers)."""
    slots: torch.Tensor        # [B] int32: state slot and HP tail ring of each sequence
    start: torch.Tensor        # [B] int32: position of the first token of this step
    block_table: torch.Tensor  # [B, pages] int32
    T: int
    cu_rows: torch.Tensor      # [B + 1] int32: b * T

    @property
    def B(self) -> int:
        return self.slots.shape[0]


@dataclass
class Prefill:
    """A varlen batch of prompt pieces. Sequence b's new tokens are rows cu_host[b] .. cu_host[b+1]
    - 1, at positions start_host[b] .. (a continued sequence, start > 0, has that many positions
    cached: its KDA state and conv window in the pools, its MLA latent rows in the KV pages)."""
    slots: torch.Tensor        # [B] int32
    cu_seqlens: torch.Tensor   # [B + 1] int32 (device): query rows (the new tokens)
    cu_host: list[int]
    block_table: torch.Tensor  # [B, pages] int32
    resume: torch.Tensor       # [B] int32: 1 where start > 0 (kda_prefill continues the slot's state)
    max_len: int               # the longest piece
    start: torch.Tensor        # [B] int32 (device): position of each sequence's first new token
    start_host: list[int]
    cu_k: torch.Tensor         # [B + 1] int32 (device): attention keys (cached prefix + new rows)
    cu_k_host: list[int]


# -- KDA -------------------------------------------------------------------------------------------
def _kda_proj(ops: Ops, w: KdaLayerWeights, xn):
    H = w.kda.heads
    qkvg = ops.linear(xn, w.qkvg)
    fab = ops.linear(xn, w.fab)
    return qkvg, fab[:, :128], fab[:, 128:128 + H]


def kda_step(ops: Ops, w: KdaLayerWeights, xn, pools: dict, st: Step):
    qkvg, fa, beta = _kda_proj(ops, w, xn)
    if st.T == 1:
        o = ops.kda_decode(qkvg, fa, beta, pools, st.slots, w.kda)
    else:
        o = ops.kda_verify(qkvg, fa, beta, pools, st.slots, w.kda)
    return ops.linear(o.reshape(n_rows(xn), -1), w.o_proj)


def kda_prefill(ops: Ops, w: KdaLayerWeights, xn, pools: dict, pf: Prefill):
    qkvg, fa, beta = _kda_proj(ops, w, xn)
    o = ops.kda_prefill(qkvg, fa, beta, pf.cu_seqlens, pf.slots, pf.resume, pools, w.kda)
    if "conv_ext" in pools:  # verify reads the window from conv_ext (FP32) and starts with no pending drafts
        sl = pf.slots.long()
        pools["conv_ext"][sl, :, :3] = pools["conv"][sl].float()
        pools["pending"][sl] = 0
    return ops.linear(o.reshape(n_rows(xn), -1), w.o_proj)


# -- MLA -------------------------------------------------------------------------------------------
def _mla_offsets(w: MlaLayerWeights) -> tuple[int, int]:
    """(c_kv, gate) column offsets in the A-projection output: behind q_a, or at 0 when the layer
    has a plain q_proj (q_lora_rank null) of its own."""
    kv = KV_A_OFF if w.q_proj is None else 0
    return kv, kv + (G_OFF - KV_A_OFF)


def _mla_rows(w: MlaLayerWeights, a, eps):
    """Cache rows [RMSNorm(c_kv) * w_kv | k_pe] BF16 [M, 576] from the A-projection output."""
    kv, _ = _mla_offsets(w)
    ckv = a[:, kv:kv + KV_LORA]
    kpe = a[:, kv + KV_LORA:kv + KV_LORA + ROPE]
    return torch.cat([rms_norm(ckv, w.kv_a_norm, eps), kpe], dim=1)


def _mla_q_latent(ops: Ops, w: MlaLayerWeights, xn, a):
    """q [M, H, 576] BF16 (absorbed latent 512 | rope 64). With a q LoRA: the fused mla_q_absorb.
    With a plain q_proj (no q_a norm, which mla_q_absorb always applies): q = the FP8 GEMM of xn,
    then W_UK absorbed in PyTorch at mla_q_absorb's rounding points (FP64 products rounded to FP32,
    then BF16: row-invariant, so verify rows equal decode rows), marked as a stand-in."""
    H = w.w_uk.shape[0]
    if w.q_proj is None:
        return ops.q_absorb(a[:, :Q_LORA], w.q_a_norm, w.q_b, w.w_uk)
    q = ops.linear(xn, w.q_proj).view(-1, H, QK_HEAD)
    ops._mark("mla_q_proj_absorb", "torch" if ops.kind == "kernel" else "ref")
    lat = torch.einsum("mhd,hdc->mhc", q[..., :NOPE].double(), w.w_uk.double()).float().to(BF16)
    return torch.cat([lat, q[..., NOPE:]], dim=-1)


def mla_step(ops: Ops, w: MlaLayerWeights, xn, kv: dict, layout, scale: float, st: Step, eps: float):
    H = w.w_uk.shape[0]
    a = ops.linear(xn, w.a_proj)
    rows = _mla_rows(w, a, eps)
    ops.kv_write(layout, kv, rows, st.cu_rows, st.start, st.block_table, st.slots, scale, st.T)
    q = _mla_q_latent(ops, w, xn, a)                                              # [BT, H, 576]
    o_lat = ops.mla_attention(layout, q.view(st.B, st.T, H, -1), kv, st.block_table, st.start, st.slots, scale)
    y = ops.vb_gate(o_lat.reshape(st.B * st.T, H, KV_LORA), w.w_uv, a[:, _mla_offsets(w)[1]:])
    return ops.linear(y.reshape(n_rows(xn), H * 128), w.o_proj)


def mla_prefill(ops: Ops, w: MlaLayerWeights, xn, kv: dict, layout, scale: float, pf: Prefill, eps: float):
    """Unabsorbed: c_kv expanded with kv_b into per-head k_nope / v; the cache rows written are
    exactly the decode path's, at positions pf.start.. . Keys: a continued sequence's cached prefix
    (positions < start, read from the pages as decode reads them: mla_attention.cached_prefix) and
    the new rows as computed (BF16); the queries are the new rows, bottom-right causal. With BF16
    KV the cached rows are the computed ones bit for bit; FP8 KV gives the prefix its quantization.
    The kv_b expansion is FP64 products rounded to FP32, then BF16 (row-invariant: a key's k_nope and
    v do not depend on how many rows share the call, so a prompt in pieces sees one piece's keys)."""
    H = w.w_uk.shape[0]
    N = n_rows(xn)
    a = ops.linear(xn, w.a_proj)
    rows = _mla_rows(w, a, eps)
    prefix = any(pf.start_host)
    if prefix:   # read before this step writes (its positions are >= start: the prefix is untouched)
        pre = mla_cached_prefix(layout, kv, pf.block_table, pf.start_host, scale)
    ops.kv_write(layout, kv, rows, pf.cu_seqlens, pf.start, pf.block_table, pf.slots, scale, pf.max_len)
    if w.q_proj is None:
        q = ops.linear(rms_norm(a[:, :Q_LORA], w.q_a_norm, eps), w.q_b).view(N, H, QK_HEAD)
    else:
        q = ops.linear(xn, w.q_proj).view(N, H, QK_HEAD)
    if prefix:
        cq, ck = pf.cu_host, pf.cu_k_host
        parts = []
        for b in range(len(cq) - 1):
            p0 = ck[b] - cq[b]        # the prefix rows of sequences before b
            parts += [pre[p0:p0 + pf.start_host[b]], rows[cq[b]:cq[b + 1]].float()]
        keys = torch.cat(parts)
        c, k_pe = keys[:, :KV_LORA], keys[:, KV_LORA:].to(BF16)
    else:
        c, k_pe = rows[:, :KV_LORA].float(), rows[:, KV_LORA:]
    c = c.double()
    k_nope = torch.einsum("nc,hdc->nhd", c, w.w_uk.double()).float().to(BF16)
    v = torch.einsum("nc,hdc->nhd", c, w.w_uv.double()).float().to(BF16)
    o = ops.prefill_attention(q, k_nope, k_pe, v, pf)                             # [N, H, 128] FP32
    g_off = _mla_offsets(w)[1]
    g = a[:, g_off:g_off + H * 128].float().view(N, H, 128)
    y = (o * torch.sigmoid(g)).to(BF16)
    return ops.linear(y.reshape(N, H * 128), w.o_proj)


# -- MoE and MLP -----------------------------------------------------------------------------------
def moe(ops: Ops, w: MoeWeights, xn: QAct, cfg: ModelConfig, part=None) -> torch.Tensor:
    """The (latent) MoE: lat = routed_expert_down_proj(x); y = sum_e w_e expert_e(lat);
    y = RMSNorm(y) * routed_expert_norm (latent_moe_use_norm); out = routed_expert_up_proj(y) +
    shared_experts(x) (SGLang kimi_k3 `_forward_unfused`, vLLM KimiMoE.forward; k3_facts 2.4).
    Without a latent the experts read and write the hidden width. Returns FP32 [M, hidden].

    xn: the FFN input, normed and FP8-quantized by the stream's mix (its BF16 rows feed the router).
    The router logits: `ops.router_logits` (the kernel path's router_logits kernel, FP32 in a fixed
    order; the reference path's FP64 products, model/moe_torch.py); moe_route, the latent and shared
    projections (FP8 GEMMs), the routed experts (moe_experts on the
    FP4 experts as loaded; BF16 experts on the PyTorch stand-in), glu_act and routed_expert_norm
    (attn_res over the latent, fused with the up projection's FP8 quantization) are kernels on the
    kernel path. BF16 rounding points: the latent input, the expert hidden, the
    normed sum, every GEMM output.

    `part` (model/model.py MoePart; None: the whole model): this rank holds experts `part.experts`,
    each with a slice of its intermediate, and a slice of the shared experts' intermediate; the
    experts' partial sum goes through `part.reduce` (over the ranks) before routed_expert_norm, the
    shared experts' down projection is row-parallel (RankOps sums it)."""
    routing = ops.route(ops.router_logits(xn, w.router), w.bias, cfg)
    xl = bf16(xn) if w.latent_down is None else ops.linear(xn, w.latent_down)          # [M, W] BF16
    y = ops.moe_experts(xl, routing, w.experts, cfg, None if part is None else part.experts)
    if part is not None:
        y = part.reduce(y)
    if w.latent_up is None:
        out = y.to(BF16).float()
    else:
        ya = ops.latent_norm(y, w.latent_norm, cfg.eps) if w.latent_norm is not None else y.to(BF16)
        out = ops.linear(ya, w.latent_up).float()
    if w.shared is not None:
        out = out + ops.glu(xn, w.shared, cfg).float()
    return out


def dense_mlp(ops: Ops, w: DenseMlpWeights, xn, cfg: ModelConfig) -> torch.Tensor:
    """The dense MLP (FP32 [M, hidden] of its BF16 GEMM output)."""
    return ops.glu(xn, w, cfg).float()
