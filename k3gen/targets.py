"""The registry of target presets and which specs each builds.

`sm103-nvfp4` and `sm107-nvfp4` are thin presets over one NVFP4 implementation: they differ
only in arch. `sm100-mxfp4` is the original target: its generated sources are frozen once landed.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.errors import SpecError, TargetError
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout, ScaleRecipe, SsmDtype
from k3gen.ir.layouts import PAGE_TOKENS
from k3gen.ir.spec import OpSpec
from k3gen.ir.target import Target


def _nvfp4(name: str, arch: str, sm: int) -> Target:
    return Target(name=name, arch=arch, sm=sm, mma="tcgen05", fp4_cvt=True,
                  kv_dtypes=(KvDtype.BF16, KvDtype.FP8, KvDtype.NVFP4),
                  ssm_dtypes=(SsmDtype.FP32, SsmDtype.BF16),
                  nvfp4_scale_layout=ScaleLayout.SWIZZLE_128X4, scale_recipe=ScaleRecipe.UE8M0)


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target(name="sm90", arch="sm_90a", sm=90, mma="wgmma", fp4_cvt=False,
           kv_dtypes=(KvDtype.BF16, KvDtype.FP8, KvDtype.NVFP4),
           ssm_dtypes=(SsmDtype.FP32, SsmDtype.BF16),
           nvfp4_scale_layout=ScaleLayout.LINEAR, scale_recipe=ScaleRecipe.FP32,
           notes="Hopper (H100/H200): runs here; FP4 decoded in software"),
    Target(name="sm100-mxfp4", arch="sm_100a", sm=100, mma="tcgen05", fp4_cvt=True,
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


@dataclass(frozen=True, kw_only=True)
class ServingOptions:
    """Deployment choices validated against a target (the restrictions of SPEC.md section 5)."""
    kv: KvDtype
    ssm: SsmDtype = SsmDtype.FP32
    page: int | None = None
    max_drafts: int = 0
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
    return ServingOptions(**{**opts.__dict__, "page": page})


def build_specs(target: Target, kv: KvDtype | None = None, ssm: SsmDtype | None = None) -> list[OpSpec]:
    """The specs a target builds. kv/ssm narrow the list; None means every dtype it supports.

    The generated source tree of a target always holds the full list; a narrowed build only
    compiles fewer cubins.
    """
    from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec

    kvs = target.kv_dtypes if kv is None else (kv,)
    specs: list[OpSpec] = []
    for k in kvs:
        if k not in target.kv_dtypes:
            raise TargetError("kv", k.value, [x.value for x in target.kv_dtypes], f"target {target.name}")
        if k is KvDtype.FP8:
            for g in Fp8ScaleGranularity:
                specs.append(KvCacheWriteSpec(target=target, kv=k, fp8_scales=g))
        elif k is KvDtype.NVFP4:
            for m in (0, 3, 7):
                specs.append(KvCacheWriteSpec(target=target, kv=k, max_drafts=m))
        else:
            specs.append(KvCacheWriteSpec(target=target, kv=k))
    if ssm is not None and ssm not in target.ssm_dtypes:
        raise TargetError("ssm", ssm.value, [s.value for s in target.ssm_dtypes], f"target {target.name}")
    specs += _kda_decode_specs(target, ssm)
    specs += _kda_verify_specs(target, ssm)
    specs += _kda_prefill_specs(target, ssm)
    specs += _act_quant_specs(target)
    specs += _fp8_proj_specs(target)
    specs += _mla_decode_specs(target, kv)
    return specs


# Activation quantization ahead of the FP8 block GEMMs: K = hidden (7168) and q_lora (1536).
ACT_QUANT_K = (1536, 7168)


def _act_quant_specs(target: Target) -> list[OpSpec]:
    from k3gen.ir.dtypes import ScaleRecipe
    from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec
    if target.frozen:  # the original target gains ops only once they are final
        return []
    return [ActQuantFp8Spec(target=target, k=k, recipe=r) for k in ACT_QUANT_K for r in ScaleRecipe]


# KDA decode per-rank head counts (TP1..TP16); the original target does not carry the fused op.
KDA_DECODE_HEADS = (6, 12, 24, 48, 96)
KDA_DECODE_TARGETS = ("sm90", "sm103-nvfp4", "sm107-nvfp4")


def _kda_decode_specs(target: Target, ssm: SsmDtype | None) -> list[OpSpec]:
    from k3gen.ir.dtypes import GateKind
    from k3gen.ops.kda_decode.spec import KdaDecodeSpec
    if target.name not in KDA_DECODE_TARGETS:
        return []
    out: list[OpSpec] = []
    for s in target.ssm_dtypes if ssm is None else (ssm,):
        out += [KdaDecodeSpec(target=target, heads=h, ssm=s, gate=GateKind.BOUNDED) for h in KDA_DECODE_HEADS]
        out.append(KdaDecodeSpec(target=target, heads=12, ssm=s, gate=GateKind.SOFTPLUS))  # Kimi-Linear gate
    return out


# FP8 block GEMMs of the K3 projections (N, K) at TP8 (H = 12) and TP1 (H = 96): q_a, q_b, o_proj,
# the fused KDA [q|k|v|g] projection; plus the MLA query path and V-B/gate ops around them.
# The original target does not carry them (its sources freeze on landing).
FP8_PROJ_TARGETS = ("sm90", "sm103-nvfp4", "sm107-nvfp4")
FP8_GEMM_TP8 = ((1536, 7168), (12 * 192, 1536), (7168, 12 * 128), (4 * 12 * 128, 7168))
FP8_GEMM_TP1 = ((96 * 192, 1536), (7168, 96 * 128), (4 * 96 * 128, 7168))
MLA_HEADS = (12, 96)


def _fp8_proj_specs(target: Target) -> list[OpSpec]:
    from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
    from k3gen.ops.mla_q_absorb.spec import MlaQAbsorbSpec
    from k3gen.ops.mla_vb_gate.spec import MlaVbGateSpec
    if target.name not in FP8_PROJ_TARGETS:
        return []
    # Hopper runs both recipes here (the H200 tests pair each with its own activations).
    recipes = tuple(ScaleRecipe) if target.name == "sm90" else (target.scale_recipe,)
    out: dict[str, OpSpec] = {}
    for n, k in FP8_GEMM_TP8:
        for r in recipes:
            s = Fp8BlockGemmSpec(target=target, n=n, k=k, recipe=r)
            out[s.digest()] = s
    for n, k in FP8_GEMM_TP1:
        s = Fp8BlockGemmSpec(target=target, n=n, k=k, recipe=target.scale_recipe)
        out[s.digest()] = s
    for h in MLA_HEADS:
        for s in (MlaQAbsorbSpec(target=target, heads=h), MlaVbGateSpec(target=target, heads=h)):
            out[s.digest()] = s
            if isinstance(s, MlaQAbsorbSpec):
                out.setdefault(s.gemm_spec.digest(), s.gemm_spec)
    return list(out.values())


# KDA verify (M drafts) on the targets that own it, TP8 and TP1 head counts. Only builds that hold
# 128 registers without spills (two CTAs per SM; tests/nogpu/test_build.py) are listed: M = 7 on
# sm_90a needs one CTA per SM (KdaVerifySpec.blocks_per_sm) and is JIT-compiled / prebuilt for the
# GPU tests instead.
KDA_VERIFY_HEADS = (12, 96)
KDA_VERIFY_DRAFTS = (3, 7)
# KDA prefill: the chunk16 (WY, tensor-core) kernel at one CTA per SM (<= 255 registers, no spills;
# tests/nogpu/test_build.py admits that occupancy for this op). The token-sequential algo is a
# cross-check, compiled on first use.
KDA_PREFILL_HEADS = (12, 96)
# The sm100-mxfp4 target's shared verify kernel: KdaVerifySpec(variant=ORIGINAL, ssm=FP32), the same
# head and draft counts. Its generated sources are frozen once landed (tests/golden: source bytes and
# the SASS they compile to, so a change to a shared header shows up too).
KDA_VERIFY_ORIGINAL_TARGETS = ("sm100-mxfp4",)


def _kda_prefill_specs(target: Target, ssm: SsmDtype | None) -> list[OpSpec]:
    from k3gen.ops.kda_prefill.spec import KdaPrefillSpec
    if target.name not in KDA_DECODE_TARGETS:
        return []
    return [KdaPrefillSpec(target=target, heads=h, ssm=s)
            for s in (target.ssm_dtypes if ssm is None else (ssm,)) for h in KDA_PREFILL_HEADS]


def _kda_verify_specs(target: Target, ssm: SsmDtype | None) -> list[OpSpec]:
    from k3gen.ops.kda_verify.spec import KdaVerifySpec, VerifyVariant
    if target.name in KDA_VERIFY_ORIGINAL_TARGETS:
        if ssm not in (None, SsmDtype.FP32):
            return []
        return [KdaVerifySpec(target=target, heads=h, drafts=m, variant=VerifyVariant.ORIGINAL)
                for h in KDA_VERIFY_HEADS for m in KDA_VERIFY_DRAFTS]
    if target.name not in KDA_DECODE_TARGETS:
        return []
    out: list[OpSpec] = []
    for s in target.ssm_dtypes if ssm is None else (ssm,):
        for h in KDA_VERIFY_HEADS:
            for m in KDA_VERIFY_DRAFTS:
                spec = KdaVerifySpec(target=target, heads=h, drafts=m, ssm=s)
                if spec.blocks_per_sm == 2:
                    out.append(spec)
    return out


# MLA decode attention: a few representative specs (TP8 and TP1 heads, decode and T = 4 verify).
# The SM100-family targets compile the same mma.sync kernel (the tcgen05 FP4 path is not written).
MLA_DECODE_TARGETS = ("sm90", "sm103-nvfp4", "sm107-nvfp4")
MLA_DECODE_SHAPES = ((12, 1), (12, 4), (96, 1), (96, 4))


def _mla_decode_specs(target: Target, kv: KvDtype | None) -> list[OpSpec]:
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    if target.name not in MLA_DECODE_TARGETS:
        return []
    kvs = target.kv_dtypes if kv is None else (kv,)
    return [MlaDecodeSpec(target=target, heads=h, tokens=t, kv=k, max_drafts=3 if k is KvDtype.NVFP4 else 0)
            for k in kvs for h, t in MLA_DECODE_SHAPES]
