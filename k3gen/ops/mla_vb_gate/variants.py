"""The kernels that implement mla_vb_gate, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.mla_vb_gate.spec import MlaVbGateSpec

VARIANTS = VariantTable("mla_vb_gate", (
    Variant("fma", lowering="nvrtc",
            doc="FP32 FMAs on CUDA cores: 8 tokens' latents in shared memory, W_UV streamed once "
                "(plain loads and FMAs: every target can run it)"),
))
MlaVbGateSpec.variants = VARIANTS
