"""The specs the GPU tests (and the benches sharing their bundle) launch beyond the committed sm90
tree, as plain data: tools/prebuild_gpu.py builds them ahead of time without executing a test
module, and a test module may take its list from here.

Collected once from the test modules of 6a6bb6c the way prebuild used to (every OpSpec in a
module's globals plus its `prebuild_specs()`, since deleted), written as constructor calls with the fields that
differ from the defaults. Not carried over: the `token` KDA prefill algorithm and the BF16
tokens-on-M `wgmma` mla_decode schedule, both deleted (issue 19). The model tests' lists are
enumerator calls (targets.model_specs), as the model resolves its kernels through it.
"""
from __future__ import annotations

from k3gen.ir.dtypes import Fp8ScaleGranularity, GateKind, KvDtype, ScaleLayout, ScaleRecipe, SsmDtype
from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec
from k3gen.ops.attn_res.spec import AttnResSpec, ResDelta
from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
from k3gen.ops.kda_decode.spec import KdaDecodeSpec
from k3gen.ops.kda_prefill.spec import KdaPrefillSpec, PrefillAlgo
from k3gen.ops.kda_verify.spec import KdaVerifySpec, VerifyVariant
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
from k3gen.ops.mla_decode.spec import MlaDecodeSpec
from k3gen.ops.mla_q_absorb.spec import MlaQAbsorbSpec
from k3gen.ops.mla_vb_gate.spec import MlaVbGateSpec
from k3gen.ops.moe_route.spec import MoeRouteSpec
from k3gen.targets import TARGETS, ServingOptions, model_specs

SM90 = TARGETS["sm90"]
# (KV, SSM) pairs the model tests run (tests/gpu/test_model_small.py, test_model_k3_layers.py).
MODEL_COMBOS = ((KvDtype.NVFP4, SsmDtype.BF16), (KvDtype.BF16, SsmDtype.FP32))


def act_quant_fp8() -> list:
    """tests/gpu/test_act_quant_fp8.py (the K3 K values come from the committed tree)."""
    return [
        ActQuantFp8Spec(target=SM90, k=128),
        ActQuantFp8Spec(target=SM90, k=128, recipe=ScaleRecipe.UE8M0),
    ]


def fp8_block_gemm() -> list:
    """tests/gpu/test_fp8_block_gemm.py and tools/sweep_gemm.py."""
    return [
        Fp8BlockGemmSpec(target=SM90, k=1536, n=2304),
        Fp8BlockGemmSpec(target=SM90, k=1536, n=2304, recipe=ScaleRecipe.UE8M0),
        Fp8BlockGemmSpec(target=SM90, k=272, n=200),
        Fp8BlockGemmSpec(target=SM90, k=272, n=200, recipe=ScaleRecipe.UE8M0),
        Fp8BlockGemmSpec(target=SM90, k=1536, n=7168),
        Fp8BlockGemmSpec(target=SM90, k=1536, n=7168, recipe=ScaleRecipe.UE8M0),
        Fp8BlockGemmSpec(target=SM90, k=7168, n=1536),
        Fp8BlockGemmSpec(target=SM90, k=7168, n=1536, recipe=ScaleRecipe.UE8M0),
        Fp8BlockGemmSpec(target=SM90, k=7168, n=200),
        Fp8BlockGemmSpec(target=SM90, k=7168, n=200, recipe=ScaleRecipe.UE8M0),
        Fp8BlockGemmSpec(target=SM90, k=96, n=64),
        Fp8BlockGemmSpec(target=SM90, k=96, n=64, recipe=ScaleRecipe.UE8M0),
        Fp8BlockGemmSpec(target=SM90, k=16, n=8),
        Fp8BlockGemmSpec(target=SM90, k=16, n=8, recipe=ScaleRecipe.UE8M0),
        Fp8BlockGemmSpec(target=SM90, bm=16, k=272, n=200),
        Fp8BlockGemmSpec(target=SM90, bm=16, k=272, n=200, recipe=ScaleRecipe.UE8M0),
        Fp8BlockGemmSpec(target=SM90, k=12288, n=7168),
        Fp8BlockGemmSpec(target=SM90, k=12288, n=7168, recipe=ScaleRecipe.UE8M0),
        Fp8BlockGemmSpec(target=SM90, k=7168, n=6144),
        Fp8BlockGemmSpec(target=SM90, k=7168, n=6144, recipe=ScaleRecipe.UE8M0),
        Fp8BlockGemmSpec(target=SM90, k=1536, n=18432),
        Fp8BlockGemmSpec(target=SM90, k=1536, n=18432, recipe=ScaleRecipe.UE8M0),
        Fp8BlockGemmSpec(target=SM90, k=7168, n=49152),
        Fp8BlockGemmSpec(target=SM90, k=7168, n=49152, recipe=ScaleRecipe.UE8M0),
    ]


