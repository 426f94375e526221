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


# -- the TMA maps' geometry, read from CuTe's own atoms ------------------------------------------
# What CuTe's host code puts in a descriptor that its atom type does not spell out: CuTe C++'s
# make_tma_copy_desc choices (no interleave, L2 promotion 128 B, OOB fill NONE = zeros, element
# strides 1), which CuTe DSL's inline encoding keeps (tests/nogpu/ops/test_fp8_block_gemm_tcgen05_tma.py
# decodes the words its host code stores).
TMA_FIXED = {"interleave": "none", "l2_promotion": 128, "oob": "zero"}
_TMA_FORMATS = {"U8": ("u8", 1)}


def tma_geometry(tensor: str, atom_type: str, smem_layout: str) -> dict:
    """A kernel parameter's TMA map as k3gen.runtime.cute_launch encodes it, from the atom CuTe
    built (`!cute_nvgpu.atom.non_exec_tiled_tma_load<..., tma_gbasis = <"(b0,b1):(1@m0,1@m1)">,
    tma_format = U8>`: descriptor dim i has box b_i and walks tensor mode m_i) and the shared
    memory layout it writes (`S<B,4,3> o ...` over bytes: a 2^B x 16-byte swizzle span)."""
    import re
    basis = re.search(r'tma_gbasis = <"\(([\d,]+)\):\(([^)]*)\)">', atom_type)
    fmt = re.search(r"tma_format = (\w+)", atom_type)
    swz = re.match(r"S<(\d+),(\d+),(\d+)> o ", smem_layout)
    if basis is None or fmt is None or fmt.group(1) not in _TMA_FORMATS or swz is None:
        raise ValueError(f"{tensor}: unsupported TMA atom {atom_type!r} / smem layout {smem_layout!r}")
    box = [int(b) for b in basis.group(1).split(",")]
    modes = [int(m) for m in re.findall(r"1@(\d+)", basis.group(2))]
    dtype, nbytes = _TMA_FORMATS[fmt.group(1)]
    b, m = int(swz.group(1)), int(swz.group(2))
    if len(modes) != len(box) or (b and (m != 4 or nbytes != 1)):
        raise ValueError(f"{tensor}: unsupported TMA atom {atom_type!r} / smem layout {smem_layout!r}")
    return {"tensor": tensor, "role": "desc", "modes": modes, "box": box, "dtype": dtype,
            "swizzle": 16 << b if b else 0, "elem_strides": [1] * len(box), **TMA_FIXED,
            "atom": atom_type}
