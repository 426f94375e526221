"""One assembly of K3Model's weights (model/weights.py `ModelWeights`) from any checkpoint layout,
for one tensor-parallel rank, streamed layer by layer to the target device.

A layout reader is a `Source` (model/formats/sources.py): it hands out the stored tensors by their
canonical names (model/reference.py `canonical_shapes`, e.g. `model.layers.3.self_attn.q_proj`),
sliced to this rank, as stored: an `Fp8Linear` (FP32 tile scales) where the checkpoint holds FP8
block weights, a float tensor where it holds BF16/FP32, the routed experts in their packed form.
This module owns every conversion the kernels need, so the three layouts cannot drift apart:

- `[q | k | v | g_out]` of a KDA layer fused into one FP8 block weight (each part D_r = H_r * 128
  rows, so the 128x128 tile scales concatenate exactly); `[f_a | b]` likewise, zero rows padding N
  to a multiple of 16 (the GEMM's 16-byte output rows).
- Kimi-Linear's low-rank KDA output gate g_b(g_a(x)) folded into the D_r x hidden gate rows of the
  fused weight (see `_low_rank_gate` for why that stays within the FP8 recipe's error).
- The MLA A-projection `[q_a 1536 | kv_a 576 (+64 zero rows) | g H_r*128]` (kv_a padded to 640 rows
  so that g starts on a tile boundary and every stored tile scale is kept as is); without a q LoRA
  `[kv_a 576 + 64 | g]` plus a plain q_proj; without the MLA output gate, zero g rows and o_proj
  doubled (`_ungated_o_proj`: exact).
- `kv_b` as BF16 per-head W_UK (rows 0..127) and W_UV (128..255); `f_b_proj` BF16 (the fused KDA
  kernel applies it itself).
- The latent projections, the shared experts and the dense MLP as FP8 block weights too (the FFN's
  kernels: fp8_block_gemm and glu_act), [gate | up] fused with each part padded to whole tiles.
- BF16 / FP32 sources quantized at load to the caller's FP8 recipe; FP8 sources re-quantized only
  for the UE8M0 recipe (power-of-two scales, SPEC.md section 6).
- `A_log` narrowed to the first H entries of its padded storage (or read from [1, 1, H, 1]), then
  split by heads; the Attention Residuals pseudo-queries and norms in FP32.

Tensor / expert parallelism: with a `model.dist.Place`, each rank reads only its own share, in
model/shard.py's format and split (`shard_weights` of the whole model gives the same bits, checked
in tests/nogpu/modeling/test_load_model_weights.py): KDA / MLA heads by rows (q/k/v/g, b, f_b, conv,
dt_bias, A_log, q_b or q_proj, W_UK / W_UV, g), o_proj by columns (`RowParallel`), the vocabulary
of the embedding and LM head, the dense MLP and shared experts by intermediate, the routed experts
by id (EP slot) and intermediate (MoE TP slot) in their packed form; f_a, q_a, kv_a, norms, AttnRes,
router and latent projections replicated. `check_shardable` raises the layout's errors before
anything is read. b_proj's few rows are quantized whole and then sliced, so a rank's rows carry the
TP1 tile scale (the kernels' numbers do not depend on the world size).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.reference import dequantize_weights, quantize_weights
from k3gen.ops.kda_decode.reference import KdaWeights
from k3gen.ops.mla_q_absorb.spec import Q_LORA
from k3gen.targets import KDA_FAB_ALIGN, MLA_A_PAD

from model.arch import AttnResWeights
from model.checkpoint import CheckpointError, UnsupportedCheckpointError
from model.config import ModelConfig
from model.dist import Layout, Place
from model.weight_types import (DenseMlpWeights, ExpertWeights, Fp8Linear, GluWeights, KdaLayerWeights, LayerWeights,
                                MlaLayerWeights, ModelWeights, MoeWeights, _map_tensors)

BF16 = torch.bfloat16
FULL = slice(None)


class Source:
    """A layout reader, as the assembly sees it (names canonical, without `.weight` for linears)."""
    cfg: ModelConfig
    expert_fmt: str = "bf16"       # ExpertWeights.fmt of its routed experts

    def linear(self, name: str, rows: slice = FULL, cols: slice = FULL) -> Fp8Linear | torch.Tensor:
        raise NotImplementedError

    def tensor(self, name: str, *index: slice) -> torch.Tensor:
        raise NotImplementedError

    def experts(self, moe: str, ids: range, inter: slice) -> ExpertWeights:
        raise NotImplementedError

    def release(self, layer: int) -> None:
        """Layer `layer` is done: close what no later layer reads."""

    def close(self) -> None:
        """Everything is read."""


def last_layers(weight_map: dict[str, str], layers: int) -> dict[str, int]:
    """shard -> the last layer with a tensor in it (top-level tensors count as layer `layers`)."""
    from model.formats.ct_mxfp4 import layer_of
    last: dict[str, int] = {}
    for n, s in weight_map.items():
        li = layer_of(n)
        last[s] = max(last.get(s, -1), layers if li is None else li)
    return last


# -- FP8 conversions --------------------------------------------------------------------------------
# Elements per conversion step. k3gen's bit-exact quantizer and dequantizer keep about a dozen
# FP32/int32 temporaries of their input alive (~50 bytes per element), so a weight is converted
# in blocks of whole 128x128 tiles of at most this many elements (one tile row at least): the
# scratch stays bounded (~200 MiB) whatever the tensor (K3's 12288 x 7168 q_proj included). Tiles
# are independent: the codes and scales are exactly those of one call on the whole tensor.
CHUNK_ELEMENTS = 1 << 22


def _blocks(n: int, k: int):
    """(rows, cols) slices of whole 128-tiles covering [n, k], each of about CHUNK_ELEMENTS."""
    if 128 * k <= CHUNK_ELEMENTS:
        step = max(128, CHUNK_ELEMENTS // max(k, 1) // 128 * 128)
        for r in range(0, n, step):
            yield slice(r, min(n, r + step)), slice(0, k)
        return
    cstep = max(128, CHUNK_ELEMENTS // 128 // 128 * 128)
    for r in range(0, n, 128):
        for c in range(0, k, cstep):
            yield slice(r, min(n, r + 128)), slice(c, min(k, c + cstep))


def _tile(s: slice) -> slice:
    return slice(s.start // 128, -(-s.stop // 128))


def quantize_blocks(block, n: int, k: int, recipe: ScaleRecipe) -> Fp8Linear:
    """The FP8 block weight of the [n, k] matrix whose block (rows, cols) is block(rows, cols)."""
    codes = torch.empty(n, k, dtype=torch.uint8)
    tiles = (-(-n // 128), -(-k // 128))
    scales = torch.empty(tiles, dtype=torch.float32 if recipe is ScaleRecipe.FP32 else torch.uint8)
    for r, c in _blocks(n, k):
        codes[r, c], scales[_tile(r), _tile(c)] = quantize_weights(block(r, c).float(), recipe)
    return Fp8Linear(codes, scales, recipe)


def _fp8_block(x: Fp8Linear, r: slice, c: slice) -> torch.Tensor:
    return dequantize_weights(x.codes[r, c], x.scales[_tile(r), _tile(c)], x.recipe)


def as_fp8(x: Fp8Linear | torch.Tensor, recipe: ScaleRecipe) -> Fp8Linear:
    """A stored linear as the kernels' FP8 block weight with `recipe`."""
    if isinstance(x, Fp8Linear):
        if x.recipe is recipe:
            return x
        return quantize_blocks(lambda r, c: _fp8_block(x, r, c), x.n, x.k, recipe)
    return quantize_blocks(lambda r, c: x[r, c], x.shape[0], x.shape[1], recipe)