def kda_prefill() -> list:
    """tests/gpu/test_kda_prefill.py and bench/cases/kda_prefill.py (chunk64, the only algo)."""
    out = [KdaPrefillSpec(target=SM90, algo=PrefillAlgo.CHUNK64, heads=h, ssm=s) for h in (6, 12, 96) for s in SsmDtype]
    out.append(KdaPrefillSpec(target=SM90, algo=PrefillAlgo.CHUNK64, gate=GateKind.SOFTPLUS, heads=12))
    return out


def kda_verify() -> list:
    """tests/gpu/test_kda_verify.py."""
    return [
        KdaVerifySpec(target=SM90, drafts=1, heads=6),
        KdaVerifySpec(target=SM90, drafts=1, heads=6, ssm=SsmDtype.BF16),
        KdaVerifySpec(target=SM90, drafts=3, heads=6),
        KdaVerifySpec(target=SM90, drafts=3, heads=6, ssm=SsmDtype.BF16),
        KdaVerifySpec(target=SM90, drafts=7, heads=6),
        KdaVerifySpec(target=SM90, drafts=7, heads=6, ssm=SsmDtype.BF16),
        KdaVerifySpec(target=SM90, drafts=1, heads=12),
        KdaVerifySpec(target=SM90, drafts=1, heads=12, ssm=SsmDtype.BF16),
        KdaVerifySpec(target=SM90, drafts=3, heads=12),
        KdaVerifySpec(target=SM90, drafts=3, heads=12, ssm=SsmDtype.BF16),
        KdaVerifySpec(target=SM90, drafts=7, heads=12),
        KdaVerifySpec(target=SM90, drafts=7, heads=12, ssm=SsmDtype.BF16),
        KdaVerifySpec(target=SM90, drafts=1, heads=96),
        KdaVerifySpec(target=SM90, drafts=1, heads=96, ssm=SsmDtype.BF16),
        KdaVerifySpec(target=SM90, drafts=3, heads=96),
        KdaVerifySpec(target=SM90, drafts=3, heads=96, ssm=SsmDtype.BF16),
        KdaVerifySpec(target=SM90, drafts=7, heads=96),
        KdaVerifySpec(target=SM90, drafts=7, heads=96, ssm=SsmDtype.BF16),
        KdaVerifySpec(target=SM90, drafts=3, heads=12, variant=VerifyVariant.ORIGINAL),
        KdaVerifySpec(target=SM90, drafts=3, gate=GateKind.SOFTPLUS, heads=12),
        KdaDecodeSpec(target=SM90, heads=6),
        KdaDecodeSpec(target=SM90, heads=6, ssm=SsmDtype.BF16),
        KdaDecodeSpec(target=SM90, heads=12),
        KdaDecodeSpec(target=SM90, heads=12, ssm=SsmDtype.BF16),
    ]


def kv_cache_write() -> list:
    """tests/gpu/test_kv_cache_write.py."""
    return [
        KvCacheWriteSpec(target=SM90, kv=KvDtype.BF16),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.BF16, threads=64),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.FP8),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.FP8, threads=256),
        KvCacheWriteSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, kv=KvDtype.FP8),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.NVFP4),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.NVFP4, max_drafts=3),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.NVFP4, max_drafts=7),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.NVFP4, scale_layout=ScaleLayout.SWIZZLE_128X4),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.NVFP4, max_drafts=3, scale_layout=ScaleLayout.SWIZZLE_128X4),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.NVFP4, max_drafts=7, scale_layout=ScaleLayout.SWIZZLE_128X4),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.NVFP4, max_drafts=3, threads=64),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.NVFP4, max_drafts=7, scale_layout=ScaleLayout.SWIZZLE_128X4, threads=256),
    ]


