"""The kernels that implement fp8_block_gemm, in the order `auto` tries them: the target's MMA unit
decides (tcgen05 on the SM100 family, wgmma on sm_90a); `spec.mma` names the one chosen."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec

VARIANTS = VariantTable("fp8_block_gemm", (
    Variant("tcgen05", lowering="cute", doc="CuTe DSL tcgen05 GEMM with block scales in tensor memory",
            checks=((lambda s: s.target.mma == "tcgen05",
                     "needs the tcgen05 MMA unit with tensor memory (the SM100 family)"),)),
    Variant("wgmma", lowering="nvrtc", doc="TMA + wgmma swap-AB, block scales staged by a producer warp",
            checks=((lambda s: s.target.mma == "wgmma", "needs warpgroup MMA (wgmma, sm_90a)"),
                    (lambda s: s.target.tma, "needs TMA tensor-map loads"))),
))
Fp8BlockGemmSpec.variants = VARIANTS
