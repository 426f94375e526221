"""Parameter and byte counts of a `ModelConfig`, computed from the config alone (no checkpoint).

Every tensor the K3 text backbone has (names and shapes: /work/tools_tmp/k3_facts.md section 2, a
reading of the official checkpoint's safetensors headers) is listed once by `param_table`, with
its group, its TP1 shape, how many copies exist (layers, experts), how it is split across ranks
and which storage format it takes. From that one table come:

- `count_params`: parameters per group, the total, and the active parameters per token.
- `weight_bytes_per_rank(cfg, tp, ep, layout, form)`: the bytes one rank holds.

**Active per token** = the routed experts a token is sent to (top_k of `experts`) + everything
that is not a routed expert, except that the input embedding contributes the one row a token
reads (a lookup, not the table). That is the convention Moonshot's published figures follow:
Kimi K2 gives "32 B active" (31.7 B by this rule, 32.9 B if the embedding table counted) and
K3 "104 B active" (104.2 B by this rule, 105.4 B with the table). Totals count every tensor.

**Layouts** (what the routed experts and attention projections are stored as; everything else is
BF16 except the few FP32 tensors of the official checkpoint: conv1d, A_log, dt_bias, o_norm,
e_score_correction_bias):

- `mxfp4` (moonshotai/Kimi-K3): routed experts E2M1 codes + one UE8M0 byte per 32 = 4.25 bits;
  all else BF16 (its quantization_config ignores self_attn, shared experts, the dense MLP and
  lm_head; k3_facts.md 1.4).
- `nvfp4` (nvidia/Kimi-K3-NVFP4, ModelOpt MIXED_PRECISION): routed experts E2M1 + one E4M3 per 16
  = 4.5 bits, plus FP32 `weight_scale_2` and `input_scale` scalars per expert projection; the
  KDA/MLA projections (q,k,v,g,f_a,b,f_b,o; q_a,kv_a,q_b,kv_b,g,o: hf_quant_config's FP8_PB_WO
  entries, k3_facts.md section 4) FP8 E4M3 with one FP32 scale per 128x128 tile (ceil grid);
  shared experts, dense MLP, latent projections, router, embeddings, lm_head BF16 (the card: only
  routed experts and attention projections were converted).
- `bf16`: the experts and attention projections in BF16 too.

**Forms**: `checkpoint` = bytes as stored; `serving` = what the runtime holds after loading
(model/weights.py): attention projections FP8 block weights (quantized at load when the
checkpoint has them in BF16), except `kv_b` (dequantized to BF16 for the absorbed W_UK/W_UV) and
`f_b` (BF16: the fused KDA kernel applies it); conv weights BF16; A_log, dt_bias, o_norm, the
correction bias and the AttnRes pseudo-queries and their norms FP32 (SPEC.md section 1); routed
experts packed as stored; the rest BF16. Not counted: the runtime's zero-row padding of fused
GEMM operands (kv_a 576 -> 640 rows, [f_a|b] to 16 rows: < 0.01% of the weights), the 32 pad
entries of the stored A_log, and the runtime's FP32 copy of the router (its reference path).

**Parallel layout** (`tp` ranks, one per GPU): attention split by heads (column-parallel q/k/v/g,
f_b, b, q_b, kv_b, per-head vectors; row-parallel o_proj); dense MLP and shared experts split by
intermediate; the vocabulary split across ranks for both embed_tokens and lm_head
(`vocab_parallel`, True by default: what vLLM's/SGLang's VocabParallelEmbedding and ParallelLMHead
do); routed experts split by id across `ep` ranks and by intermediate across the `tp // ep` ranks
of each EP group (ep=1: pure TP, 3072/tp each; ep=tp: whole experts, 896/ep per rank). Replicated
on every rank, counted whole: norms, f_a (vLLM: replicated), q_a and kv_a (vLLM/SGLang:
replicated fused_qkv_a), the router and its bias, the latent projections and routed_expert_norm
(ReplicatedLinear in SGLang/vLLM: the latent norm must follow the reduction over ranks), AttnRes
queries and norms, and the per-tensor NVFP4 scalars of every expert slice a rank holds.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.errors import SpecError

from model.config import ModelConfig

LAYOUTS = ("mxfp4", "nvfp4", "bf16")
FORMS = ("checkpoint", "serving")
GROUPS = ("embed", "lm_head", "kda_attn", "mla_attn", "dense_mlp", "router", "shared_experts", "latent",
          "routed_experts", "attn_res", "norms")

FP8_TILE = 128          # FP8_PB_WO 128x128 tile scales
MXFP4_GROUP = 32        # UE8M0 scale per 32 along K
NVFP4_GROUP = 16        # E4M3 scale per 16 along K
NVFP4_SCALARS = 2       # weight_scale_2 + input_scale, FP32 each, per expert projection

# Storage kinds: "expert" (the layout's expert format), "attn" (FP8 in nvfp4 and in serving, else
# BF16), "bf16", "f32". `serve` overrides the kind in the serving form.
_KINDS = ("expert", "attn", "bf16", "f32")


@dataclass(frozen=True)
class Param:
    group: str
    name: str                      # checkpoint suffix, for reports
    shape: tuple[int, ...]         # one copy at TP1
    copies: int                    # layers (x experts for routed experts)
    kind: str                      # checkpoint storage kind
    serve: str | None = None       # serving storage kind (None: same as kind)
    split: int | None = None       # dim split by tp (None: replicated)
    expert: bool = False           # routed expert: copies split by ep, `split` by tp // ep

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def params(self) -> int:
        return self.numel * self.copies


def param_table(cfg: ModelConfig, *, vocab_parallel: bool = True) -> list[Param]:
    """Every tensor of `cfg`'s text backbone, grouped (copies aggregated over layers)."""
    h = cfg.hidden
    nk, nm = len(cfg.kda_layer_ids), len(cfg.mla_layer_ids)
    n_dense = sum(1 for k in cfg.mlp_kinds if k == "dense")
    n_moe = cfg.layers - n_dense
    vs = 0 if vocab_parallel else None
    t = [Param("embed", "embed_tokens", (cfg.vocab, h), 1, "bf16", split=vs)]
    if not cfg.tie_embeddings:
        t.append(Param("lm_head", "lm_head", (cfg.vocab, h), 1, "bf16", split=vs))
    t.append(Param("norms", "norm", (h,), 1, "bf16"))
    # Per layer: input_layernorm and post_attention_layernorm.
    t.append(Param("norms", "input_layernorm+post_attention_layernorm", (2, h), cfg.layers, "bf16"))
    if cfg.attn_res_block is not None:
        # self_attention_res_{norm,proj} and mlp_res_{norm,proj} per layer, output_attn_res_{norm,proj}.
        t.append(Param("attn_res", "{self_attention,mlp}_res_{norm,proj}", (4, h), cfg.layers, "bf16", "f32"))
        t.append(Param("attn_res", "output_attn_res_{norm,proj}", (2, h), 1, "bf16", "f32"))
    if nk:
        H, dk = cfg.kda_heads, cfg.kda_head_dim
        D = H * dk
        a = "kda_attn"
        t += [Param(a, n, (D, h), nk, "attn", split=0) for n in ("q_proj", "k_proj", "v_proj")]
        if cfg.kda_out_gate == "full":
            t.append(Param(a, "g_proj", (D, h), nk, "attn", split=0))
        else:   # low rank through head_dim (Kimi-Linear-48B: g_a replicated, g_b split)
            t += [Param(a, "g_a_proj", (dk, h), nk, "attn"), Param(a, "g_b_proj", (D, dk), nk, "attn", "bf16", split=0)]
        t += [Param(a, "f_a_proj", (dk, h), nk, "attn"),
              Param(a, "f_b_proj", (D, dk), nk, "attn", "bf16", split=0),
              Param(a, "b_proj", (H, h), nk, "attn", split=0),
              Param(a, "o_proj", (h, D), nk, "attn", split=1),
              Param(a, "{q,k,v}_conv1d", (3 * D, cfg.conv_size), nk, "f32", "bf16", split=0),
              Param(a, "A_log", (H,), nk, "f32", split=0),
              Param(a, "dt_bias", (D,), nk, "f32", split=0),
              Param(a, "o_norm", (dk,), nk, "f32")]
    if nm:
        H = cfg.mla_heads
        qk = cfg.qk_nope + cfg.qk_rope
        a = "mla_attn"
        if cfg.q_lora is not None:
            t += [Param(a, "q_a_proj", (cfg.q_lora, h), nm, "attn"),
                  Param(a, "q_a_layernorm", (cfg.q_lora,), nm, "bf16"),
                  Param(a, "q_b_proj", (H * qk, cfg.q_lora), nm, "attn", split=0)]
        else:
            t.append(Param(a, "q_proj", (H * qk, h), nm, "attn", split=0))
        t += [Param(a, "kv_a_proj_with_mqa", (cfg.kv_lora + cfg.qk_rope, h), nm, "attn"),
              Param(a, "kv_a_layernorm", (cfg.kv_lora,), nm, "bf16"),
              Param(a, "kv_b_proj", (H * (cfg.qk_nope + cfg.v_head), cfg.kv_lora), nm, "attn", "bf16", split=0),
              Param(a, "o_proj", (h, H * cfg.v_head), nm, "attn", split=1)]
        if cfg.mla_out_gate:
            t.append(Param(a, "g_proj", (H * cfg.v_head, h), nm, "attn", split=0))
    if n_dense:
        f = cfg.dense_inter
        t += [Param("dense_mlp", "gate_proj+up_proj", (2 * f, h), n_dense, "bf16", split=0),
              Param("dense_mlp", "down_proj", (h, f), n_dense, "bf16", split=1)]
    if n_moe:
        E, w, f = cfg.experts, cfg.expert_width, cfg.moe_inter
        t += [Param("router", "gate", (E, h), n_moe, "bf16"),
              Param("router", "gate.e_score_correction_bias", (E,), n_moe, "f32")]
        if cfg.moe_latent is not None:
            t += [Param("latent", "routed_expert_down_proj", (cfg.moe_latent, h), n_moe, "bf16"),
                  Param("latent", "routed_expert_up_proj", (h, cfg.moe_latent), n_moe, "bf16")]
            if cfg.latent_norm:
                t.append(Param("latent", "routed_expert_norm", (cfg.moe_latent,), n_moe, "bf16"))
        if cfg.shared_experts:
            s = cfg.shared_inter
            t += [Param("shared_experts", "gate_proj+up_proj", (2 * s, h), n_moe, "bf16", split=0),
                  Param("shared_experts", "down_proj", (h, s), n_moe, "bf16", split=1)]
        # w1 (gate) and w3 (up) [f, w], w2 (down) [w, f]: three quantized tensors per expert.
        t += [Param("routed_experts", "w1", (f, w), n_moe * E, "expert", split=0, expert=True),
              Param("routed_experts", "w3", (f, w), n_moe * E, "expert", split=0, expert=True),
              Param("routed_experts", "w2", (w, f), n_moe * E, "expert", split=1, expert=True)]
    return t