def mla_decode() -> list:
    """tests/gpu/test_mla_decode.py and `k3gen bench --op mla_decode` (bench/cases/mla_decode.py)."""
    return [
        MlaDecodeSpec(target=SM90, heads=12, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=12, schedule='mma', tokens=2),
        MlaDecodeSpec(target=SM90, heads=12, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, heads=12, schedule='mma', tokens=8),
        MlaDecodeSpec(target=SM90, heads=6, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=96, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=96, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, heads=128, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=12, kv=KvDtype.FP8, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=12, kv=KvDtype.FP8, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, heads=96, kv=KvDtype.FP8, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=16, kv=KvDtype.FP8, schedule='mma', tokens=8),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=12, kv=KvDtype.FP8, schedule='mma'),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=12, kv=KvDtype.FP8, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=96, kv=KvDtype.FP8, schedule='mma'),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=16, kv=KvDtype.FP8, schedule='mma', tokens=8),
        MlaDecodeSpec(target=SM90, heads=12, kv=KvDtype.NVFP4, max_drafts=3, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=12, kv=KvDtype.NVFP4, max_drafts=3, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, heads=96, kv=KvDtype.NVFP4, max_drafts=3, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=16, kv=KvDtype.NVFP4, max_drafts=3, schedule='mma', tokens=8),
        MlaDecodeSpec(target=SM90, heads=12, kv=KvDtype.NVFP4, max_drafts=7, scale_layout=ScaleLayout.SWIZZLE_128X4),
        MlaDecodeSpec(target=SM90, heads=12, kv=KvDtype.NVFP4, max_drafts=7, scale_layout=ScaleLayout.SWIZZLE_128X4, tokens=4),
        MlaDecodeSpec(target=SM90, heads=96, kv=KvDtype.NVFP4, max_drafts=7, scale_layout=ScaleLayout.SWIZZLE_128X4),
        MlaDecodeSpec(target=SM90, heads=16, kv=KvDtype.NVFP4, max_drafts=7, scale_layout=ScaleLayout.SWIZZLE_128X4, tokens=8),
        MlaDecodeSpec(target=SM90, heads=16, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=16, schedule='mma', tokens=2),
        MlaDecodeSpec(target=SM90, heads=16, tokens=2),  # wgmma_qm: QM_SHAPES (16, 2)
        MlaDecodeSpec(target=SM90, heads=16, schedule='mma', tokens=8),
        MlaDecodeSpec(target=SM90, heads=40, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=64, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=128, schedule='mma', tokens=2),
        MlaDecodeSpec(target=SM90, heads=128, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, heads=128, schedule='mma', tokens=8),
        MlaDecodeSpec(target=SM90, heads=12, kv=KvDtype.FP8),
        MlaDecodeSpec(target=SM90, heads=6, kv=KvDtype.FP8, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=6, kv=KvDtype.FP8),
        MlaDecodeSpec(target=SM90, heads=16, kv=KvDtype.FP8, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=16, kv=KvDtype.FP8),
        MlaDecodeSpec(target=SM90, heads=4, kv=KvDtype.FP8, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, heads=4, kv=KvDtype.FP8, tokens=4),
        MlaDecodeSpec(target=SM90, heads=8, kv=KvDtype.FP8, schedule='mma', tokens=2),
        MlaDecodeSpec(target=SM90, heads=8, kv=KvDtype.FP8, tokens=2),
        MlaDecodeSpec(target=SM90, heads=2, kv=KvDtype.FP8, schedule='mma', tokens=8),
        MlaDecodeSpec(target=SM90, heads=2, kv=KvDtype.FP8, tokens=8),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=12, kv=KvDtype.FP8),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=6, kv=KvDtype.FP8, schedule='mma'),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=6, kv=KvDtype.FP8),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=16, kv=KvDtype.FP8, schedule='mma'),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=16, kv=KvDtype.FP8),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=4, kv=KvDtype.FP8, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=4, kv=KvDtype.FP8, tokens=4),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=8, kv=KvDtype.FP8, schedule='mma', tokens=2),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=8, kv=KvDtype.FP8, tokens=2),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=2, kv=KvDtype.FP8, schedule='mma', tokens=8),
        MlaDecodeSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, heads=2, kv=KvDtype.FP8, tokens=8),
        MlaDecodeSpec(target=SM90, heads=12, kv=KvDtype.NVFP4, max_drafts=3),
        MlaDecodeSpec(target=SM90, heads=6, kv=KvDtype.NVFP4, max_drafts=3, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=6, kv=KvDtype.NVFP4, max_drafts=3),
        MlaDecodeSpec(target=SM90, heads=16, kv=KvDtype.NVFP4, max_drafts=3, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=16, kv=KvDtype.NVFP4, max_drafts=3),
        MlaDecodeSpec(target=SM90, heads=4, kv=KvDtype.NVFP4, max_drafts=3, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, heads=4, kv=KvDtype.NVFP4, max_drafts=3, tokens=4),
        MlaDecodeSpec(target=SM90, heads=8, kv=KvDtype.NVFP4, max_drafts=3, schedule='mma', tokens=2),
        MlaDecodeSpec(target=SM90, heads=8, kv=KvDtype.NVFP4, max_drafts=3, tokens=2),
        MlaDecodeSpec(target=SM90, heads=2, kv=KvDtype.NVFP4, max_drafts=3, schedule='mma', tokens=8),
        MlaDecodeSpec(target=SM90, heads=2, kv=KvDtype.NVFP4, max_drafts=3, tokens=8),
        MlaDecodeSpec(target=SM90, heads=12, kv=KvDtype.NVFP4, max_drafts=3, tokens=4),
        MlaDecodeSpec(target=SM90, heads=96, kv=KvDtype.NVFP4, max_drafts=3),
        MlaDecodeSpec(target=SM90, heads=12),
        MlaDecodeSpec(target=SM90, heads=6),
        MlaDecodeSpec(target=SM90, heads=12, tokens=4),
        MlaDecodeSpec(target=SM90, heads=40),
        MlaDecodeSpec(target=SM90, heads=64),
        MlaDecodeSpec(target=SM90, heads=96),
        MlaDecodeSpec(target=SM90, heads=128),
        MlaDecodeSpec(target=SM90, heads=128, tokens=2),
        MlaDecodeSpec(target=SM90, heads=16, tokens=8),
        MlaDecodeSpec(target=SM90, heads=128, tokens=8),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.BF16),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.FP8),
        KvCacheWriteSpec(target=SM90, fp8_scales=Fp8ScaleGranularity.PER_TENSOR, kv=KvDtype.FP8),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.NVFP4, max_drafts=3),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.NVFP4, max_drafts=7, scale_layout=ScaleLayout.SWIZZLE_128X4),
        MlaDecodeSpec(target=SM90, heads=96, tokens=4),
        MlaDecodeSpec(target=SM90, heads=128, tokens=4),
        MlaDecodeSpec(target=SM90, heads=96, kv=KvDtype.FP8, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, heads=128, kv=KvDtype.FP8, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=128, kv=KvDtype.FP8, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, heads=96, kv=KvDtype.NVFP4, max_drafts=3, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, heads=128, kv=KvDtype.NVFP4, max_drafts=3, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=128, kv=KvDtype.NVFP4, max_drafts=3, schedule='mma', tokens=4),
        MlaDecodeSpec(target=SM90, heads=12, kv=KvDtype.FP8, tokens=4),
        MlaDecodeSpec(target=SM90, heads=96, kv=KvDtype.FP8),
        MlaDecodeSpec(target=SM90, heads=96, kv=KvDtype.FP8, tokens=4),
        MlaDecodeSpec(target=SM90, heads=128, kv=KvDtype.FP8),
        MlaDecodeSpec(target=SM90, heads=128, kv=KvDtype.FP8, tokens=4),
        MlaDecodeSpec(target=SM90, heads=96, kv=KvDtype.NVFP4, max_drafts=3, tokens=4),
        MlaDecodeSpec(target=SM90, heads=128, kv=KvDtype.NVFP4, max_drafts=3),
        MlaDecodeSpec(target=SM90, heads=128, kv=KvDtype.NVFP4, max_drafts=3, tokens=4),
        MlaDecodeSpec(target=SM90, heads=16),
        MlaDecodeSpec(target=SM90, heads=32, schedule='mma'),
        MlaDecodeSpec(target=SM90, heads=32),
    ]


