"""One rank's weights: `shard_weights(full, place)` slices a whole-model `ModelWeights` (any checkpoint
format's loader output) into what rank `place` of a `model.dist.Layout` holds, bitwise the same values.

- KDA and MLA heads column-parallel: the rows of the rank's heads of q/k/v/g (fused `qkvg`), of b (in the
  fused `[f_a | b | pad]`, f_a replicated), of the MLA gate g (in `[q_a | kv_a | g]`, q_a and kv_a
  replicated: the latent is shared by all heads) and q_b; the conv weights, f_b, dt_bias and A_log of its
  heads; W_UK / W_UV of its heads. `o_proj` row-parallel (`RowParallel`: the columns of its heads; the
  model sums the partial products over the ranks before the BF16 rounding).
- Vocabulary-parallel embedding and LM head (rows [rank * V / world, ...)).
- Dense MLP and shared experts by intermediate over all ranks (FP8 [gate | up] rows, down columns as a
  `RowParallel`: the model sums its partial products like o_proj's); a rank's share must be whole
  128-row tiles (`ShardAlignmentError` otherwise).
- Routed experts by id over the EP slot and by intermediate over the MoE TP slot, in their packed form.
- Replicated: norms, AttnRes queries, f_a, q_a, kv_a, the router and its bias, the latent projections and
  routed_expert_norm (it normalizes the sum over every rank's experts).

FP8 block weights are sliced on their 128x128 scale tiles: a rank's tile must take its rows (columns) from one
stored tile, else the slice is not representable without re-quantizing and `ShardAlignmentError` says
which tensor and rank (MLA q_b at an odd number of heads per rank: 192 rows per head). Packed experts split
their intermediate on whole scale groups (NVFP4 16, MXFP4 32).

This is model/params.py's split (plan-memory counts the same tensors per rank: tests/nogpu/dist).
"""
from __future__ import annotations

import dataclasses

import torch

from k3gen.errors import SpecError
from k3gen.targets import KDA_FAB_ALIGN, MLA_A_PAD

from model.config import ModelConfig
from model.dist import Layout, Place
from model.weights import (DenseMlpWeights, ExpertWeights, Fp8Linear, KdaLayerWeights,
                           MlaLayerWeights, ModelWeights, MoeWeights)
from k3gen.ops.kda_decode.reference import KdaWeights

TILE = 128
DK = 128                     # KDA / MLA value head dim
QK = 192                     # MLA q_b rows per head (nope 128 + rope 64)
GROUPS = {"nvfp4": 16, "mxfp4": 32, "bf16": 1}


class ShardAlignmentError(SpecError):
    """A split that does not fall on the stored format's block boundaries (FP8 128x128 tiles, NVFP4/MXFP4
    scale groups): representing it would need a re-quantization that TP1 does not do."""


class RowParallel(Fp8Linear):
    """A row-parallel FP8 weight: the input columns of this rank's heads. Its product is this rank's
    partial sum of the full projection (model/model.py RankOps sums them over the ranks)."""

    def to(self, device) -> "RowParallel":
        b = Fp8Linear.to(self, device)
        return RowParallel(b.codes, b.scales, b.recipe, b._dequant)


