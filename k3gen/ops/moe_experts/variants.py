"""The kernels that implement moe_experts, in the order `auto` tries them.

"mma_swapab" (SM90, NVRTC; include/k3gen/moe/experts.cuh): warp-level mma.sync m16n8k16 BF16 with
the weight rows on M (16 per warp: 8 gate + 8 up rows for gate_up, so one lane holds a column's
gate and up and applies the activation in registers) and the few tokens of an expert on N (8 per
MMA, n_tiles per item). The E2M1 codes are decoded in registers by two byte-permute lookups per
four nibbles (prmt) into exact BF16, times the group scale (an exact BF16 product: e2m1 * 2^n, or
e2m1 * e4m3 which has at most 5 significant bits). Each lane owns 32 consecutive K values of its two
rows per 128-column chunk (one 16-byte load per row; the activation operand uses the same K
permutation), so every weight byte is read once with 16-byte loads and a warp holds up to 8
chunks of both rows in flight before its first MMA. K is split over up to 8 warps of a CTA and
summed in warp order in shared memory, so T = 1 (16 experts) still puts thousands of warps on the
132 SMs.

Why not wgmma (a deviation from the issue's "into wgmma operands"): at decode an expert sees ~1
token (T k / E slots per expert: 0.02 at T1, 1.1 at T64 at K3 TP8), so the op moves weight bytes
and does ~1 useful MMA column in 8; wgmma would need the decoded operand in shared memory (a
register-sourced A must be the M side, 64 rows per warpgroup, 128 rows per CTA and a 64-deep K
tile per instruction), adding a shared-memory round trip per decoded byte and coarser tiles that
underfill the GPU at T = 1, for tensor throughput these shapes cannot use. mma.sync consumes
the decoded registers directly.

Deviation (intermediate): the SiTU output h is BF16 for both activation formats. An FP8
per-token-128 intermediate needs the amax of 128 columns, which span 8 CTAs of the gate_up grid;
h is T k I BF16 values (12 KB at T1), so quantizing it would cost a pass and save nothing.
"""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.moe_experts.spec import MoeExpertsSpec

VARIANTS = VariantTable("moe_experts", (
    Variant("mma_swapab", lowering="nvrtc",
            doc="mma.sync BF16 with weight rows on M and tokens on N, E2M1 decoded in registers "
                "(prmt lookups), K split over the CTA's warps; down to FP32 partials; ordered combine",
            checks=((lambda s: s.target.sm >= 90, "needs bf16x2 multiplies and griddepcontrol (sm_90)"),
                    (lambda s: not s.target.fp4_cvt,
                     "targets with hardware FP4 (fp4_cvt) get the tcgen05 block-scaled kernel, "
                     "which is not built yet (issue 21)"))),
))
MoeExpertsSpec.variants = VARIANTS