def mla_q_absorb() -> list:
    """tests/gpu/test_mla_q_absorb.py."""
    return [
        MlaQAbsorbSpec(target=SM90, heads=12),
        MlaQAbsorbSpec(target=SM90, heads=12, recipe=ScaleRecipe.UE8M0),
        Fp8BlockGemmSpec(target=SM90, k=1536, n=2304),
        Fp8BlockGemmSpec(target=SM90, k=1536, n=2304, recipe=ScaleRecipe.UE8M0),
    ]


def mla_vb_gate() -> list:
    """tests/gpu/test_mla_vb_gate.py."""
    return [
        MlaVbGateSpec(target=SM90, heads=12),
        MlaVbGateSpec(target=SM90, heads=96),
    ]


def mla_prefill() -> list:
    """tests/gpu/test_mla_prefill.py and bench/cases/mla_prefill.py: every kernel and output dtype at H 6 / 12 / 96."""
    from k3gen.ops.mla_prefill.spec import MlaPrefillSpec, OutDtype, PrefillKernel
    ok = MlaPrefillSpec.variants.reasons(MlaPrefillSpec(target=SM90, heads=12))   # sm_90a's kernels (not tcgen05)
    return [MlaPrefillSpec(target=SM90, heads=h, out_dtype=o, kernel=k) for h in (6, 12, 96) for o in OutDtype
            for k in tuple(PrefillKernel)[1:] if ok[k.value] is None]


