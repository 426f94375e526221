"""The kernels that implement fp8_block_gemm, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec

VARIANTS = VariantTable("fp8_block_gemm", (
    Variant("tcgen05", lowering="cute", doc="CuTe DSL tcgen05 GEMM with block scales in tensor memory",
            checks=((lambda s: s.target.mma == "tcgen05", "needs tcgen05 (SM100 family)"),)),
    Variant("wgmma", lowering="nvrtc", doc="TMA + wgmma swap-AB, block scales staged by a producer warp",
            checks=((lambda s: s.target.mma == "wgmma", "needs wgmma (sm_90a)"),)),
))
Fp8BlockGemmSpec.variants = VARIANTS
