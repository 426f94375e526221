"""Launch CuTe DSL cubins through cuda.bindings, packing their by-value tensor structs and TMA maps.

A CuTe kernel takes each `cute.Tensor` as a struct `{void *data; dynamic shape entries; dynamic
stride entries}` passed by value. The byte layout of the whole parameter buffer comes from the
build (`CuteArtifact.params_json()`, checked there against the cubin's KPARAM_INFO and the PTX),
so nothing here hard-codes an op.

A kernel that loads by TMA also takes, after the tensors, each TMA atom's CUtensorMap (128 bytes,
by value) and its coordinate tensor (only its dynamic shape entries). CuTe's own host code
encodes those maps inside its launch wrapper, which k3gen does not run; the build records each
atom's geometry (`"tma"` of the parameter: the tensor mode each descriptor dimension walks, box,
element type, swizzle, L2 promotion, OOB fill), and this module encodes the same map with
k3gen.runtime.tma.encode_tma from the tensor's pointer and shape, cached per pointer and shape.

Launch path: the parameter buffer and the `void*` array pointing into it are allocated once per
kernel; a launch validates the tensors on the host (shapes, dtypes, strides, alignment, the TMA
limits: no device access, no sync) before anything is written, encodes the maps (a host call),
writes the fields in place and calls `cuLaunchKernel` (`cuLaunchKernelEx` with a cluster shape)
with `kernelParams` on torch's current stream. The driver copies parameters at launch (and at
capture time inside a CUDA graph), so reusing the buffer is safe and the launch is
graph-capturable. Load the module (`load()`) before capturing.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from dataclasses import dataclass

from k3gen.errors import SpecError
from k3gen.runtime.loader import CudaKernel, _check
from k3gen.runtime.tma import TMA_DTYPES, TMA_INTERLEAVES, TMA_L2_PROMOTIONS, TMA_OOB_FILLS, TMA_SWIZZLES, MapCache

# k3gen element name -> torch dtypes accepted for it (E4M3/E5M2 may be raw uint8 storage).
TORCH_DTYPES = {
    "bf16": ("bfloat16",), "fp16": ("float16",), "fp32": ("float32",),
    "e4m3": ("uint8", "float8_e4m3fn"), "e5m2": ("uint8", "float8_e5m2"),
    "u8": ("uint8",), "i8": ("int8",), "i32": ("int32",), "u32": ("uint32",), "i64": ("int64",),
}
TMA_MAPS = 64      # encoded maps kept per kernel (weights are few; activations rotate through a handful)
_TMA_BYTES = {"u8": 1, "u16": 2, "bf16": 2, "fp16": 2, "u32": 4, "fp32": 4}
_FMT = {("ptr", 8): "<Q", ("shape", 4): "<i", ("shape", 8): "<q", ("stride", 4): "<i", ("stride", 8): "<q"}


@dataclass(frozen=True)
class _Field:
    param: int        # index of the tensor argument
    offset: int
    fmt: str
    kind: str
    mode: int | None
    limit: int        # values must lie in [-limit, limit)


@dataclass(frozen=True)
class _Map:
    """One CUtensorMap parameter: descriptor dimension i walks mode `modes[i]` of tensor `param`."""
    param: int
    offset: int
    modes: tuple[int, ...]
    box: tuple[int, ...]
    opts: tuple        # encode_tma's keyword options, as sorted (name, value) pairs


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
        kparams = sorted(abi["params"], key=lambda p: p["ordinal"])
        # The tensors a launch takes; TMA parameters (maps, coordinate tensors) are made from them.
        self.params = [p for p in kparams if "tma" not in p]
        self.names = [p["tensor"] for p in self.params]
        self._allowed = [tuple(TORCH_DTYPES[p["dtype"]]) for p in self.params]
        index = {n: i for i, n in enumerate(self.names)}
        self._fields: list[_Field] = []
        self._tma: list[_Map] = []
        for p in kparams:
            i = index.get(p["tensor"])
            if i is None:
                raise SpecError("params.tensor", p["tensor"], self.names, "a TMA parameter of no tensor")
            role = p.get("tma", {}).get("role")
            if role == "desc":
                self._tma.append(self._map(i, p))
                continue
            for f in p["fields"]:
                fmt = _FMT.get((f["kind"], f["size"]))
                if fmt is None or (role == "coord" and f["kind"] != "shape"):
                    raise SpecError(f"{p['tensor']}.{f['kind']}", f["size"], "4 or 8 bytes",
                                    "coordinate tensors carry shape entries only" if role else "")
                self._fields.append(_Field(i, f["offset"], fmt, f["kind"], f["mode"],
                                           2 ** (8 * f["size"] - 1)))
        self._maps = MapCache(TMA_MAPS)
        self._kernel = CudaKernel(cubin, self.entry)
        # Zero-filled, so struct padding is deterministic; each kernelParams slot points at its
        # parameter's offset within the one buffer (TMA parameters included).
        self._buf = ctypes.create_string_buffer(max(int(abi["param_bytes"]), 1))
        base = ctypes.addressof(self._buf)
        self._argv = (ctypes.c_void_p * len(kparams))(*[base + p["offset"] for p in kparams])
        self._argv_addr = ctypes.addressof(self._argv)
        self._lock = threading.Lock()

    def _map(self, i: int, p: dict) -> _Map:
        """A map parameter's geometry, checked against the driver's limits once, at load."""
        t, name = p["tma"], p["tensor"]
        f = p["fields"]
        if [x["kind"] for x in f] != ["tma"] or p["size"] != 128 or p["offset"] % 64:
            raise SpecError(f"{name}.tma", (p["offset"], p["size"]), "a 128-byte, 64-aligned CUtensorMap")
        modes, box = tuple(t["modes"]), tuple(t["box"])
        rank = len(self.params[i]["shape"])
        if sorted(modes) != list(range(rank)) or len(box) != rank or self.params[i]["stride"][modes[0]] != 1:
            raise SpecError(f"{name}.tma.modes", modes, f"a permutation of the {rank} modes, the first contiguous")
        dtype, swizzle = t["dtype"], t["swizzle"]
        nbytes = _TMA_BYTES.get(dtype)
        if dtype not in TMA_DTYPES or nbytes != self.params[i]["elem_bytes"]:
            raise SpecError(f"{name}.tma.dtype", dtype, sorted(TMA_DTYPES), "the tensor's element size")
        if swizzle not in TMA_SWIZZLES or (swizzle and box[0] * nbytes > swizzle):
            raise SpecError(f"{name}.tma.swizzle", swizzle, sorted(TMA_SWIZZLES), "inner box bytes <= swizzle span")
        es = tuple(t.get("elem_strides") or (1,) * rank)
        if any(not 1 <= b <= 256 for b in box) or box[0] * nbytes % 16 or len(es) != rank \
                or any(not 1 <= e <= 8 for e in es):
            raise SpecError(f"{name}.tma.box", box, "1..256 per dimension, inner box a multiple of 16 bytes")
        opts = {"dtype": dtype, "swizzle": swizzle, "l2_promotion": t["l2_promotion"], "elem_strides": es,
                "interleave": t["interleave"], "oob": t["oob"]}
        for key, allowed in (("l2_promotion", TMA_L2_PROMOTIONS), ("interleave", TMA_INTERLEAVES),
                             ("oob", TMA_OOB_FILLS)):
            if opts[key] not in allowed:
                raise SpecError(f"{name}.tma.{key}", opts[key], sorted(allowed))
        return _Map(i, p["offset"], modes, box, tuple(sorted(opts.items())))

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
    def check(self, tensors, *, device: bool = True) -> dict[str, int]:
        """Validate tensors against the ABI; return the values of the dynamic dims (e.g. M).
        `device=False` skips only the CUDA-device test (host-side tests with CPU tensors)."""
        import torch
        if len(tensors) != len(self.params):
            raise SpecError("tensors", len(tensors), [len(self.params)], f"arguments {self.names}")
        dims: dict[str, int] = {}
        dev = None
        for p, allowed, t in zip(self.params, self._allowed, tensors):
            name = p["tensor"]
            if not isinstance(t, torch.Tensor) or (device and t.device.type != "cuda"):
                raise SpecError(name, type(t).__name__ if not isinstance(t, torch.Tensor) else str(t.device),
                                "a CUDA torch.Tensor")
            if dev is None:
                dev = t.device
            elif t.device != dev:
                raise SpecError(name, str(t.device), [str(dev)], "all tensors on one device")
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
        for m in self._tma:
            # An empty tensor (M == 0) launches nothing (launch returns before packing), so its map
            # is never encoded: only non-empty ones must fit the driver's limits.
            if tensors[m.param].numel():
                self._geometry(m, tensors[m.param])
        return dims

    def _geometry(self, m: _Map, t) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(dims, byte strides of dims 1..) of map `m` over tensor `t`, within the driver's limits.
        Strides are the kernel's static ones where it has them (a size-1 mode's torch stride is
        arbitrary); dims are the tensor's (the coordinate tensor carries the same dynamic ones)."""
        p = self.params[m.param]
        name, nbytes = p["tensor"], p["elem_bytes"]
        dims = tuple(int(t.shape[mode]) for mode in m.modes)
        strides = tuple((t.stride(mode) if isinstance(p["stride"][mode], str) else p["stride"][mode]) * nbytes
                        for mode in m.modes[1:])
        if t.data_ptr() % 16:
            raise SpecError(f"{name}.data_ptr", hex(t.data_ptr()), "multiples of 16", "TMA global address")
        if any(not 1 <= d <= 2 ** 32 for d in dims):
            raise SpecError(f"{name}.shape", tuple(t.shape), "1..2^32 per mode", "TMA global dimensions")
        if any(s % 16 or not 0 < s < 2 ** 40 for s in strides):
            raise SpecError(f"{name}.stride", tuple(t.stride()), "byte strides in (0, 2^40), multiples of 16",
                            "TMA global strides")
        return dims, strides

    def _values(self, tensors) -> list[tuple[str, int, object]]:
        """Every (format, offset, value) a launch writes, computed (maps encoded) before any write."""
        out = []
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
            out.append((f.fmt, f.offset, v))
        for m in self._tma:
            t = tensors[m.param]
            dims, strides = self._geometry(m, t)
            raw = self._maps.get(t, dims, strides, m.box, **dict(m.opts))
            if len(raw) != 128:
                raise SpecError(f"{self.names[m.param]}.tma", len(raw), [128], "CUtensorMap bytes")
            out.append(("128s", m.offset, raw))
        return out

    def pack(self, tensors) -> None:
        for fmt, offset, v in self._values(tensors):
            struct.pack_into(fmt, self._buf, offset, v)

    def packed(self) -> bytes:
        """The parameter buffer as last packed (for tests and debugging)."""
        return self._buf.raw[:int(self.abi["param_bytes"])]

    # -- launch (graph-safe) --------------------------------------------------------------------
    def launch(self, grid: tuple[int, int, int], *tensors, cluster: tuple[int, int, int] | None = None,
               stream: int | None = None, check: bool = True) -> None:
        """Launch on `stream` (default: torch's current stream of the tensors' device), as thread-block
        clusters of shape `cluster` when given (cuLaunchKernelEx)."""
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
            if cluster is not None:
                self._kernel.launch_ex(grid, self.block, cluster, self._argv_addr, None, dev, stream,
                                       self.dynamic_smem)
                return
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