def model_small() -> list:
    """tests/gpu/test_model_small.py: the small config at TP1 with 3 drafts."""
    return [s for kv, ssm in MODEL_COMBOS
            for s in model_specs(SM90, "small", 1, serving=ServingOptions(kv=kv, ssm=ssm, max_drafts=3))]


def model_small_tp2() -> list:
    """tests/gpu/test_dist.py's kernel-path TP2 (6 heads per rank), BF16 KV + FP32 SSM, 3 drafts."""
    return model_specs(SM90, "small", 2, serving=ServingOptions(kv=KvDtype.BF16, ssm=SsmDtype.FP32, max_drafts=3))


def model_k3_layers() -> list:
    """tests/gpu/test_model_k3_layers.py: K3's layers at TP8, no drafts."""
    return [s for kv, ssm in MODEL_COMBOS for s in model_specs(SM90, "k3", 8, serving=ServingOptions(kv=kv, ssm=ssm))]


def moe_route() -> list:
    """tests/gpu/test_moe_route.py and `k3gen bench --op moe_route` (bench/cases/moe_route.py)."""
    return [
        MoeRouteSpec(target=SM90, experts=896, top_k=16),
        MoeRouteSpec(target=SM90, experts=256, top_k=8, n_group=8, topk_group=4, routed_scale=2.5),
        MoeRouteSpec(target=SM90, experts=32, top_k=4),
        MoeRouteSpec(target=SM90, experts=64, top_k=6, renormalize=False, routed_scale=1.5),
        MoeRouteSpec(target=SM90, experts=8, top_k=2),
    ]


def attn_res() -> list:
    """tests/gpu/test_attn_res.py (with the act_quant_fp8 kernels it compares against) and
    `k3gen bench --op attn_res` (bench/cases/attn_res.py)."""
    return [
        AttnResSpec(target=SM90, hidden=7168),
        AttnResSpec(target=SM90, hidden=7168, recipe=ScaleRecipe.UE8M0),
        AttnResSpec(target=SM90, hidden=7168, fp8=False),
        AttnResSpec(target=SM90, hidden=7168, fp8=False, delta=ResDelta.BF16),
        AttnResSpec(target=SM90, hidden=7168, delta=ResDelta.FP32),
        AttnResSpec(target=SM90, hidden=1024, max_sources=4, delta=ResDelta.FP32),
        AttnResSpec(target=SM90, hidden=2304, max_sources=3, recipe=ScaleRecipe.UE8M0),
        ActQuantFp8Spec(target=SM90, k=7168),
        ActQuantFp8Spec(target=SM90, k=7168, recipe=ScaleRecipe.UE8M0),
        ActQuantFp8Spec(target=SM90, k=2304, recipe=ScaleRecipe.UE8M0),
        ActQuantFp8Spec(target=SM90, k=1024),
    ]


LISTS = {f.__name__: f for f in (act_quant_fp8, fp8_block_gemm, kda_prefill, kda_verify, kv_cache_write, mla_decode, mla_q_absorb, mla_vb_gate,
                                 model_small, model_small_tp2, model_k3_layers, moe_route, attn_res)}
LISTS["mla_prefill"] = mla_prefill


def all_specs() -> list:
    """Every list above, each spec once."""
    seen: dict[str, object] = {}
    for f in LISTS.values():
        for s in f():
            seen.setdefault(s.digest(), s)
    return list(seen.values())


