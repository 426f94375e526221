"""Host-side TMA tensor maps (CUtensorMap), encoded with cuTensorMapEncodeTiled: a pure host call that
touches no device state, so a launch may encode its maps inside a CUDA-graph capture; the 128 bytes are
copied into the kernel's parameters like any pointer argument."""
from __future__ import annotations

import collections
import ctypes
import threading

from k3gen.runtime.loader import _check


def encode_tma(ptr: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...]) -> bytes:
    """128-byte CUtensorMap of a row-major uint8 array of len(dims) dimensions (dims innermost
    first; `strides`: the byte strides of dims 1.., one fewer), 128B swizzle, zero fill out of
    bounds, 256-byte L2 promotion."""
    from cuda.bindings import driver as d
    u64, u32 = d.cuuint64_t, d.cuuint32_t
    tmap = _check(d.cuTensorMapEncodeTiled(
        d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, len(dims), ptr, [u64(v) for v in dims],
        [u64(v) for v in strides], [u32(v) for v in box], [u32(1)] * len(dims),
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return ctypes.string_at(int(tmap.getPtr()), 128)


class MapCache:
    """Encoded maps of one launcher, least recently used dropped past `size`; thread-safe. Keyed by the
    tensor's pointer and device and the map's geometry, so a captured graph and later eager calls on
    the same tensor reuse one encoding."""

    def __init__(self, size: int):
        self.size = size
        self._maps: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, t, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...]) -> bytes:
        key = (t.data_ptr(), t.device.index, dims, strides, box)
        with self._lock:
            raw = self._maps.get(key)
            if raw is not None:
                self._maps.move_to_end(key)
                return raw
        raw = encode_tma(t.data_ptr(), dims, strides, box)
        with self._lock:
            self._maps[key] = raw
            while len(self._maps) > self.size:
                self._maps.popitem(last=False)
        return raw