def values(x: Fp8Linear | torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The values of a stored linear in `dtype` (FP8 dequantized)."""
    if not isinstance(x, Fp8Linear):
        return x.to(dtype)
    out = torch.empty(x.n, x.k, dtype=dtype)
    for r, c in _blocks(x.n, x.k):
        out[r, c] = _fp8_block(x, r, c)
    return out


def take_rows(x: Fp8Linear, rows: slice) -> Fp8Linear:
    """Rows of an FP8 block weight with the tile scales covering them: the rows start on a tile or
    lie inside one (what check_shardable guarantees for every TP share)."""
    r0, r1, _ = rows.indices(x.n)
    if r0 % 128 and r0 // 128 != (r1 - 1) // 128:
        raise CheckpointError(f"rows [{r0}, {r1}) of an FP8 weight straddle its 128-row tiles")
    t = slice(r0 // 128, -(-r1 // 128)) if r0 % 128 == 0 else slice(r0 // 128, r0 // 128 + 1)
    return Fp8Linear(x.codes[r0:r1].contiguous(), x.scales[t].contiguous(), x.recipe)


def fuse(parts: list[Fp8Linear], pad_rows: dict[int, int] | None = None, pad_to: int = 1) -> Fp8Linear:
    """Concatenate FP8 weights along N. Every part but the last is a whole number of 128-row tiles,
    or zero-padded to `pad_rows[i]` rows inside its last tile, so each keeps its own tile scales."""
    codes, scales = [], []
    for i, p in enumerate(parts):
        c, s = p.codes, p.scales
        rows = (pad_rows or {}).get(i, c.shape[0])
        if rows % 128 and i != len(parts) - 1:
            raise CheckpointError(f"part {i} of a fused projection: {rows} rows cannot be fused before another part "
                                  "(tile scales)")
        if rows > s.shape[0] * 128:
            raise CheckpointError(f"part {i}: padding to {rows} rows leaves its {s.shape[0]} scale tiles")
        if rows > c.shape[0]:
            c = torch.cat([c, torch.zeros(rows - c.shape[0], c.shape[1], dtype=c.dtype)])
        codes.append(c)
        scales.append(s)
    c, s = torch.cat(codes), torch.cat(scales)
    n = c.shape[0]
    if n % pad_to:
        c = torch.cat([c, torch.zeros(pad_to - n % pad_to, c.shape[1], dtype=c.dtype)])
        if -(-c.shape[0] // 128) > s.shape[0]:   # the padding opened a new row tile: any finite scale serves zeros
            s = torch.cat([s, s[-1:].clone()])
    return Fp8Linear(c.contiguous(), s.contiguous(), parts[0].recipe)


def zeros_fp8(n: int, k: int, recipe: ScaleRecipe) -> Fp8Linear:
    """An all-zero FP8 weight with unit tile scales."""
    tiles = (-(-n // 128), -(-k // 128))
    s = torch.ones(tiles) if recipe is ScaleRecipe.FP32 else torch.full(tiles, 127, dtype=torch.uint8)
    return Fp8Linear(torch.zeros(n, k, dtype=torch.uint8), s, recipe)


def _ungated_o_proj(o: Fp8Linear) -> Fp8Linear:
    """o_proj of an MLA layer without the output gate, run through the gated kernels exactly.

    The layer's gate rows are zero, so mla_vb_gate (and the prefill path) multiply the attention
    output by sigmoid(0) = 1/2 exactly (the kernel's 1 / (1 + exp(-0)): ex2 of 0 and the reciprocal
    of 2 are exact). Halving is exact in BF16, the FP8 activation quantization of o_proj's input is
    scale-invariant under powers of two (amax, scale and dequantized values halve, the codes stay),
    and doubling o_proj's tile scales (FP32: x2; UE8M0: the exponent byte + 1) is exact too: the
    product equals the ungated layer's bit for bit (barring subnormal BF16 outputs)."""
    if o.recipe is ScaleRecipe.FP32:
        return Fp8Linear(o.codes, o.scales * 2.0, o.recipe)
    if int(o.scales.max()) >= 254:
        raise CheckpointError("o_proj: a UE8M0 tile scale of 2^127 cannot be doubled")
    return Fp8Linear(o.codes, o.scales + 1, o.recipe)


def _low_rank_gate(src: Source, a: str, rows: slice, recipe: ScaleRecipe) -> Fp8Linear:
    """Kimi-Linear's KDA output gate g_b(g_a(x)) as one D_r x hidden FP8 weight: g_b @ g_a in FP32.

    Why this stays within the recipe's error: the product is formed in FP32 (K = 128 terms, relative
    error ~1e-7, far below anything FP8 resolves) and then rounded once, per element, to E4M3 with a
    128x128 tile scale: the same single rounding (relative step 2^-3, RMS ~2.5% of a Gaussian tile)
    that K3's own full-rank g_proj and every other projection of the fused qkvg weight get. Running
    g_a and g_b as two FP8 GEMMs instead would round the weights twice and the rank-128 activation
    once more. The gate enters only through sigmoid, whose slope is at most 1/4: the gate value moves
    by at most a quarter of the pre-activation's rounding error."""
    gb = values(src.linear(a + "g_b_proj", rows))
    ga = values(src.linear(a + "g_a_proj"))
    return quantize_blocks(lambda r, c: gb[r] @ ga[:, c], gb.shape[0], ga.shape[1], recipe)


# -- layers -------------------------------------------------------------------------------------------
def _row_parallel(x: Fp8Linear, rank: "Rank") -> Fp8Linear:
    """o_proj of a rank: its columns as the caller's row-parallel type (model/shard.py RowParallel,
    passed in by model/formats/detect.py: this module cannot import shard.py without a cycle)."""
    return x if rank.place.world == 1 else rank.row_parallel(x.codes, x.scales, x.recipe)


@dataclass(frozen=True)
class Rank:
    """The share a load reads: `place` (model.dist), and at world > 1 the per-rank format's hooks:
    `check(cfg, layout, expert_fmt)` (every rank's alignment, before any read) and `row_parallel`."""
    place: Place
    check: object = None
    row_parallel: object = None


def _whole() -> Rank:
    return Rank(Layout(1).place(0))


def _kda(src: Source, i: int, recipe: ScaleRecipe, rank: Rank) -> KdaLayerWeights:
    cfg, place = src.cfg, rank.place
    a = f"model.layers.{i}.self_attn."
    H, Kd = cfg.kda_heads, cfg.kda_head_dim
    hs = place.part(H, place.tp)
    rows = slice(hs.start * Kd, hs.stop * Kd)
    D = rows.stop - rows.start
    parts = [as_fp8(src.linear(a + n, rows), recipe) for n in ("q_proj", "k_proj", "v_proj")]
    if cfg.kda_out_gate == "full":
        parts.append(as_fp8(src.linear(a + "g_proj", rows), recipe))
    else:
        parts.append(_low_rank_gate(src, a, rows, recipe))
    qkvg = fuse(parts)
    del parts
    b = take_rows(as_fp8(src.linear(a + "b_proj"), recipe), hs)
    fab = fuse([as_fp8(src.linear(a + "f_a_proj"), recipe), b], pad_to=KDA_FAB_ALIGN)
    conv = torch.cat([src.tensor(a + n + ".weight", rows).reshape(D, cfg.conv_size)
                      for n in ("q_conv1d", "k_conv1d", "v_conv1d")])
    a_log = src.tensor(a + "A_log").float()
    # Padded [pad] storage holds the first H real (SGLang kimi_k3 _a_log_weight_loader); [1, 1, H, 1] as is.
    a_log = (a_log.reshape(-1)[:H] if a_log.dim() == 1 else a_log.reshape(H))[hs]
    kda = KdaWeights(conv_w=conv.to(BF16).contiguous(), fb_w=values(src.linear(a + "f_b_proj", rows), BF16),
                     dt_bias=src.tensor(a + "dt_bias", rows).float().contiguous(), a_log=a_log.contiguous(),
                     norm_w=src.tensor(a + "o_norm.weight").float().contiguous())
    o_proj = _row_parallel(as_fp8(src.linear(a + "o_proj", FULL, rows), recipe), rank)
    return KdaLayerWeights(qkvg=qkvg, fab=fab, o_proj=o_proj, kda=kda)


def _mla(src: Source, i: int, recipe: ScaleRecipe, rank: Rank) -> MlaLayerWeights:
    cfg, place = src.cfg, rank.place
    a = f"model.layers.{i}.self_attn."
    if cfg.q_lora is not None and cfg.q_lora != Q_LORA:
        raise UnsupportedCheckpointError(f"{a}q_a_proj: q_lora_rank {cfg.q_lora}; mla_q_absorb reads {Q_LORA}")
    hs = place.part(cfg.mla_heads, place.tp)
    Hr = hs.stop - hs.start

    def rows(per: int) -> slice:
        return slice(hs.start * per, hs.stop * per)

    kv_a = as_fp8(src.linear(a + "kv_a_proj_with_mqa"), recipe)
    g = (as_fp8(src.linear(a + "g_proj", rows(cfg.v_head)), recipe) if cfg.mla_out_gate
         else zeros_fp8(Hr * cfg.v_head, cfg.hidden, recipe))
    o_proj = as_fp8(src.linear(a + "o_proj", FULL, rows(cfg.v_head)), recipe)
    if not cfg.mla_out_gate:
        o_proj = _ungated_o_proj(o_proj)
    o_proj = _row_parallel(o_proj, rank)
    qk = cfg.qk_nope + cfg.qk_rope
    q_a_norm = q_b = q_proj = None
    if cfg.q_lora is not None:
        a_proj = fuse([as_fp8(src.linear(a + "q_a_proj"), recipe), kv_a, g], pad_rows={1: MLA_A_PAD})
        q_a_norm = src.tensor(a + "q_a_layernorm.weight").to(BF16)
        q_b = as_fp8(src.linear(a + "q_b_proj", rows(qk)), recipe)
    else:
        a_proj = fuse([kv_a, g], pad_rows={0: MLA_A_PAD})
        q_proj = as_fp8(src.linear(a + "q_proj", rows(qk)), recipe)
    kvb = values(src.linear(a + "kv_b_proj", rows(cfg.qk_nope + cfg.v_head)), BF16)
    kvb = kvb.view(Hr, cfg.qk_nope + cfg.v_head, cfg.kv_lora)
    return MlaLayerWeights(a_proj=a_proj, q_a_norm=q_a_norm, q_b=q_b,
                           kv_a_norm=src.tensor(a + "kv_a_layernorm.weight").to(BF16),
                           w_uk=kvb[:, :cfg.qk_nope].contiguous(), w_uv=kvb[:, cfg.qk_nope:].contiguous(),
                           o_proj=o_proj, q_proj=q_proj)


def pad_cols(x: Fp8Linear, k: int) -> Fp8Linear:
    """x with zero columns up to k (inside its last 128-column tile, whose scale serves zeros)."""
    if k == x.k:
        return x
    if -(-k // 128) != x.scales.shape[1]:
        raise CheckpointError(f"padding {x.k} columns to {k} leaves the {x.scales.shape[1]} scale tiles")
    codes = torch.cat([x.codes, torch.zeros(x.n, k - x.k, dtype=x.codes.dtype)], dim=1)
    return Fp8Linear(codes.contiguous(), x.scales, x.recipe)


def glu(gate: Fp8Linear, up: Fp8Linear, down: Fp8Linear, rank: "Rank") -> tuple[Fp8Linear, Fp8Linear, int]:
    """(gate_up, down, inter) of weight_types.GluWeights from the rank's FP8 gate/up rows and down
    columns: [gate | up] fused with each part zero-padded to whole 128-row tiles, down padded to
    the same columns (row-parallel at world > 1)."""
    inter = gate.n
    width = -(-inter // 128) * 128
    gate_up = fuse([gate, up], pad_rows={0: width}, pad_to=128)
    return gate_up, _row_parallel(pad_cols(down, width), rank), inter


def _glu(src: Source, m: str, inter: slice, recipe: ScaleRecipe, rank: "Rank") -> tuple[Fp8Linear, Fp8Linear, int]:
    q = [as_fp8(src.linear(m + n, inter), recipe) for n in ("gate_proj", "up_proj")]
    return glu(*q, as_fp8(src.linear(m + "down_proj", FULL, inter), recipe), rank)


def _moe(src: Source, i: int, recipe: ScaleRecipe, rank: "Rank") -> MoeWeights:
    cfg, place = src.cfg, rank.place
    m = f"model.layers.{i}.block_sparse_moe."
    lat = cfg.moe_latent is not None
    es = place.part(cfg.experts, place.ep)
    sh = (GluWeights(*_glu(src, m + "shared_experts.", place.part(cfg.shared_inter, place.tp), recipe, rank))
          if cfg.shared_experts else None)
    return MoeWeights(router=src.tensor(m + "gate.weight").float(),
                      bias=src.tensor(m + "gate.e_score_correction_bias").float(),
                      experts=src.experts(m, range(es.start, es.stop), place.part(cfg.moe_inter, place.moe_tp)),
                      latent_down=as_fp8(src.linear(m + "routed_expert_down_proj"), recipe) if lat else None,
                      latent_up=as_fp8(src.linear(m + "routed_expert_up_proj"), recipe) if lat else None,
                      latent_norm=src.tensor(m + "routed_expert_norm.weight").to(BF16) if cfg.latent_norm else None,
                      shared=sh)


def _attn_res(src: Source, p: str) -> AttnResWeights:
    return AttnResWeights(proj=src.tensor(p + "_proj.weight").float().reshape(-1).contiguous(),
                          norm=src.tensor(p + "_norm.weight").float().contiguous())


def layer(src: Source, i: int, recipe: ScaleRecipe, rank: Rank | None = None) -> LayerWeights:
    """Layer i of `rank`'s share (None: the whole model), on the CPU."""
    cfg = src.cfg
    rank = rank or _whole()
    place = rank.place
    p = f"model.layers.{i}."
    attn = (_kda if cfg.kind(i) == "kda" else _mla)(src, i, recipe, rank)
    if cfg.is_dense(i):
        ffn = DenseMlpWeights(*_glu(src, p + "mlp.", place.part(cfg.dense_inter, place.tp), recipe, rank))
    else:
        ffn = _moe(src, i, recipe, rank)
    res = cfg.attn_res_block is not None
    return LayerWeights(input_norm=src.tensor(p + "input_layernorm.weight").to(BF16),
                        post_norm=src.tensor(p + "post_attention_layernorm.weight").to(BF16), attn=attn, ffn=ffn,
                        attn_res=_attn_res(src, p + "self_attention_res") if res else None,
                        mlp_res=_attn_res(src, p + "mlp_res") if res else None)


def assemble(src: Source, recipe: ScaleRecipe, rank: Rank | None = None, device="cpu") -> ModelWeights:
    """ModelWeights of `rank`'s share (None: the whole model) on `device`. Each layer is built on the
    CPU, moved, and its CPU copy dropped before the next layer is read (peak host memory: one
    layer's tensors plus bounded conversion buffers, tests/nogpu/modeling/test_load_streaming.py)."""
    cfg = src.cfg
    rank = rank or _whole()
    place = rank.place
    try:
        if not isinstance(recipe, ScaleRecipe):
            raise SpecError("recipe", recipe, [r.value for r in ScaleRecipe])
        if place.world > 1:
            if rank.check is None or rank.row_parallel is None:
                raise SpecError("rank", rank, "a Rank with model/shard.py's check and RowParallel at world > 1")
            rank.check(cfg, place.layout, src.expert_fmt if "moe" in cfg.mlp_kinds else None)
        dev = torch.device(device)

        def move(x):
            return _map_tensors(x, lambda t: t.to(dev))
        layers = []
        for i in range(cfg.layers):
            layers.append(move(layer(src, i, recipe, rank)))
            src.release(i)
        v = place.part(cfg.vocab, place.tp)
        embed = src.tensor("model.embed_tokens.weight", v).to(BF16).to(dev)
        top = dict(final_norm=src.tensor("model.norm.weight").to(BF16).to(dev),
                   lm_head=embed if cfg.tie_embeddings else src.tensor("lm_head.weight", v).to(BF16).to(dev),
                   output_res=move(_attn_res(src, "model.output_attn_res"))
                   if cfg.attn_res_block is not None else None)
    finally:
        src.close()
    return ModelWeights(cfg=cfg, recipe=recipe, embed=embed, layers=layers, **top)


__all__ = ["Source", "Rank", "assemble", "layer", "as_fp8", "values", "fuse", "take_rows", "zeros_fp8", "quantize_blocks",
           "FULL", "CHUNK_ELEMENTS", "glu", "pad_cols"]