def library() -> list:
    """tests/gpu/test_library.py: the one-head KDA kernels k3gen.api.fla launches (its other ops run at
    model_small's specs)."""
    from k3gen.api.fla import fla_specs
    return fla_specs(SM90)


LISTS["library"] = library


def hf_adapter() -> list:
    """tests/gpu/test_hf_adapter.py: what k3gen.api.hf launches for tests/hf_tiny.py's model (2 MLA
    heads, 8 experts top-2 in 2 groups, routed scale 1.5; tests/nogpu/library/test_hf_adapter_spec.py
    checks this list against k3gen.api.hf.specs of that model)."""
    from k3gen.api.fla import fla_specs
    return fla_specs(SM90) + [KvCacheWriteSpec(target=SM90, kv=KvDtype.BF16),
                              MlaDecodeSpec(target=SM90, heads=2, kv=KvDtype.BF16),
                              MoeRouteSpec(target=SM90, experts=8, top_k=2, n_group=2, topk_group=1, routed_scale=1.5)]


LISTS["hf_adapter"] = hf_adapter


def model_hf_tiny() -> list:
    """tests/gpu/test_model_checkpoints.py: the tiny transformers Kimi-Linear (tests/hf_tiny.py: softplus
    KDA gate, 2 KDA and 2 MLA heads, hidden 256, q_lora 1536 and a plain q_proj) at TP1 for every KV and
    SSM dtype, no drafts: enumerated from its config dict as the model resolves its kernels."""
    from k3gen.hf_config import config_fields
    from k3gen.targets import ModelShape
    from tests.hf_tiny import CASES, config_dict
    out = []
    for q_lora in CASES.values():
        f = config_fields(config_dict(q_lora))
        shape = ModelShape(name=f["name"], hidden=f["hidden"], kda_heads=f["kda_heads"], mla_heads=f["mla_heads"],
                           q_lora=f["q_lora"], gate=f["kda_gate"])
        out += [s for kv in KvDtype for ssm in SsmDtype
                for s in model_specs(SM90, shape, 1, serving=ServingOptions(kv=kv, ssm=ssm))]
    return out


LISTS["model_hf_tiny"] = model_hf_tiny


def moe_experts() -> list:
    """tests/gpu/test_moe_experts.py (its SPECS and K3 dicts) and `k3gen bench --op moe_experts`
    (bench/cases/moe_experts.py: K3 TP8 and EP8, MXFP4 and NVFP4, BF16 and FP8 activations)."""
    from k3gen.ops.moe_experts.spec import ActFormat, GluAct, MoeExpertsSpec, WeightFormat
    mx, nv, fp8 = WeightFormat.MXFP4, WeightFormat.NVFP4, ActFormat.FP8
    small = dict(hidden=512, inter=128, experts=32, top_k=4)
    tp8 = dict(hidden=3584, inter=384, experts=896, top_k=16)
    ep8 = dict(hidden=3584, inter=3072, experts=112, route_experts=896, top_k=16)
    out = [
        MoeExpertsSpec(target=SM90, weights=mx, **small),
        MoeExpertsSpec(target=SM90, weights=nv, **small),
        MoeExpertsSpec(target=SM90, weights=mx, act=fp8, recipe=ScaleRecipe.FP32, **small),
        MoeExpertsSpec(target=SM90, weights=nv, act=fp8, recipe=ScaleRecipe.UE8M0, **small),
        MoeExpertsSpec(target=SM90, weights=nv, hidden=384, inter=96, experts=16, top_k=6, glu=GluAct.SILU, n_tiles=1),
        MoeExpertsSpec(target=SM90, weights=mx, hidden=512, inter=128, experts=8, route_experts=32, top_k=4),
    ]
    for shape in (tp8, ep8):
        for w in (mx, nv):
            out += [MoeExpertsSpec(target=SM90, weights=w, **shape), MoeExpertsSpec(target=SM90, weights=w, act=fp8, **shape)]
    return out


LISTS["moe_experts"] = moe_experts


def glu_act() -> list:
    """tests/gpu/test_glu_act.py: SiTU at K3 TP8 (shared 768, dense 4224) and the small preset's width,
    SiLU at 1024, both recipes."""
    from k3gen.ops.glu_act.spec import GluActSpec, GluKind
    return [GluActSpec(target=SM90, recipe=r, **kw) for r in ScaleRecipe
            for kw in (dict(inter=768), dict(inter=4224), dict(inter=256), dict(inter=1024, act=GluKind.SILU))]


