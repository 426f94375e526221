"""Load cubins with cuda.bindings and launch on torch's current stream.

Launches allocate nothing, compile nothing and never synchronize, so they can be captured in
CUDA graphs. Modules are loaded into the device's primary context, the one torch uses.
"""
from __future__ import annotations

import ctypes
import threading

from k3gen.errors import DeviceError

_lock = threading.Lock()
_ctx_ready: set[int] = set()


def _check(res, what: str):
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        from cuda.bindings import driver
        _, name = driver.cuGetErrorName(err)
        raise DeviceError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


def ensure_context(device: int) -> None:
    """Make torch's primary context of `device` current on this thread."""
    import torch
    from cuda.bindings import driver
    torch.cuda.init()
    with _lock:
        if device not in _ctx_ready:
            _check(driver.cuInit(0), "cuInit")
            _ctx_ready.add(device)
    dev = _check(driver.cuDeviceGet(device), "cuDeviceGet")
    ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def _params(args, types):
    """cuda.bindings kernelParams: (values, ctypes types), or with types None the address of a
    prepared void* array (for by-value structs such as TMA tensor maps; see ArgPack)."""
    return args if types is None else (args, types)


class ArgPack:
    """Kernel arguments packed by hand: `add` keeps each value's bytes alive in a ctypes buffer and
    `address` is the void** array cuLaunchKernel takes. The driver copies the values at launch (and
    at graph capture), so a pack may be dropped right after the launch call returns."""

    def __init__(self):
        self._vals: list = []

    def add(self, value) -> "ArgPack":
        if isinstance(value, (bytes, bytearray)):
            buf = ctypes.create_string_buffer(bytes(value), len(value))
        else:
            buf = value   # a ctypes scalar, e.g. PTR(x) or I32(x)
        self._vals.append(buf)
        return self

    def address(self) -> int:
        self._argv = (ctypes.c_void_p * len(self._vals))(*[ctypes.addressof(v) for v in self._vals])
        return ctypes.addressof(self._argv)


class CudaKernel:
    """One kernel function of a loaded cubin, per device."""

    def __init__(self, cubin: bytes, entry: str):
        self.cubin, self.entry = cubin, entry
        self._funcs: dict[int, object] = {}
        self._modules: dict[int, object] = {}

    def function(self, device: int):
        f = self._funcs.get(device)
        if f is None:
            from cuda.bindings import driver
            ensure_context(device)
            mod = _check(driver.cuModuleLoadData(self.cubin), f"cuModuleLoadData({self.entry})")
            f = _check(driver.cuModuleGetFunction(mod, self.entry.encode()), f"cuModuleGetFunction({self.entry})")
            self._modules[device], self._funcs[device] = mod, f
        return f

    def sibling(self, entry: str) -> "CudaKernel":
        """Another kernel function of the same cubin (loaded once per device on its own)."""
        return CudaKernel(self.cubin, entry)

    def read_i32(self, name: str, device: int) -> int:
        """Value of an `extern "C" __constant__ int` of the module, e.g. a size the kernel defines."""
        from cuda.bindings import driver
        self.function(device)
        dptr, size = _check(driver.cuModuleGetGlobal(self._modules[device], name.encode()), f"cuModuleGetGlobal({name})")
        if size != 4:
            raise RuntimeError(f"{name}: {size} bytes, expected an int")
        buf = (ctypes.c_int * 1)()
        _check(driver.cuMemcpyDtoH(ctypes.addressof(buf), dptr, 4), f"read {name}")
        return int(buf[0])

    def set_max_dynamic_smem(self, nbytes: int, device: int) -> None:
        from cuda.bindings import driver
        _check(driver.cuFuncSetAttribute(
            self.function(device), driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            nbytes), "cuFuncSetAttribute(max dynamic smem)")

    def prefer_max_smem(self, device: int) -> None:
        """Largest shared-memory carve-out: two CTAs of ~110 KB per SM need all 228 KB of it."""
        from cuda.bindings import driver
        _check(driver.cuFuncSetAttribute(
            self.function(device), driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            100), "cuFuncSetAttribute(carveout)")

    def num_regs(self, device: int = 0) -> int:
        from cuda.bindings import driver
        return _check(driver.cuFuncGetAttribute(
            driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, self.function(device)), "cuFuncGetAttribute")

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple, types: tuple,
               device: int, stream: int, smem: int = 0) -> None:
        from cuda.bindings import driver
        f = self.function(device)
        _check(driver.cuLaunchKernel(f, *grid, *block, smem, stream, _params(args, types), 0), f"launch {self.entry}")

    def launch_ex(self, grid: tuple[int, int, int], block: tuple[int, int, int],
                  cluster: tuple[int, int, int] | None, args: tuple, types: tuple, device: int, stream: int,
                  smem: int = 0, pdl: bool = False) -> None:
        """Launch through cuLaunchKernelEx (graph-capturable) with an optional thread-block cluster
        shape and, with `pdl`, programmatic dependent launch: the kernel may start while the
        previous kernel on the stream finishes, and must `griddepcontrol.wait` before reading
        anything that kernel writes."""
        from cuda.bindings import driver
        f = self.function(device)
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = smem
        cfg.hStream = stream
        attrs = []
        if cluster is not None:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
            attrs.append(attr)
        if pdl:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        _check(driver.cuLaunchKernelEx(cfg, f, _params(args, types), 0), f"launch {self.entry}")


PTR = ctypes.c_void_p
I32 = ctypes.c_int
F32 = ctypes.c_float


def ptr(t) -> int:
    """Device pointer of a tensor, or 0 for None."""
    return 0 if t is None else t.data_ptr()
