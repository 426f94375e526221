"""Launch CuTe DSL cubins through cuda.bindings, packing their by-value tensor structs.

A CuTe kernel takes each `cute.Tensor` as a struct `{void *data; dynamic shape entries; dynamic
stride entries}` passed by value. The byte layout of the whole parameter buffer comes from the
build (`CuteArtifact.params_json()`, checked there against the cubin's KPARAM_INFO and the PTX),
so nothing here hard-codes an op.

Launch path: the parameter buffer and the `void*` array pointing into it are allocated once per
kernel; a launch validates the tensors on the host (shapes, dtypes, strides, alignment: no device
access, no sync), writes the fields in place and calls `cuLaunchKernel` with `kernelParams` on
torch's current stream. The driver copies parameters at launch (and at capture time inside a CUDA
graph), so reusing the buffer is safe and the launch is graph-capturable. Load the module
(`load()`) before capturing.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from dataclasses import dataclass

from k3gen.errors import SpecError
from k3gen.runtime.loader import CudaKernel, _check

# k3gen element name -> torch dtypes accepted for it (E4M3/E5M2 may be raw uint8 storage).
TORCH_DTYPES = {
    "bf16": ("bfloat16",), "fp16": ("float16",), "fp32": ("float32",),
    "e4m3": ("uint8", "float8_e4m3fn"), "e5m2": ("uint8", "float8_e5m2"),
    "u8": ("uint8",), "i8": ("int8",), "i32": ("int32",), "u32": ("uint32",), "i64": ("int64",),
}
_FMT = {("ptr", 8): "<Q", ("shape", 4): "<i", ("shape", 8): "<q", ("stride", 4): "<i", ("stride", 8): "<q"}


@dataclass(frozen=True)
class _Field:
    param: int        # index of the tensor argument
    offset: int
    fmt: str
    kind: str
    mode: int | None
    limit: int        # values must lie in [-limit, limit)


class CuteKernel:
    """A loaded CuTe DSL kernel plus its parameter packer. Not shared across threads unlocked:
    packing and launching happen under one lock, so concurrent launches stay correct."""

    def __init__(self, cubin: bytes, abi: dict):
        if abi.get("abi") != "cute-struct-v1":
            raise SpecError("abi", abi.get("abi"), ["cute-struct-v1"], "unknown CuTe launch ABI")
        self.abi = abi
        self.entry: str = abi["entry"]
        self.block = tuple(abi["block"])
        self.dynamic_smem = int(abi.get("dynamic_smem", 0))
        self.params = sorted(abi["params"], key=lambda p: p["ordinal"])
        self.names = [p["tensor"] for p in self.params]
        self._allowed = [tuple(TORCH_DTYPES[p["dtype"]]) for p in self.params]
        self._fields: list[_Field] = []
        for i, p in enumerate(self.params):
            for f in p["fields"]:
                fmt = _FMT.get((f["kind"], f["size"]))
                if fmt is None:
                    raise SpecError(f"{p['tensor']}.{f['kind']}", f["size"], "4 or 8 bytes")
                self._fields.append(_Field(i, f["offset"], fmt, f["kind"], f["mode"],
                                           2 ** (8 * f["size"] - 1)))
        self._kernel = CudaKernel(cubin, self.entry)
        # Zero-filled, so struct padding is deterministic; each kernelParams slot points at its
        # parameter's offset within the one buffer.
        self._buf = ctypes.create_string_buffer(max(int(abi["param_bytes"]), 1))
        base = ctypes.addressof(self._buf)
        self._argv = (ctypes.c_void_p * len(self.params))(*[base + p["offset"] for p in self.params])
        self._argv_addr = ctypes.addressof(self._argv)
        self._lock = threading.Lock()

    # -- setup (not graph-safe: loads a module) -----------------------------------------------
    def load(self, device: int | None = None) -> "CuteKernel":
        import torch
        f = self._kernel.function(torch.cuda.current_device() if device is None else device)
        if self.dynamic_smem > 48 * 1024:  # above the default opt-in limit
            from cuda.bindings import driver
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver.cuFuncSetAttribute(f, attr, self.dynamic_smem), "cuFuncSetAttribute")
        return self

    # -- host-side checks -----------------------------------------------------------------------
    def check(self, tensors) -> dict[str, int]:
        """Validate tensors against the ABI; return the values of the dynamic dims (e.g. M)."""
        import torch
        if len(tensors) != len(self.params):
            raise SpecError("tensors", len(tensors), [len(self.params)], f"arguments {self.names}")
        dims: dict[str, int] = {}
        device = None
        for p, allowed, t in zip(self.params, self._allowed, tensors):
            name = p["tensor"]
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
                raise SpecError(name, type(t).__name__, "a CUDA torch.Tensor")
            if device is None:
                device = t.device
            elif t.device != device:
                raise SpecError(name, str(t.device), [str(device)], "all tensors on one device")
            if str(t.dtype).removeprefix("torch.") not in allowed:
                raise SpecError(f"{name}.dtype", str(t.dtype), allowed)
            if t.dim() != len(p["shape"]):
                raise SpecError(f"{name}.shape", tuple(t.shape), p["shape"], "rank")
            for mode, (want, got) in enumerate(zip(p["shape"], t.shape)):
                if isinstance(want, str):
                    if dims.setdefault(want, got) != got:
                        raise SpecError(f"{name}.shape[{mode}]", got, [dims[want]], f"dim {want}")
                elif want != got:
                    raise SpecError(f"{name}.shape", tuple(t.shape), p["shape"])
            for mode, (want, got) in enumerate(zip(p["stride"], t.stride())):
                # A static stride is baked into the kernel; it only matters where the mode has
                # more than one index.
                if not isinstance(want, str) and want != got and t.shape[mode] > 1:
                    raise SpecError(f"{name}.stride", tuple(t.stride()), p["stride"])
            if t.data_ptr() % p["align"]:
                raise SpecError(f"{name}.data_ptr", hex(t.data_ptr()), f"multiples of {p['align']}",
                                "the kernel assumes this alignment")
        return dims

    def pack(self, tensors) -> None:
        buf = self._buf
        for f in self._fields:
            t = tensors[f.param]
            if f.kind == "ptr":
                v = t.data_ptr()
            elif f.kind == "shape":
                v = t.shape[f.mode]
            else:
                v = t.stride(f.mode)
            if f.kind != "ptr" and not -f.limit <= v < f.limit:
                raise SpecError(f"{self.names[f.param]}.{f.kind}[{f.mode}]", v,
                                f"a value in [{-f.limit}, {f.limit})")
            struct.pack_into(f.fmt, buf, f.offset, v)

    def packed(self) -> bytes:
        """The parameter buffer as last packed (for tests and debugging)."""
        return self._buf.raw[:int(self.abi["param_bytes"])]

    # -- launch (graph-safe) --------------------------------------------------------------------
    def launch(self, grid: tuple[int, int, int], *tensors, stream: int | None = None,
               check: bool = True) -> None:
        """Launch on `stream` (default: torch's current stream of the tensors' device)."""
        import torch
        if check:
            self.check(tensors)
        if min(grid) <= 0:
            return  # an empty problem (e.g. M == 0): nothing to launch, and a 0-sized grid is an error
        from cuda.bindings import driver
        dev = tensors[0].device.index
        if dev is None:
            dev = torch.cuda.current_device()
        f = self._kernel.function(dev)
        if stream is None:
            stream = torch.cuda.current_stream(dev).cuda_stream
        with self._lock:
            self.pack(tensors)
            res = driver.cuLaunchKernel(f, *grid, *self.block, self.dynamic_smem, stream,
                                        self._argv_addr, 0)
        _check(res, f"cuLaunchKernel({self.entry})")

    def __repr__(self) -> str:
        return f"CuteKernel({self.entry}, params={self.names}, block={self.block})"


def load_cute_kernel(cubin: bytes, meta: dict) -> CuteKernel:
    """From build metadata (a cache entry or a `k3gen build --out` bundle), whose `params` is
    `CuteArtifact.params_json()`."""
    abi = meta.get("params")
    if not isinstance(abi, dict):
        raise SpecError("meta.params", type(abi).__name__, "the CuTe launch ABI (CuteArtifact.params_json())",
                        f"build metadata of {meta.get('spec', 'a CuTe kernel')}")
    return CuteKernel(cubin, abi)
