"""Constants and the DSMEM load helper of cute_kernel.py (a separate module for the size limit; the
build hashes it with cute_kernel.py: k3gen.pipeline.cute.cute_source)."""
from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

SF_VEC = 32                 # K elements per UE8M0 scale of the block-scaled MMA
LOAD_WARPS = (0, 1, 2, 3)
EPI_WARPS = (4, 5, 6, 7)
MMA_WARP = 8
THREADS = 32 * (len(LOAD_WARPS) + len(EPI_WARPS) + 1)
TMEM_COLS = 256
EPI_COLS = 32               # accumulator columns per tcgen05.ld (32 lanes x 32 bits x 32)
ROW_CHUNKS = 8              # 16-byte chunks per 128-byte K row
E8M0_ONE = 127
# TMEM columns reserved for each SF tile: one tcgen05.cp.32x128b.warpx4 fills 4 columns
# (128 bits per lane) per 128-column K block, on either MMA K (32 on sm_103a, 64 on sm_107a).
SF_TMEM_COLS = 16


@dsl_user_op
def _ld_peer_f32(addr, rank, *, loc=None, ip=None):
    """The FP32 at shared address `addr` of cluster CTA `rank` (the DSL's DSMEM pointers have no
    plain load)."""
    v = llvm.inline_asm(
        Float32.mlir_type,
        [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 a;\n\tmapa.shared::cluster.u32 a, $1, $2;\n\t"
        "ld.shared::cluster.f32 $0, [a];\n\t}",
        "=f,r,r", has_side_effects=True, loc=loc, ip=ip)
    return Float32(v)