@dataclass(frozen=True)
class ParamCount:
    by_group: dict[str, int]
    total: int
    active: int                     # per token
    active_by_group: dict[str, int]


def count_params(cfg: ModelConfig) -> ParamCount:
    by, act = dict.fromkeys(GROUPS, 0), dict.fromkeys(GROUPS, 0)
    for p in param_table(cfg):
        by[p.group] += p.params
        if p.group == "routed_experts":
            act[p.group] += p.params * cfg.top_k // cfg.experts
        elif p.group == "embed":
            act[p.group] += cfg.hidden      # the row a token reads
        else:
            act[p.group] += p.params
    return ParamCount(by_group=by, total=sum(by.values()), active=sum(act.values()), active_by_group=act)


# -- bytes -----------------------------------------------------------------------------------------
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fmt(p: Param, layout: str, form: str) -> str:
    """The storage format of `p`: "bf16", "f32", "fp8", "mxfp4" or "nvfp4"."""
    kind = p.serve if form == "serving" and p.serve else p.kind
    if kind == "expert":
        return layout
    if kind == "attn":
        return "fp8" if form == "serving" or layout == "nvfp4" else "bf16"
    return kind


def _bytes_one(shape: tuple[int, ...], fmt: str) -> int:
    n = 1
    for s in shape:
        n *= s
    if fmt == "bf16":
        return 2 * n
    if fmt == "f32":
        return 4 * n
    N, K = shape
    if fmt == "fp8":
        return n + 4 * _cdiv(N, FP8_TILE) * _cdiv(K, FP8_TILE)
    g = MXFP4_GROUP if fmt == "mxfp4" else NVFP4_GROUP
    if K % g:
        raise SpecError("expert K per rank", K, f"multiples of {g}", f"{fmt} scale groups along K")
    codes = n // 2
    if fmt == "mxfp4":
        return codes + n // g                     # one UE8M0 byte per group
    return codes + n // g + 4 * NVFP4_SCALARS     # one E4M3 byte per group + FP32 scalars


