"""Host-side TMA tensor maps (CUtensorMap), encoded with cuTensorMapEncodeTiled: a pure host call that
touches no device state, so a launch may encode its maps inside a CUDA-graph capture; the 128 bytes are
copied into the kernel's parameters like any pointer argument."""
from __future__ import annotations

import collections
import ctypes
import threading

from k3gen.runtime.loader import _check


# Options by name -> the driver's enum member names (cuTensorMapEncodeTiled arguments).
TMA_DTYPES = {"u8": "UINT8", "u16": "UINT16", "u32": "UINT32", "bf16": "BFLOAT16", "fp16": "FLOAT16",
              "fp32": "FLOAT32"}
TMA_SWIZZLES = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}
TMA_L2_PROMOTIONS = {0: "NONE", 64: "L2_64B", 128: "L2_128B", 256: "L2_256B"}
TMA_INTERLEAVES = {"none": "NONE", "16b": "16B", "32b": "32B"}
TMA_OOB_FILLS = {"zero": "NONE", "nan": "NAN_REQUEST_ZERO_FMA"}


def encode_tma(ptr: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...], *,
               dtype: str = "u8", swizzle: int = 128, l2_promotion: int = 256,
               elem_strides: tuple[int, ...] | None = None, interleave: str = "none",
               oob: str = "zero") -> bytes:
    """128-byte CUtensorMap of a row-major array of len(dims) dimensions (dims innermost first;
    `strides`: the byte strides of dims 1.., one fewer). Defaults (the mla_decode / mla_prefill /
    wgmma GEMM maps): uint8 elements, 128B swizzle, 256-byte L2 promotion, element strides 1, no
    interleave, zero fill out of bounds (the driver's OOB_FILL_NONE); a CuTe kernel's maps pass
    what its atoms were built with (runtime.cute_launch)."""
    from cuda.bindings import driver as d
    u64, u32 = d.cuuint64_t, d.cuuint32_t
    es = [1] * len(dims) if elem_strides is None else list(elem_strides)
    tmap = _check(d.cuTensorMapEncodeTiled(
        getattr(d.CUtensorMapDataType, "CU_TENSOR_MAP_DATA_TYPE_" + TMA_DTYPES[dtype]), len(dims), ptr,
        [u64(v) for v in dims], [u64(v) for v in strides], [u32(v) for v in box], [u32(v) for v in es],
        getattr(d.CUtensorMapInterleave, "CU_TENSOR_MAP_INTERLEAVE_" + TMA_INTERLEAVES[interleave]),
        getattr(d.CUtensorMapSwizzle, "CU_TENSOR_MAP_SWIZZLE_" + TMA_SWIZZLES[swizzle]),
        getattr(d.CUtensorMapL2promotion, "CU_TENSOR_MAP_L2_PROMOTION_" + TMA_L2_PROMOTIONS[l2_promotion]),
        getattr(d.CUtensorMapFloatOOBfill, "CU_TENSOR_MAP_FLOAT_OOB_FILL_" + TMA_OOB_FILLS[oob])),
        "cuTensorMapEncodeTiled")
    return ctypes.string_at(int(tmap.getPtr()), 128)


class MapCache:
    """Encoded maps of one launcher, least recently used dropped past `size`; thread-safe. Keyed by the
    tensor's pointer and device and the map's geometry, so a captured graph and later eager calls on
    the same tensor reuse one encoding."""

    def __init__(self, size: int):
        self.size = size
        self._maps: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, t, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...], **opts) -> bytes:
        """`opts`: encode_tma's keyword options (dtype, swizzle, ...), part of the key."""
        key = (t.data_ptr(), t.device.index, dims, strides, box, tuple(sorted(opts.items())))
        with self._lock:
            raw = self._maps.get(key)
            if raw is not None:
                self._maps.move_to_end(key)
                return raw
        raw = encode_tma(t.data_ptr(), dims, strides, box, **opts)
        with self._lock:
            self._maps[key] = raw
            while len(self._maps) > self.size:
                self._maps.popitem(last=False)
        return raw
