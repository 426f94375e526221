"""The kernels that implement fp8_block_gemm, in the order `auto` tries them: the target's MMA unit
decides (tcgen05 on the SM100 family, wgmma on sm_90a); `spec.mma` names the one chosen.
"tcgen05_tma" comes first for sm_103a / sm_107a; sm_100a (a frozen target) keeps the cp.async
"tcgen05" kernel."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec

VARIANTS = VariantTable("fp8_block_gemm", (
    Variant("tcgen05_tma", lowering="cute",
            doc="CuTe DSL tcgen05 GEMM, operands by TMA, the wgmma kernel's cluster split-K",
            checks=((lambda s: s.target.mma == "tcgen05",
                     "needs the tcgen05 MMA unit with tensor memory (the SM100 family)"),
                    (lambda s: s.target.tma, "needs TMA tensor-map loads"),
                    (lambda s: s.target.sm >= 103, "sm_100a keeps its frozen cp.async kernel"))),
    Variant("tcgen05", lowering="cute", doc="CuTe DSL tcgen05 GEMM with block scales in tensor memory",
            checks=((lambda s: s.target.mma == "tcgen05",
                     "needs the tcgen05 MMA unit with tensor memory (the SM100 family)"),)),
    Variant("wgmma", lowering="nvrtc", doc="TMA + wgmma swap-AB, block scales staged by a producer warp",
            checks=((lambda s: s.target.mma == "wgmma", "needs warpgroup MMA (wgmma, sm_90a)"),
                    (lambda s: s.target.tma, "needs TMA tensor-map loads"))),
))
Fp8BlockGemmSpec.variants = VARIANTS