def check_parallel(cfg: ModelConfig, tp: int, ep: int = 1) -> None:
    """SpecError unless `tp` ranks with `ep`-way expert parallelism split `cfg` exactly."""
    for f, v in (("tp", tp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError(f, v, "a positive int")
    if tp % ep:
        raise SpecError("ep", ep, f"divisors of tp={tp}", "the EP groups partition the TP ranks")
    if cfg.experts % ep:
        raise SpecError("ep", ep, f"divisors of experts={cfg.experts}")
    cfg.kernel_shape().heads_at(tp)      # heads divisible by tp (the kernels' own check)


def _rank_shape(p: Param, tp: int, ep: int) -> tuple[tuple[int, ...], int]:
    """(shape, copies) of `p` on one rank."""
    shape, copies = list(p.shape), p.copies
    if p.expert:
        copies, n = copies // ep, tp // ep
    else:
        n = tp
    if p.split is not None and n > 1:
        d = shape[p.split]
        if d % n:
            raise SpecError("tp", tp, f"a split of {p.group}.{p.name} dim {p.split} = {d} into equal parts",
                            f"ep={ep}" if p.expert else "")
        shape[p.split] = d // n
    return tuple(shape), copies


def _check_layout(layout: str, form: str) -> None:
    if layout not in LAYOUTS:
        raise SpecError("layout", layout, LAYOUTS)
    if form not in FORMS:
        raise SpecError("form", form, FORMS)


def weight_bytes_by_group(cfg: ModelConfig, tp: int = 1, ep: int = 1, layout: str = "nvfp4",
                          form: str = "serving", *, vocab_parallel: bool = True) -> dict[str, int]:
    """Bytes of each group on one rank."""
    _check_layout(layout, form)
    check_parallel(cfg, tp, ep)
    out = dict.fromkeys(GROUPS, 0)
    for p in param_table(cfg, vocab_parallel=vocab_parallel):
        shape, copies = _rank_shape(p, tp, ep)
        out[p.group] += copies * _bytes_one(shape, _fmt(p, layout, form))
    return out


def weight_bytes_per_rank(cfg: ModelConfig, tp: int = 1, ep: int = 1, layout: str = "nvfp4",
                          form: str = "serving", *, vocab_parallel: bool = True) -> int:
    """Bytes of weights one of `tp` ranks holds (layout: the checkpoint's; form: as stored or as served)."""
    return sum(weight_bytes_by_group(cfg, tp, ep, layout, form, vocab_parallel=vocab_parallel).values())


__all__ = ["LAYOUTS", "FORMS", "GROUPS", "Param", "ParamCount", "param_table", "count_params", "check_parallel",
           "weight_bytes_by_group", "weight_bytes_per_rank"]
