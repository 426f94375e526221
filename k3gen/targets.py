"""Target presets (features and op menu), serving options, and `model_specs`: the one enumerator
of what gets built for a model.

`model_specs(target, model, tp, ep, serving)` lists exactly the specs a model's rank launches at
one serving setting; `k3gen build --model`, the model itself (model/ops.py resolves every kernel
it launches in that list), tools/prebuild_gpu.py and the committed trees (`build_specs`) all read
it. `sm103-nvfp4` and `sm107-nvfp4` are thin presets over one NVFP4 implementation: they differ
only in arch. `sm100-mxfp4` is the original target: its generated sources are frozen once landed.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from k3gen.errors import SpecError, TargetError
from k3gen.ir.dtypes import Fp8ScaleGranularity, GateKind, KvDtype, ScaleLayout, ScaleRecipe, SsmDtype
from k3gen.ir.layouts import PAGE_TOKENS, KvLayout
from k3gen.ir.spec import OpSpec
from k3gen.ir.target import Target

# Every op a full K3 rank launches, in build order; adding an op = one line here.
K3_MENU = ("kv_cache_write", "kda_decode", "kda_verify", "kda_prefill", "act_quant_fp8", "fp8_block_gemm",
           "mla_q_absorb", "mla_vb_gate", "mla_decode",
           "mla_prefill",   # wgmma (sm90) and tcgen05 (sm103/sm107) kernels: has_prefill_kernel
           "moe_experts",   # sm90: mma.sync; sm103 / sm107: tcgen05 (compiled, never run: variants.py)
           "moe_route", "attn_res", "glu_act", "router_logits")


def _nvfp4(name: str, arch: str, sm: int) -> Target:
    return Target(name=name, arch=arch, sm=sm, mma="tcgen05", fp4_cvt=True, tma=True, menu=K3_MENU,
                  kv_dtypes=(KvDtype.BF16, KvDtype.FP8, KvDtype.NVFP4),
                  ssm_dtypes=(SsmDtype.FP32, SsmDtype.BF16),
                  nvfp4_scale_layout=ScaleLayout.SWIZZLE_128X4, scale_recipe=ScaleRecipe.UE8M0)


TARGETS: dict[str, Target] = {t.name: t for t in (
    # Hopper pairs its wgmma GEMMs with either recipe (the H200 tests run both).
    Target(name="sm90", arch="sm_90a", sm=90, mma="wgmma", fp4_cvt=False, tma=True, menu=K3_MENU,
           kv_dtypes=(KvDtype.BF16, KvDtype.FP8, KvDtype.NVFP4),
           ssm_dtypes=(SsmDtype.FP32, SsmDtype.BF16),
           nvfp4_scale_layout=ScaleLayout.LINEAR, scale_recipe=ScaleRecipe.FP32,
           gemm_recipes=(ScaleRecipe.FP32, ScaleRecipe.UE8M0),
           notes="Hopper (H100/H200): runs here; FP4 decoded in software"),
    # The original target gains ops only once they are final: its menu is what landed.
    Target(name="sm100-mxfp4", arch="sm_100a", sm=100, mma="tcgen05", fp4_cvt=True, tma=True,
           menu=("kv_cache_write", "kda_verify"),
           kv_dtypes=(KvDtype.BF16, KvDtype.FP8), ssm_dtypes=(SsmDtype.FP32,),
           nvfp4_scale_layout=ScaleLayout.SWIZZLE_128X4, scale_recipe=ScaleRecipe.UE8M0,
           frozen=True, notes="original target: MXFP4 experts, BF16/FP8 KV, FP32 SSM"),
    _nvfp4("sm103-nvfp4", "sm_103a", 103),
    _nvfp4("sm107-nvfp4", "sm_107a", 107),
)}

# What `--arch` accepts on the command line.
ARCH_ALIASES = {"sm90": "sm90", "sm100": "sm100-mxfp4", "sm103": "sm103-nvfp4", "sm107": "sm107-nvfp4"}


def get_target(name: str) -> Target:
    key = ARCH_ALIASES.get(name, name)
    if key not in TARGETS:
        raise TargetError("arch", name, sorted(ARCH_ALIASES) + sorted(TARGETS))
    return TARGETS[key]


# -- serving options ------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ServingOptions:
    """Deployment choices validated against a target (the restrictions of SPEC.md section 5)."""
    kv: KvDtype
    ssm: SsmDtype = SsmDtype.FP32
    page: int | None = None
    max_drafts: int = 0
    recipe: ScaleRecipe | None = None   # FP8 projection scales; None: the target's
    chunked_prefill: bool = False
    context_start_alignment: int = 16   # prefix reuse may only start contexts at multiples of this
    partial_page_reuse: bool = False
    context_parallel: bool = False
    disaggregated: bool = False


def check_serving(target: Target, opts: ServingOptions) -> ServingOptions:
    """Raise a TargetError/SpecError naming field, value and allowed set; return filled options."""
    if opts.kv not in target.kv_dtypes:
        raise TargetError("kv", opts.kv.value, [k.value for k in target.kv_dtypes],
                          f"target {target.name}")
    if opts.ssm not in target.ssm_dtypes:
        raise TargetError("ssm", opts.ssm.value, [s.value for s in target.ssm_dtypes],
                          f"target {target.name}")
    page = opts.page if opts.page is not None else PAGE_TOKENS[opts.kv]
    if page != PAGE_TOKENS[opts.kv]:
        raise SpecError("page", page, [PAGE_TOKENS[opts.kv]], f"{opts.kv.value} KV")
    if not 0 <= opts.max_drafts <= 7:
        raise SpecError("max_drafts", opts.max_drafts, "0..7")
    try:
        recipe = target.scale_recipe if opts.recipe is None else ScaleRecipe(opts.recipe)
    except ValueError:
        raise SpecError("recipe", opts.recipe, [r.value for r in ScaleRecipe]) from None
    if recipe not in target.recipes:
        raise TargetError("recipe", recipe.value, [r.value for r in target.recipes],
                          f"target {target.name} pairs its GEMMs with these recipes")
    if opts.kv is KvDtype.NVFP4:
        if opts.chunked_prefill:
            raise SpecError("chunked_prefill", True, [False], "NVFP4 KV re-quantizes whole tiles")
        if opts.context_start_alignment % 16:
            raise SpecError("context_start_alignment", opts.context_start_alignment,
                            "multiples of 16", "contexts start on a 16-token tile")
        if opts.partial_page_reuse:
            raise SpecError("partial_page_reuse", True, [False], "NVFP4 KV")
        if opts.context_parallel:
            raise SpecError("context_parallel", True, [False], "not supported with NVFP4 KV")
        if opts.disaggregated:
            raise SpecError("disaggregated", True, [False], "no disaggregated FP4 MLA")
    return ServingOptions(**{**opts.__dict__, "page": page, "recipe": recipe})


def serving_kv_layout(target: Target, opts: ServingOptions) -> KvLayout:
    """The paged KV format a deployment allocates (model/cache.py) and its kernels read."""
    nvfp4 = opts.kv is KvDtype.NVFP4
    return KvLayout(kv=opts.kv, page=PAGE_TOKENS[opts.kv], scale_layout=target.nvfp4_scale_layout,
                    max_drafts=opts.max_drafts if nvfp4 else 0)


# -- models as the kernels see them ---------------------------------------------------------------

# The fused MLA A-projection: [q_a q_lora | c_kv 512 | k_pe 64 | pad 64 | gate H * 128]; the pad keeps
# the gate on a 128-column scale tile. The fused KDA [f_a 128 | b H] projection is padded to 16 rows.
MLA_A_PAD = 640
KDA_FAB_ALIGN = 16


@dataclass(frozen=True, kw_only=True)
class FfnShape:
    """What the FFN and residual-stream kernels depend on (model/config.py ModelConfig's fields of the
    same names; `shared_inter` = moe_inter * shared_experts, 0 without shared experts)."""
    layers: int
    eps: float = 1e-5
    attn_res_block: int | None = None
    moe: bool = True                  # has MoE layers
    dense: bool = True                # has dense MLP layers
    experts: int = 0
    top_k: int = 0
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scale: float = 1.0
    moe_latent: int | None = None
    latent_norm: bool = False
    shared_inter: int = 0
    dense_inter: int = 0
    moe_inter: int = 0                # one routed expert's intermediate (the 3072 of K3)
    act: str = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0

    @property
    def max_sources(self) -> int:
        """AttnRes sources of a forward: the embedding (sealed at layer 0) and one per block; 1 plain."""
        return 1 if self.attn_res_block is None else 1 + -(-self.layers // self.attn_res_block)


def ffn_shape(f: dict) -> FfnShape:
    """The FfnShape of ModelConfig fields (a dict: k3gen.hf_config.config_fields, or a config's __dict__)."""
    kinds = tuple(f["mlp_kinds"])
    return FfnShape(layers=f["layers"], eps=float(f.get("eps", 1e-5)), attn_res_block=f.get("attn_res_block"),
                    moe="moe" in kinds, dense="dense" in kinds, experts=f["experts"], top_k=f["top_k"],
                    n_group=f.get("n_group", 1), topk_group=f.get("topk_group", 1),
                    renormalize=bool(f.get("renormalize", True)), routed_scale=float(f.get("routed_scale", 1.0)),
                    moe_latent=f.get("moe_latent"), latent_norm=bool(f.get("latent_norm", False)),
                    shared_inter=f["moe_inter"] * f["shared_experts"], dense_inter=f["dense_inter"],
                    moe_inter=f["moe_inter"], act=f.get("act", "situ"), situ_beta=float(f.get("situ_beta", 4.0)),
                    situ_linear_beta=float(f.get("situ_linear_beta", 25.0)))


def glu_width(inter: int, tp: int) -> int:
    """Rows of gate (and of up) in a rank's fused [gate | up] FP8 weight: its share of the
    intermediate, zero-padded to whole 128-row tiles (model/formats/assemble.py pads the same)."""
    return -(-(inter // tp) // 128) * 128


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What a model's kernels depend on (its full config is model/config.py's ModelConfig, whose
    `kernel_shape()` gives this). Head counts are the whole model's (TP1)."""
    name: str
    hidden: int
    kda_heads: int
    mla_heads: int
    q_lora: int | None = 1536
    kda: bool = True                  # has KDA layers
    mla: bool = True                  # has MLA layers
    gate: GateKind = GateKind.BOUNDED
    ffn: FfnShape | None = None       # None: no FFN / residual-stream kernels enumerated (attention only)

    def heads_at(self, tp: int) -> tuple[int, int]:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise SpecError("tp", tp, "a positive int")
        for f, h in (("kda_heads", self.kda_heads), ("mla_heads", self.mla_heads)):
            if h % tp:
                raise SpecError("tp", tp, f"divisors of {f}={h}", f"model {self.name}")
        return self.kda_heads // tp, self.mla_heads // tp


def get_model(name: str) -> ModelShape:
    """A preset by name (k3gen/presets.py), or a config.json path / checkpoint folder."""
    from k3gen.hf_config import config_fields, read_config
    from k3gen.presets import PRESETS, preset_fields
    if name in PRESETS:
        f = preset_fields(name)
    elif name.endswith(".json") or Path(name).exists():
        f = config_fields(*read_config(name))
    else:
        raise SpecError("model", name, sorted(PRESETS) + ["a config.json path or checkpoint folder"])
    return ModelShape(name=f["name"], hidden=f["hidden"], kda_heads=f["kda_heads"], mla_heads=f["mla_heads"],
                      q_lora=f["q_lora"], kda="kda" in f["layer_kinds"], mla="mla" in f["layer_kinds"],
                      gate=f["kda_gate"], ffn=ffn_shape(f))


def _shape(model) -> ModelShape:
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, str):
        return get_model(model)
    if hasattr(model, "kernel_shape"):
        return model.kernel_shape()
    raise SpecError("model", type(model).__name__, ["ModelShape", "a preset name", "an object with kernel_shape()"])


def model_gemm_shapes(model, tp: int = 1) -> list[tuple[int, int]]:
    """(N, K) of every FP8 linear of a rank (as the loader fuses and pads them), sorted."""
    m = _shape(model)
    hk, hm = m.heads_at(tp)
    out = set()
    if m.kda:
        d = hk * 128
        out |= {(4 * d, m.hidden), (-(-(128 + hk) // KDA_FAB_ALIGN) * KDA_FAB_ALIGN, m.hidden), (m.hidden, d)}
    if m.mla and m.q_lora is None:
        # No q LoRA (Kimi-Linear): A-projection [c_kv 512 | k_pe 64 | pad 64 | gate H * 128] and a plain
        # q_proj (H * 192, hidden) of its own; W_UK is absorbed in PyTorch (model/layers.py).
        out |= {(MLA_A_PAD + hm * 128, m.hidden), (hm * 192, m.hidden), (m.hidden, hm * 128)}
    elif m.mla:
        _need_q_lora(m)
        # Q-B (H * 192, q_lora) runs as its own GEMM in the unabsorbed prefill (decode fuses it into
        # mla_q_absorb, whose gemm_spec is the same kernel).
        out |= {(m.q_lora + MLA_A_PAD + hm * 128, m.hidden), (hm * 192, m.q_lora), (m.hidden, hm * 128)}
    f = m.ffn
    if f is not None:
        # The FFN's FP8 linears: the latent projections (replicated), the fused [gate | up] and down of
        # the shared experts and the dense MLP (by intermediate over the ranks, padded to whole tiles).
        if f.moe and f.moe_latent is not None:
            out |= {(f.moe_latent, m.hidden), (m.hidden, f.moe_latent)}
        for on, inter in ((f.moe, f.shared_inter), (f.dense, f.dense_inter)):
            if on and inter:
                w = glu_width(inter, tp)
                out |= {(2 * w, m.hidden), (m.hidden, w)}
    return sorted(out)


def _act_quant_ks(m: ModelShape, tp: int):
    """K of the GEMMs whose BF16 input goes through act_quant_fp8 (None: all, without FFN kernels).
    With them, the layers' inputs come quantized from attn_res, the GLU down inputs from glu_act and
    routed_expert_up_proj's from routed_expert_norm (an attn_res over the latent); what remains is
    o_proj (the attention output), the prefill's Q-B input and a latent without its norm."""
    f = m.ffn
    if f is None:
        return None
    hk, hm = m.heads_at(tp)
    ks = set()
    if m.kda:
        ks.add(hk * 128)
    if m.mla:
        ks.add(hm * 128)
        if m.q_lora is not None:
            ks.add(m.q_lora)
    if f.moe and f.moe_latent is not None and not f.latent_norm:
        ks.add(f.moe_latent)
    return ks


def ffn_specs(target: Target, m: ModelShape, tp: int, recipe: ScaleRecipe, ep: int = 1,
              experts: str | None = None) -> list[OpSpec]:
    """The FFN and residual-stream kernels of a rank (model/ops.py KernelOps launches them): the
    router (router_logits where its spec module's `has_kernel`, moe_route), the AttnRes mix + RMSNorm + FP8
    quantization for each delta kind it fuses (none: layer 0's input; bf16: an attention output; fp32:
    an FFN output), routed_expert_norm as a one-source attn_res over the latent, glu_act of the shared
    experts and the dense MLP, and the routed experts (`expert_specs`)."""
    from k3gen.ops.attn_res.spec import AttnResSpec, ResDelta
    from k3gen.ops.glu_act.spec import GluActSpec, GluKind
    from k3gen.ops.moe_route.spec import MoeRouteSpec
    from k3gen.ops.router_logits.spec import RouterLogitsSpec, RouterWeight, has_kernel
    f = m.ffn
    if f is None:
        return []
    out: list[OpSpec] = []
    if f.moe and has_kernel(target, m.hidden, f.experts):
        out.append(RouterLogitsSpec(target=target, hidden=m.hidden, experts=f.experts, weight=RouterWeight.FP32))
    if f.moe:
        out.append(MoeRouteSpec(target=target, experts=f.experts, top_k=f.top_k, n_group=f.n_group,
                                topk_group=f.topk_group, renormalize=f.renormalize, routed_scale=f.routed_scale))
    out += [AttnResSpec(target=target, hidden=m.hidden, max_sources=f.max_sources, eps=f.eps, recipe=recipe, delta=d)
            for d in ResDelta]
    if f.moe and f.moe_latent is not None and f.latent_norm:
        out.append(AttnResSpec(target=target, hidden=f.moe_latent, max_sources=1, eps=f.eps, recipe=recipe))
    act = GluKind(f.act)
    betas = dict(beta=f.situ_beta, linear_beta=f.situ_linear_beta) if act is GluKind.SITU else {}
    for w in sorted({glu_width(i, tp) for on, i in ((f.moe, f.shared_inter), (f.dense, f.dense_inter)) if on and i}):
        out.append(GluActSpec(target=target, inter=w, act=act, recipe=recipe, **betas))
    return out + expert_specs(target, m, tp, ep, experts)


EXPERT_FORMATS = ("mxfp4", "nvfp4", "bf16")


def has_expert_kernel(target: Target) -> bool:
    """Whether `target` builds moe_experts: its menu has the op (SM90's mma.sync kernel, the SM100
    family's tcgen05 one; the frozen sm100-mxfp4 menu does not), and a variant exists for its
    features (mma.sync needs no FP4 hardware; tcgen05 needs tcgen05, TMA and the FP4 conversion).
    Elsewhere the model keeps the routed experts on its PyTorch stand-in."""
    if "moe_experts" not in target.menu:
        return False
    return not target.fp4_cvt or (target.mma == "tcgen05" and target.tma)


@functools.lru_cache(maxsize=None)   # the model asks once per MLA layer and prefill step
def has_prefill_kernel(target: Target) -> bool:
    """Whether `target` builds mla_prefill: the op is on its menu and one of the op's variants
    implements it there (ops/mla_prefill/variants.py decides by the target's features: wgmma on
    sm_90a, tcgen05 on sm103/sm107). Elsewhere the model keeps its PyTorch prefill attention."""
    if "mla_prefill" not in target.menu:
        return False
    from k3gen.ops.mla_prefill.spec import MlaPrefillSpec
    try:
        MlaPrefillSpec(target=target, heads=1)
    except SpecError:
        return False
    return True


def expert_specs(target: Target, m: ModelShape, tp: int, ep: int = 1, experts: str | None = None) -> list[OpSpec]:
    """moe_experts of a rank for the checkpoint's expert format `experts` (None: each FP4 format a
    checkpoint may carry, MXFP4 the official one, NVFP4 ModelOpt's: what a build for the model
    holds before a checkpoint is chosen; "bf16": none), at its experts (experts / ep, numbered from rank's base in the router's
    experts) and its share of each expert's intermediate (moe_inter / (tp / ep)), on BF16 latent
    rows (W4A16: routed_expert_down_proj writes BF16). BF16 experts (a plain save_pretrained) have
    no kernel: model/ffn_ops.py runs them on the PyTorch stand-in. Empty where the target has no
    moe_experts kernel (its SpecError says which variant refused)."""
    from k3gen.ops.moe_experts.spec import GluAct, MoeExpertsSpec, WeightFormat
    if experts is not None and experts not in EXPERT_FORMATS:
        raise SpecError("experts", experts, [None, *EXPERT_FORMATS], "the checkpoint's routed-expert format")
    f = m.ffn
    if f is None or not f.moe or not f.experts or not f.moe_inter or experts == "bf16":
        return []
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or tp % ep or f.experts % ep \
            or f.moe_inter % (tp // ep):
        raise SpecError("ep", ep, f"a divisor of tp {tp} and of the {f.experts} experts",
                        f"moe_inter {f.moe_inter} split over tp / ep ranks")
    betas = dict(situ_beta=f.situ_beta, situ_linear_beta=f.situ_linear_beta) if f.act == "situ" else {}
    out: list[OpSpec] = []
    for fmt in WeightFormat if experts is None else (WeightFormat(experts),):
        try:
            out.append(MoeExpertsSpec(target=target, weights=fmt, hidden=f.moe_latent or m.hidden,
                                      inter=f.moe_inter // (tp // ep), experts=f.experts // ep, top_k=f.top_k,
                                      route_experts=f.experts, glu=GluAct(f.act), **betas))
        except SpecError:
            if has_expert_kernel(target):
                raise
    return out




def _need_q_lora(m: ModelShape) -> None:
    from k3gen.ops.mla_q_absorb.spec import Q_LORA
    if m.q_lora != Q_LORA:
        raise SpecError("q_lora", m.q_lora, [Q_LORA], f"model {m.name}: mla_q_absorb reads a {Q_LORA}-wide q "
                        "LoRA; an MLA without one has no kernels yet")


def attention_tokens(kv: KvDtype, max_drafts: int) -> list[int]:
    """Query tokens per mla_decode launch: decode (1) and verify (1 + drafts); NVFP4 verify launches
    per token (model/ops.py says why)."""
    if kv is KvDtype.NVFP4 or not max_drafts:
        return [1]
    return [1, 1 + max_drafts]


def mla_decode_spec(target: Target, heads: int, layout: KvLayout, tokens: int) -> OpSpec:
    """The attention spec whose KvLayout is exactly the cache's (page, FP8 scale granularity, NVFP4
    scale layout, HP tail ring of 16 + drafts rows)."""
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    nvfp4 = layout.kv is KvDtype.NVFP4
    kw = dict(target=target, heads=heads, kv=layout.kv, fp8_scales=layout.fp8_scales,
              scale_layout=layout.scale_layout if nvfp4 else None, max_drafts=layout.max_drafts)
    # Verify uses the decode step's schedule (the one "auto" picks at T = 1), whose rows are bitwise
    # independent of the query tiling: speculative decoding then reproduces greedy decoding except at
    # exact ties, instead of at any near-tie two schedules round apart.
    spec = MlaDecodeSpec(tokens=tokens, schedule=MlaDecodeSpec(tokens=1, **kw).schedule, **kw)
    if spec.layout.tensors() != layout.tensors() or spec.page != layout.page:
        raise SpecError("kv_layout", str(layout), [str(spec.layout)], "mla_decode reads the cache's own layout")
    return spec


def rank_specs(target: Target, *, kda_heads: int | None, mla_heads: int | None, gemm_shapes,
               serving: ServingOptions, gate: GateKind = GateKind.BOUNDED, q_absorb: bool = True,
               act_quant_ks=None) -> list[OpSpec]:
    """The specs one rank launches, from its per-rank head counts (None: no such layers) and the
    (N, K) of its FP8 linears: model_specs' core, also what KernelOps built from heads reads.
    q_absorb=False: an MLA without a q LoRA, which never launches mla_q_absorb. `act_quant_ks`: the
    K of every act_quant_fp8 launched (None: every GEMM's K; model_specs passes fewer when the
    AttnRes stream, routed_expert_norm and glu_act quantize the other GEMMs' inputs themselves)."""
    from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec
    from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
    from k3gen.ops.kda_decode.spec import KdaDecodeSpec
    from k3gen.ops.kda_prefill.spec import KdaPrefillSpec
    from k3gen.ops.kda_verify.spec import KdaVerifySpec
    from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
    from k3gen.ops.mla_q_absorb.spec import MlaQAbsorbSpec
    from k3gen.ops.mla_vb_gate.spec import MlaVbGateSpec
    s = check_serving(target, serving)
    t, r, m = target, s.recipe, s.max_drafts
    out: list[OpSpec] = []
    if kda_heads:
        out += [KdaDecodeSpec(target=t, heads=kda_heads, ssm=s.ssm, gate=gate),
                KdaPrefillSpec(target=t, heads=kda_heads, ssm=s.ssm, gate=gate)]
        if m:
            out.append(KdaVerifySpec(target=t, heads=kda_heads, drafts=m, ssm=s.ssm, gate=gate))
    if mla_heads:
        lay = serving_kv_layout(t, s)
        qa = MlaQAbsorbSpec(target=t, heads=mla_heads, recipe=r)
        out += [KvCacheWriteSpec(target=t, kv=lay.kv, fp8_scales=lay.fp8_scales, max_drafts=lay.max_drafts),
                *([qa, qa.gemm_spec] if q_absorb else []), MlaVbGateSpec(target=t, heads=mla_heads)]
        out += [mla_decode_spec(t, mla_heads, lay, T) for T in attention_tokens(lay.kv, m)]
        if has_prefill_kernel(t):
            from k3gen.ops.mla_prefill.spec import MlaPrefillSpec
            out.append(MlaPrefillSpec(target=t, heads=mla_heads))
    shapes = sorted(set(gemm_shapes))
    out += [Fp8BlockGemmSpec(target=t, n=n, k=k, recipe=r) for n, k in shapes]
    ks = {k for _, k in shapes} if act_quant_ks is None else set(act_quant_ks)
    out += [ActQuantFp8Spec(target=t, k=k, recipe=r) for k in sorted(ks)]
    return _unique(_on_menu(t, out))


def model_specs(target: Target, model, tp: int = 1, ep: int = 1,
                serving: ServingOptions | None = None, experts: str | None = None) -> list[OpSpec]:
    """Exactly the specs one rank of `model` (a ModelShape, preset name or ModelConfig) launches at
    tensor-parallel degree `tp` with `serving` (default: the target's first KV and SSM dtypes, no
    drafts) and `ep` expert-parallel ranks, for routed experts stored as `experts` (`expert_specs`); the
    router, latent and shared projections, glu_act and the AttnRes stream are listed (`ffn_specs`)."""
    m = _shape(model)
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise SpecError("ep", ep, "a positive int")
    serving = serving or ServingOptions(kv=target.kv_dtypes[0], ssm=target.ssm_dtypes[0])
    hk, hm = m.heads_at(tp)
    shapes = model_gemm_shapes(m, tp)
    specs = rank_specs(target, kda_heads=hk if m.kda else None, mla_heads=hm if m.mla else None,
                       gemm_shapes=shapes, serving=serving, gate=m.gate, q_absorb=m.q_lora is not None,
                       act_quant_ks=_act_quant_ks(m, tp))
    return _unique(specs + _on_menu(target, ffn_specs(target, m, tp, check_serving(target, serving).recipe, ep,
                                                                experts)))


def serving_sweep(target: Target, kv: KvDtype | None = None, ssm: SsmDtype | None = None,
                  drafts=(0, 3, 7), recipes=None) -> list[ServingOptions]:
    """Every serving setting a build covers: kv/ssm/recipes narrow (None: all the target allows)."""
    if kv is not None and kv not in target.kv_dtypes:
        raise TargetError("kv", kv.value, [x.value for x in target.kv_dtypes], f"target {target.name}")
    if ssm is not None and ssm not in target.ssm_dtypes:
        raise TargetError("ssm", ssm.value, [s.value for s in target.ssm_dtypes], f"target {target.name}")
    return [ServingOptions(kv=k, ssm=s, max_drafts=d, recipe=r)
            for k in (target.kv_dtypes if kv is None else (kv,)) for s in (target.ssm_dtypes if ssm is None else (ssm,))
            for d in drafts for r in (target.recipes if recipes is None else recipes)]


def sweep_specs(target: Target, model, tps=(1,), servings=()) -> list[OpSpec]:
    """model_specs over several TP degrees and serving settings, each spec once (first-seen order)."""
    return _unique([s for tp in tps for o in servings for s in model_specs(target, model, tp, serving=o)])


def _on_menu(target: Target, specs: list[OpSpec]) -> list[OpSpec]:
    for s in specs:
        if s.op not in target.menu:
            raise TargetError("op", s.op, list(target.menu), f"target {target.name} does not build it")
    return specs


def _unique(specs) -> list[OpSpec]:
    out: dict[str, OpSpec] = {}
    for s in specs:
        out.setdefault(s.digest(), s)
    return list(out.values())


class SpecMenu:
    """The specs of one enumeration, found by (op, fields): how the model resolves each kernel it
    launches, so a launch the enumerator does not list fails loudly instead of compiling."""

    def __init__(self, specs):
        self.specs = list(specs)
        self._memo: dict = {}

    def find(self, op: str, **want) -> OpSpec:
        key = (op, tuple(sorted((k, str(v)) for k, v in want.items())))
        hit = self._memo.get(key)
        if hit is None:
            hits = [s for s in self.specs if s.op == op and all(getattr(s, k) == v for k, v in want.items())]
            if len(hits) != 1:
                have = sorted({s.slug() for s in self.specs if s.op == op})
                raise SpecError(op, want, have or ["none"],
                                f"{len(hits)} specs of model_specs match; the model launches only what it lists")
            hit = self._memo[key] = hits[0]
        return hit


# -- the committed trees --------------------------------------------------------------------------

# The committed generated/<target>/ trees hold K3 at these TP degrees for every serving setting.
DEFAULT_MODEL = "k3"
DEFAULT_TPS = (8, 1)
DEFAULT_DRAFTS = (0, 3, 7)
# Head counts and drafts that tests and benches import (the K3 TP8 / TP1 ranks).
KDA_VERIFY_HEADS = (12, 96)
KDA_VERIFY_DRAFTS = (3, 7)
KDA_PREFILL_HEADS = (12, 96)
MLA_HEADS = (12, 96)
# KDA decode at every K3 TP degree TP1..TP16 (tests/benches sweep them) and Kimi-Linear's gate.
KDA_DECODE_HEADS = (6, 12, 24, 48, 96)
# FP8 GEMM shapes the benches and wgmma tests sweep: q_a alone (the model fuses it into the
# A-projection), Q-B, o_proj and the fused KDA [q|k|v|g] at TP8 (H = 12) and TP1 (H = 96).
FP8_GEMM_TP8 = ((1536, 7168), (12 * 192, 1536), (7168, 12 * 128), (4 * 12 * 128, 7168))
FP8_GEMM_TP1 = ((96 * 192, 1536), (7168, 96 * 128), (4 * 96 * 128, 7168))
ACT_QUANT_K = (1536, 7168)
MLA_DECODE_SHAPES = ((12, 1), (12, 4), (96, 1), (96, 4))


def build_specs(target: Target, kv: KvDtype | None = None, ssm: SsmDtype | None = None) -> list[OpSpec]:
    """The specs of a target's committed tree: model_specs of K3 at DEFAULT_TPS over every serving
    setting (kv/ssm narrow; None means every dtype the target supports), plus the kernels tests and
    benches use that no default model launches (`_extra_specs`). A frozen target lists what landed.

    The generated source tree of a target always holds the full list; a narrowed build only
    compiles fewer cubins.
    """
    if target.frozen:
        return _frozen_specs(target, kv, ssm)
    servings = serving_sweep(target, kv, ssm, DEFAULT_DRAFTS)
    # M = 7 KDA verify on sm_90a holds one CTA per SM (KdaVerifySpec.blocks_per_sm): the trees keep
    # kernels at two (tests/nogpu/ops/test_kda_verify_spec.py); `k3gen build --model` and prebuild build it.
    model = [s for s in sweep_specs(target, DEFAULT_MODEL, DEFAULT_TPS, servings)
             if s.op != "kda_verify" or s.blocks_per_sm == 2]
    return _unique(model + _extra_specs(target, kv, ssm))


def _extra_specs(target: Target, kv: KvDtype | None, ssm: SsmDtype | None) -> list[OpSpec]:
    """In the trees for tests and benches, launched by no default model: KDA decode at K3's other TP
    head counts and with Kimi-Linear's softplus gate; FP8 per-tensor KV writes; NVFP4 multi-token
    attention (the model runs NVFP4 verify per token); act_quant with the recipes the target's
    GEMMs do not take; the q_a GEMM alone (the model fuses it into the A-projection)."""
    from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec
    from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
    from k3gen.ops.kda_decode.spec import KdaDecodeSpec
    from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
    t = target
    kvs = t.kv_dtypes if kv is None else (kv,)
    out: list[OpSpec] = []
    for s in t.ssm_dtypes if ssm is None else (ssm,):
        out += [KdaDecodeSpec(target=t, heads=h, ssm=s) for h in KDA_DECODE_HEADS]
        out.append(KdaDecodeSpec(target=t, heads=12, ssm=s, gate=GateKind.SOFTPLUS))
    if KvDtype.FP8 in kvs:
        out.append(KvCacheWriteSpec(target=t, kv=KvDtype.FP8, fp8_scales=Fp8ScaleGranularity.PER_TENSOR))
    if KvDtype.NVFP4 in kvs:
        lay = serving_kv_layout(t, ServingOptions(kv=KvDtype.NVFP4, max_drafts=3))
        out += [mla_decode_spec(t, h, lay, T) for h, T in MLA_DECODE_SHAPES if T > 1]
    out += [ActQuantFp8Spec(target=t, k=k, recipe=r) for k in ACT_QUANT_K for r in ScaleRecipe if r not in t.recipes]
    out += [Fp8BlockGemmSpec(target=t, n=n, k=k, recipe=r) for n, k in FP8_GEMM_TP8[:1] for r in t.recipes]
    return _on_menu(t, out)


def _frozen_specs(target: Target, kv: KvDtype | None, ssm: SsmDtype | None) -> list[OpSpec]:
    """What the original target landed (frozen byte for byte, tests/golden): its KV writes and the
    original shared verify kernel, FP32 state, K3 TP8/TP1 heads, M = 3 and 7."""
    from k3gen.ops.kda_verify.spec import KdaVerifySpec, VerifyVariant
    from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
    specs: list[OpSpec] = []
    for k in target.kv_dtypes if kv is None else (kv,):
        if k not in target.kv_dtypes:
            raise TargetError("kv", k.value, [x.value for x in target.kv_dtypes], f"target {target.name}")
        grans = tuple(Fp8ScaleGranularity) if k is KvDtype.FP8 else (Fp8ScaleGranularity.PER_TOKEN_128,)
        specs += [KvCacheWriteSpec(target=target, kv=k, fp8_scales=g) for g in grans]
    if ssm is not None and ssm not in target.ssm_dtypes:
        raise TargetError("ssm", ssm.value, [s.value for s in target.ssm_dtypes], f"target {target.name}")
    specs += [KdaVerifySpec(target=target, heads=h, drafts=m, variant=VerifyVariant.ORIGINAL)
              for h in KDA_VERIFY_HEADS for m in KDA_VERIFY_DRAFTS]
    return _on_menu(target, specs)