LISTS["glu_act"] = glu_act


def model_hf_tiny_ffn() -> list:
    """tests/gpu/test_model_checkpoints.py since issue 21: model_hf_tiny's kernels plus its FFN and
    residual-stream kernels (moe_route, attn_res, glu_act and the FFN GEMMs), enumerated from its config
    dict with the FFN shape as the model resolves them."""
    from k3gen.hf_config import config_fields
    from k3gen.targets import ModelShape, ffn_shape
    from tests.hf_tiny import CASES, config_dict
    out = []
    for q_lora in CASES.values():
        f = config_fields(config_dict(q_lora))
        shape = ModelShape(name=f["name"], hidden=f["hidden"], kda_heads=f["kda_heads"], mla_heads=f["mla_heads"],
                           q_lora=f["q_lora"], gate=f["kda_gate"], ffn=ffn_shape(f))
        out += [s for kv in KvDtype for ssm in SsmDtype
                for s in model_specs(SM90, shape, 1, serving=ServingOptions(kv=kv, ssm=ssm))]
    return out


LISTS["model_hf_tiny_ffn"] = model_hf_tiny_ffn


def fuzz_bounds() -> list:
    """tests/gpu/test_fuzz_bounds.py (issue 27's bad-index fuzzing): kernels the lists above hold too,
    named here so the fuzz test keeps its bundle if those lists change."""
    from k3gen.ir.dtypes import GateKind
    from k3gen.ops.moe_experts.spec import ActFormat, MoeExpertsSpec, WeightFormat
    nv3 = dict(kv=KvDtype.NVFP4, max_drafts=3, scale_layout=ScaleLayout.LINEAR)
    small = dict(hidden=512, inter=128, experts=32, top_k=4)
    return [
        KvCacheWriteSpec(target=SM90, kv=KvDtype.BF16), KvCacheWriteSpec(target=SM90, kv=KvDtype.FP8),
        KvCacheWriteSpec(target=SM90, **nv3),
        KvCacheWriteSpec(target=SM90, kv=KvDtype.NVFP4, max_drafts=7, scale_layout=ScaleLayout.SWIZZLE_128X4),
        MlaDecodeSpec(target=SM90, heads=12, tokens=4, schedule="mma"),
        MlaDecodeSpec(target=SM90, heads=12, tokens=1, schedule="wgmma_qm"),
        MlaDecodeSpec(target=SM90, heads=12, tokens=1, kv=KvDtype.FP8, schedule="wgmma"),
        MlaDecodeSpec(target=SM90, heads=12, tokens=1, schedule="wgmma", **nv3),
        MlaDecodeSpec(target=SM90, heads=12, tokens=4, schedule="mma", **nv3),
        KdaDecodeSpec(target=SM90, heads=12, gate=GateKind.BOUNDED, ssm=SsmDtype.FP32),
        KdaDecodeSpec(target=SM90, heads=12, gate=GateKind.BOUNDED, ssm=SsmDtype.BF16),
        KdaVerifySpec(target=SM90, heads=12, drafts=3, ssm=SsmDtype.BF16),
        KdaVerifySpec(target=SM90, heads=12, drafts=3, ssm=SsmDtype.FP32),
        KdaVerifySpec(target=SM90, heads=12, drafts=3, variant=VerifyVariant.ORIGINAL),
        MoeExpertsSpec(target=SM90, weights=WeightFormat.MXFP4, **small),
        MoeExpertsSpec(target=SM90, weights=WeightFormat.NVFP4, act=ActFormat.FP8, recipe=ScaleRecipe.UE8M0, **small),
        MoeExpertsSpec(target=SM90, weights=WeightFormat.MXFP4, hidden=512, inter=128, experts=8, route_experts=32,
                       top_k=4),
    ]


LISTS["fuzz_bounds"] = fuzz_bounds


def router_logits() -> list:
    """tests/gpu/test_router_logits.py: K3's router (7168 x 896), the small preset's and a 256-wide one,
    BF16 weights and FP32 ones (the model's stored router)."""
    from k3gen.ops.router_logits.spec import RouterLogitsSpec, RouterWeight
    return [RouterLogitsSpec(target=SM90, hidden=h, experts=e, weight=wt)
            for h, e in ((7168, 896), (1024, 32), (256, 5)) for wt in RouterWeight]


LISTS["router_logits"] = router_logits
