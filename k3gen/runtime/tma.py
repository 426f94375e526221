"""Host-side TMA tensor maps (CUtensorMap), encoded with cuTensorMapEncodeTiled: a pure host call that
touches no device state, so a launch may encode its maps inside a CUDA-graph capture; the 128 bytes are
copied into the kernel's parameters like any pointer argument."""
from __future__ import annotations

import ctypes

from .loader import _check


def encode_tma_2d(ptr: int, dims: tuple[int, int], strides: tuple[int], box: tuple[int, int]) -> bytes:
    """128-byte CUtensorMap of a row-major uint8 matrix (dims innermost first), 128B swizzle, zero
    fill out of bounds, 256-byte L2 promotion."""
    from cuda.bindings import driver as d
    u64, u32 = d.cuuint64_t, d.cuuint32_t
    tmap = _check(d.cuTensorMapEncodeTiled(
        d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, ptr, [u64(v) for v in dims],
        [u64(v) for v in strides], [u32(v) for v in box], [u32(1), u32(1)],
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return ctypes.string_at(int(tmap.getPtr()), 128)