# -- index maps ------------------------------------------------------------------------------------
def _tile_sources(ranges: list[tuple[int, int]], pad: int, what: str, rank: int) -> list[int | None]:
    """For each 128-row tile of the slice made of global row `ranges` then `pad` zero rows: the stored
    tile all its real rows come from (None: zero rows only). ShardAlignmentError when rows of two
    stored tiles would share one tile."""
    rows = [r for a, b in ranges for r in range(a, b)] + [None] * pad
    out = []
    for t in range(0, len(rows), TILE):
        src = {r // TILE for r in rows[t:t + TILE] if r is not None}
        if len(src) > 1:
            raise ShardAlignmentError(what, f"rank {rank}: rows {ranges}", "slices on 128-row tile boundaries",
                                      f"local tile {t // TILE} would take stored tiles {sorted(src)}")
        out.append(src.pop() if src else None)
    return out


def _fp8_rows(w: Fp8Linear, ranges: list[tuple[int, int]], pad: int, what: str, rank: int) -> Fp8Linear:
    src = _tile_sources(ranges, pad, what, rank)
    codes = torch.cat([w.codes[a:b] for a, b in ranges]
                      + [torch.zeros(pad, w.k, dtype=w.codes.dtype, device=w.codes.device)])
    last = next(s for s in src if s is not None)
    rows = []
    for s in src:                     # a zero-only tile serves any finite scale: the previous one
        last = last if s is None else s
        rows.append(w.scales[last])
    return Fp8Linear(codes.contiguous(), torch.stack(rows).contiguous(), w.recipe)


def _col_check(lo: int, hi: int, k: int, what: str, rank: int) -> None:
    if lo % TILE or (hi % TILE and hi != k):
        raise ShardAlignmentError(what, f"rank {rank}: columns [{lo}, {hi})", "slices on 128-column tile boundaries")


def _fp8_cols(w: Fp8Linear, lo: int, hi: int, what: str, rank: int) -> RowParallel:
    _col_check(lo, hi, w.k, what, rank)
    return RowParallel(w.codes[:, lo:hi].clone(), w.scales[:, lo // TILE:-(-hi // TILE)].clone(), w.recipe)


def _heads(place: Place, h: int) -> tuple[int, int]:
    s = place.part(h, place.tp)
    return s.start, s.stop


def _kda_maps(cfg: ModelConfig, place: Place):
    """(qkvg ranges, fab ranges + pad, o_proj columns) of a rank's KDA heads."""
    H = cfg.kda_heads
    h0, h1 = _heads(place, H)
    D = H * DK
    qkvg = [(p * D + h0 * DK, p * D + h1 * DK) for p in range(4)]
    n = 128 + h1 - h0
    fab = ([(0, 128), (128 + h0, 128 + h1)], -(-n // KDA_FAB_ALIGN) * KDA_FAB_ALIGN - n)
    return qkvg, fab, (h0 * DK, h1 * DK)


def _mla_maps(cfg: ModelConfig, place: Place):
    """(a_proj ranges, q_b (or plain q_proj) ranges, o_proj columns) of a rank's MLA heads; without a
    q LoRA the A-projection is [kv_a 576 + 64 | g]."""
    h0, h1 = _heads(place, cfg.mla_heads)
    g = (cfg.q_lora or 0) + MLA_A_PAD
    return [(0, g), (g + h0 * DK, g + h1 * DK)], [(h0 * QK, h1 * QK)], (h0 * DK, h1 * DK)


def _expert_inter(fmt: str, inter: int, place: Place) -> slice:
    s = place.part(inter, place.moe_tp)
    n = s.stop - s.start
    g = GROUPS[fmt]
    if n % g or (fmt != "bf16" and n % 2):
        raise ShardAlignmentError("moe_inter", f"rank {place.rank}: {n} of {inter} per rank",
                                  f"multiples of the {fmt} scale group {g}", f"MoE TP{place.layout.moe_tp}")
    return s


def check_shardable(cfg: ModelConfig, layout: Layout, expert_fmt: str | None = None) -> None:
    """Every rank of `layout` can be sliced from `cfg`'s weights (index arithmetic only, no data):
    the SpecError or ShardAlignmentError a rank would raise while slicing, raised on every rank first."""
    layout.check(cfg)
    for r in range(layout.world):
        p = layout.place(r)
        if cfg.kda_layer_ids:
            qkvg, (fab, pad), (c0, c1) = _kda_maps(cfg, p)
            _tile_sources(qkvg, 0, "kda qkvg", r)
            _tile_sources(fab, pad, "kda [f_a | b]", r)
            _col_check(c0, c1, cfg.kda_heads * DK, "kda o_proj", r)
        if cfg.mla_layer_ids:
            a, qb, (c0, c1) = _mla_maps(cfg, p)
            _tile_sources(a, 0, "mla [q_a | kv_a | g]", r)
            _tile_sources(qb, 0, "mla q_b", r)
            _col_check(c0, c1, cfg.mla_heads * DK, "mla o_proj", r)
        if expert_fmt is not None and "moe" in cfg.mlp_kinds:
            _expert_inter(expert_fmt, cfg.moe_inter, p)
    if "dense" in cfg.mlp_kinds:
        _glu_check(cfg.dense_inter, layout, "dense_inter")
    if "moe" in cfg.mlp_kinds and cfg.shared_experts:
        _glu_check(cfg.shared_inter, layout, "shared_inter")


# -- slicing ---------------------------------------------------------------------------------------
def _kda(w: KdaLayerWeights, cfg: ModelConfig, place: Place) -> KdaLayerWeights:
    r = place.rank
    qkvg, (fab, pad), (c0, c1) = _kda_maps(cfg, place)
    h0, h1 = c0 // DK, c1 // DK
    D = cfg.kda_heads * DK
    k = w.kda
    kda = KdaWeights(conv_w=torch.cat([k.conv_w[p * D + c0:p * D + c1] for p in range(3)]).contiguous(),
                     fb_w=k.fb_w[c0:c1].clone(), dt_bias=k.dt_bias[c0:c1].clone(), a_log=k.a_log[h0:h1].clone(),
                     norm_w=k.norm_w)
    return KdaLayerWeights(qkvg=_fp8_rows(w.qkvg, qkvg, 0, "kda qkvg", r),
                           fab=_fp8_rows(w.fab, fab, pad, "kda [f_a | b]", r),
                           o_proj=_fp8_cols(w.o_proj, c0, c1, "kda o_proj", r), kda=kda)


def _mla(w: MlaLayerWeights, cfg: ModelConfig, place: Place) -> MlaLayerWeights:
    r = place.rank
    a, qb, (c0, c1) = _mla_maps(cfg, place)
    h0, h1 = c0 // DK, c1 // DK
    q = {k: _fp8_rows(getattr(w, k), qb, 0, f"mla {k}", r)
         for k in ("q_b", "q_proj") if getattr(w, k, None) is not None}
    return dataclasses.replace(w, a_proj=_fp8_rows(w.a_proj, a, 0, "mla [q_a | kv_a | g]", r), **q,
                               w_uk=w.w_uk[h0:h1].clone(), w_uv=w.w_uv[h0:h1].clone(),
                               o_proj=_fp8_cols(w.o_proj, c0, c1, "mla o_proj", r))


def _glu_rows(w, place: Place, what: str):
    """The fused [gate | up] rows and down columns of this rank's share of the intermediate (whole
    128-row tiles: check_shardable), the same type (DenseMlpWeights or GluWeights)."""
    s = place.part(w.inter, place.tp)
    W, r = w.width, place.rank
    gate_up = _fp8_rows(w.gate_up, [(s.start, s.stop), (W + s.start, W + s.stop)], 0, f"{what} [gate | up]", r)
    return type(w)(gate_up=gate_up, down=_fp8_cols(w.down, s.start, s.stop, f"{what} down_proj", r),
                   inter=s.stop - s.start)


def _glu_check(inter: int, layout: Layout, what: str) -> None:
    """A rank's share of an FP8 GLU's intermediate is whole 128-row tiles (its gate/up rows and down
    columns keep TP1's tile scales, its glu_act groups TP1's activation groups)."""
    if layout.world > 1 and (inter // layout.world) % TILE:
        raise ShardAlignmentError(what, f"{inter // layout.world} of {inter} per rank",
                                  "multiples of 128 (whole FP8 tiles)", f"TP{layout.world}")


def shard_experts(x: ExpertWeights, place: Place) -> ExpertWeights:
    """The experts of the rank's EP slot, each cut to the intermediate of its MoE TP slot (packed)."""
    es = place.part(x.experts, place.ep)
    s = _expert_inter(x.fmt, x.inter, place)
    I, g = x.inter, GROUPS[x.fmt]
    pk = 1 if x.fmt == "bf16" else 2                    # values per stored byte along K (w2's K is I)

    def rows(t):                                        # [E, 2I, .]: the gate and the up rows
        return None if t is None else torch.cat([t[es, s], t[es, I + s.start:I + s.stop]], dim=1).contiguous()

    def cols(t, per):
        return None if t is None else t[es, :, s.start // per:s.stop // per].contiguous()

    def ex(t):
        return None if t is None else t[es].clone()
    return ExpertWeights(fmt=x.fmt, w13=rows(x.w13), w13_scale=rows(x.w13_scale), w13_global=ex(x.w13_global),
                         w2=cols(x.w2, pk), w2_scale=None if x.w2_scale is None else cols(x.w2_scale, g),
                         w2_global=ex(x.w2_global))


def _moe(w: MoeWeights, place: Place) -> MoeWeights:
    sh = None if w.shared is None else _glu_rows(w.shared, place, "shared_experts")
    return dataclasses.replace(w, experts=shard_experts(w.experts, place), shared=sh)


def shard_weights(w: ModelWeights, place: Place) -> ModelWeights:
    """Rank `place`'s weights, sliced from the whole model `w` (a new object; `w` is not modified).
    Raises SpecError / ShardAlignmentError before slicing anything when any rank of the layout could not."""
    cfg = w.cfg
    fmts = {lw.ffn.experts.fmt for lw in w.layers if isinstance(lw.ffn, MoeWeights)}
    for f in fmts or {None}:
        check_shardable(cfg, place.layout, f)
    if place.world == 1:
        return w
    layers = []
    for i, lw in enumerate(w.layers):
        attn = _kda(lw.attn, cfg, place) if cfg.kind(i) == "kda" else _mla(lw.attn, cfg, place)
        if isinstance(lw.ffn, DenseMlpWeights):
            ffn = _glu_rows(lw.ffn, place, "mlp")
        else:
            ffn = _moe(lw.ffn, place)
        layers.append(dataclasses.replace(lw, attn=attn, ffn=ffn))
    v = place.part(cfg.vocab, place.tp)
    embed = w.embed[v].clone()
    lm_head = embed if w.lm_head is w.embed else w.lm_head[v].clone()
    return dataclasses.replace(w, embed=embed, lm_head=lm_head, layers=layers)


def check_rank_weights(w: ModelWeights, place: Place) -> None:
    """SpecError unless `w` holds rank `place`'s shares (the head, vocabulary and expert counts)."""
    cfg, n = w.cfg, place.world
    want = {"vocab rows": cfg.vocab // n, "experts": cfg.experts // place.layout.ep}
    got = {"vocab rows": w.embed.shape[0]}
    for i, lw in enumerate(w.layers):
        a = lw.attn
        if isinstance(a, KdaLayerWeights):
            want["kda heads"], got["kda heads"] = cfg.kda_heads // n, a.kda.heads
        elif isinstance(a, MlaLayerWeights):
            want["mla heads"], got["mla heads"] = cfg.mla_heads // n, a.w_uk.shape[0]
        if isinstance(lw.ffn, MoeWeights):
            got["experts"] = lw.ffn.experts.experts
    for k, v in got.items():
        if v != want[k]:
            raise SpecError(f"weights {k}", v, [want[k]], f"rank {place.rank} of {place.layout} (model/shard.py)")


__all__ = ["ShardAlignmentError", "RowParallel", "shard_weights", "shard_experts", "check_shardable",
           "check_rank_weights"]
