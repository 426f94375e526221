"""CuTe DSL -> cubin, one subprocess per compile, no GPU and no CUDA driver.

Why a subprocess: CuTe DSL reads its target from `CUTE_DSL_ARCH` once per process (unset, it
silently picks sm_100a, or probes the driver), and keeps process-wide caches. So every compile runs
`python -m k3gen.pipeline.cute worker ...` with `CUTE_DSL_ARCH=<arch>` set before cutlass is
imported, and the parent never imports cutlass (the runtime on the GPU machine has no CuTe DSL).

How the cubin is obtained (CuTe DSL 4.8.1): `cute.compile` runs its whole pipeline, ptxas
included, in process and needs no driver when the arch is given. `CUTE_DSL_KEEP=cubin,ptx` with
`CUTE_DSL_DUMP_DIR=<dir>` writes `<fn>.<arch>.cubin/.ptx` there (the folder must exist: the DSL
does not create it) and turns the JIT caches off; `CUTE_DSL_NO_CACHE` and
`CUTE_DSL_DISABLE_FILE_CACHING` keep the worker from reading or writing the DSL's /tmp cache.
(`cute.compile(..., options="--keep-cubin --dump-dir=D")` dumps too, but leaves the JIT cache on,
and a cache hit writes no files.) The worker hands the files back renamed kernel.cubin/.ptx.

The kernel ABI: CuTe passes each `cute.Tensor` argument *by value* as a struct
`{void *data; dynamic shape entries...; dynamic stride entries...}` in C layout, each entry as
wide as its SymInt (32 or 64 bits; static modes take no space). The worker derives that layout
from the fake tensors the op module compiles with; the parent then checks it against the cubin (EIATTR_KPARAM_INFO offsets/sizes, EIATTR_CBANK_PARAM_SIZE) and
against every `ld.param` of the PTX (each read must hit a described field), and raises
CompileError on any disagreement. `CuteArtifact.params_json()` is what the runtime packs from.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from k3gen.errors import CompileError

PACKAGE_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = PACKAGE_DIR.parent
WORKER_TIMEOUT_S = 600

# Element types as the worker names them (cutlass type -> our name, bytes per element).
DTYPES = {"BFloat16": ("bf16", 2), "Float16": ("fp16", 2), "Float32": ("fp32", 4),
          "Float8E4M3FN": ("e4m3", 1), "Float8E5M2": ("e5m2", 1), "Uint8": ("u8", 1),
          "Int8": ("i8", 1), "Int32": ("i32", 4), "Uint32": ("u32", 4), "Int64": ("i64", 8)}


# -- the artifact --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamField:
    """One scalar inside the kernel's parameter buffer."""
    offset: int            # bytes from the start of the parameter buffer
    size: int              # 4 or 8
    kind: str              # "ptr" | "shape" | "stride"
    tensor: str            # tensor argument it belongs to
    mode: int | None = None    # tensor mode of a shape/stride entry
    symbol: str | None = None  # name of the dynamic dim ("M"), when it has one

    def to_json(self) -> dict:
        return {"offset": self.offset, "size": self.size, "kind": self.kind, "tensor": self.tensor,
                "mode": self.mode, "symbol": self.symbol}


@dataclass(frozen=True)
class KernelParam:
    """One kernel parameter: a CuTe tensor passed by value as a struct."""
    ordinal: int
    offset: int
    size: int
    tensor: str
    dtype: str                      # k3gen element name: bf16, e4m3, fp32, u8, ...
    elem_bytes: int
    align: int                      # base pointer alignment the kernel assumes, bytes
    shape: tuple                    # ints for static modes, symbol names (str) for dynamic ones
    stride: tuple                   # in elements; same convention
    fields: tuple[ParamField, ...]
    # A TMA parameter: {"role": "desc", box, swizzle, ...} is a 128-byte CUtensorMap the launcher
    # encodes for `tensor`; {"role": "coord"} is the TMA coordinate tensor's dynamic shape only.
    tma: dict | None = None

    def to_json(self) -> dict:
        d = {"ordinal": self.ordinal, "offset": self.offset, "size": self.size,
             "tensor": self.tensor, "dtype": self.dtype, "elem_bytes": self.elem_bytes,
             "align": self.align, "shape": list(self.shape), "stride": list(self.stride),
             "fields": [f.to_json() for f in self.fields]}
        if self.tma is not None:
            d["tma"] = dict(self.tma)
        return d



@dataclass(frozen=True)
class CuteArtifact:
    arch: str
    entry: str                       # the kernel's symbol in the cubin
    cubin: bytes = field(repr=False)
    params: tuple[KernelParam, ...]
    param_bytes: int                 # size of the parameter buffer (EIATTR_CBANK_PARAM_SIZE)
    block: tuple[int, int, int]      # required block shape (reqntid)
    dynamic_smem: int                # bytes of dynamic shared memory to launch with
    registers: int
    ptx: str = field(default="", repr=False)
    compile_seconds: float = 0.0
    log: str = field(default="", repr=False)

    def params_json(self) -> dict:
        """The launch ABI: stored as meta["params"] with the cubin (cache entry, `k3gen build --out`
        bundle) and read by k3gen.runtime.cute_launch."""
        return {"abi": "cute-struct-v1", "entry": self.entry, "arch": self.arch,
                "param_bytes": self.param_bytes, "block": list(self.block),
                "dynamic_smem": self.dynamic_smem, "registers": self.registers,
                "params": [p.to_json() for p in self.params]}


# -- what the build pipeline hashes -------------------------------------------------------------
def cute_module_path(op: str) -> Path:
    return PACKAGE_DIR / "ops" / op / "cute_kernel.py"


def cute_source(spec) -> str:
    """The kernel's source as k3gen hashes and dumps it: the CuTe module, headed by the spec."""
    path = cute_module_path(spec.op)
    if not path.exists():
        raise CompileError(f"op {spec.op!r} has lowering 'cute' but no module {path}")
    # Helper modules next to it (cute_*.py) are part of the kernel: hashed with it, so editing one
    # invalidates the cached cubins.
    parts = sorted(p for p in path.parent.glob("cute_*.py") if p != path)
    return (f"# k3gen CuTe DSL kernel {spec.file_stem} for {spec.target.arch}\n"
            f"# spec: {spec.canonical()}\n" + path.read_text()
            + "".join(f"\n# --- {p.name}\n" + p.read_text() for p in parts))


def cute_flags(spec) -> list[str]:
    return [f"CUTE_DSL_ARCH={spec.target.arch}"]


def worker_env(arch: str, dump_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}
    env.update({
        "CUTE_DSL_ARCH": arch,
        "CUTE_DSL_KEEP": "cubin,ptx",
        "CUTE_DSL_DUMP_DIR": str(dump_dir),
        "CUTE_DSL_NO_CACHE": "1",
        "CUTE_DSL_DISABLE_FILE_CACHING": "1",
    })
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _repro(spec, workdir: Path) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in
                   [("CUTE_DSL_ARCH", spec.target.arch), ("CUTE_DSL_KEEP", "cubin,ptx"),
                    ("CUTE_DSL_DUMP_DIR", str(workdir / "dump")), ("CUTE_DSL_NO_CACHE", "1"),
                    ("CUTE_DSL_DISABLE_FILE_CACHING", "1"), ("PYTHONPATH", str(REPO_ROOT))])
    cmd = [sys.executable, "-m", "k3gen.pipeline.cute", "worker", "--target", spec.target.name,
           "--spec", spec.canonical(), "--workdir", str(workdir)]
    return f"mkdir -p {shlex.quote(str(workdir / 'dump'))} && {env} " + " ".join(shlex.quote(c) for c in cmd)


# -- compile -------------------------------------------------------------------------------------
def compile_cute(spec, *, workdir: Path | str | None = None) -> CuteArtifact:
    """Compile a `lowering = "cute"` spec for its target's arch in a fresh subprocess."""
    if getattr(spec, "lowering", None) != "cute":
        raise CompileError(f"{spec.op} is not a CuTe DSL op (lowering={spec.lowering!r})")
    cute_source(spec)  # a missing module is a CompileError before any process starts
    own_tmp = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix=f"k3gen-cute-{spec.op}-")) if own_tmp else Path(workdir)
    try:
        dump = workdir / "dump"
        shutil.rmtree(dump, ignore_errors=True)
        dump.mkdir(parents=True)
        (workdir / "spec.json").write_text(spec.canonical() + "\n")
        repro = _repro(spec, workdir)
        (workdir / "repro.sh").write_text(repro + "\n")
        cmd = [sys.executable, "-m", "k3gen.pipeline.cute", "worker", "--target", spec.target.name,
               "--spec", spec.canonical(), "--workdir", str(workdir)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=worker_env(spec.target.arch, dump), capture_output=True,
                                  text=True, timeout=WORKER_TIMEOUT_S, cwd=str(workdir))
        except subprocess.TimeoutExpired as e:
            raise CompileError(f"CuTe DSL compile of {spec.file_stem} timed out after {WORKER_TIMEOUT_S}s",
                               log=(e.stdout or "") + (e.stderr or ""), options=cute_flags(spec),
                               source_path=str(cute_module_path(spec.op)), repro=repro) from None
        seconds = time.perf_counter() - t0
        log = (proc.stdout + proc.stderr).strip()
        result_path = workdir / "result.json"
        if proc.returncode != 0 or not result_path.exists():
            raise CompileError(f"CuTe DSL compile of {spec.file_stem} for {spec.target.arch} failed "
                               f"(exit {proc.returncode})", log=log, options=cute_flags(spec),
                               source_path=str(cute_module_path(spec.op)), repro=repro)
        result = json.loads(result_path.read_text())
        return _assemble(spec, result, log, seconds, repro)
    finally:
        if own_tmp:
            shutil.rmtree(workdir, ignore_errors=True)


def _assemble(spec, result: dict, log: str, seconds: float, repro: str) -> CuteArtifact:
    def fail(msg: str):
        raise CompileError(f"{spec.file_stem} ({spec.target.arch}): {msg}", log=log,
                           options=cute_flags(spec), source_path=str(cute_module_path(spec.op)),
                           repro=repro)

    cubin_path, ptx_path = Path(result["cubin"]), Path(result["ptx"])
    if not cubin_path.exists():
        fail(f"CuTe DSL reported {cubin_path} but wrote no cubin")
    if not ptx_path.exists():
        fail(f"CuTe DSL reported {ptx_path} but wrote no PTX (needed to check the ABI)")
    cubin, ptx = cubin_path.read_bytes(), ptx_path.read_text()
    if result.get("driver_loaded"):
        fail("the compile worker loaded the CUDA driver; compiles must stay driver-free")
    try:
        elf = parse_cubin(cubin)
    except ValueError as e:
        fail(f"unreadable cubin: {e}")
    if elf.arch != spec.target.arch:
        fail(f"cubin is for {elf.arch}, expected {spec.target.arch}")
    if len(elf.kernels) != 1:
        fail(f"expected one kernel in the cubin, found {sorted(elf.kernels)}")
    entry, info = next(iter(elf.kernels.items()))
    if result["kernels"] and entry not in result["kernels"]:
        fail(f"cubin kernel {entry!r} is not among the DSL's kernels {result['kernels']}")

    params = layout_params(result["tensors"], result.get("tma", ()))
    if len(params) != len(info.kparams):
        fail(f"cubin has {len(info.kparams)} kernel parameters, the tensor arguments make {len(params)}")
    for p in params:
        off, size = info.kparams.get(p.ordinal, (None, None))
        if (off, size) != (p.offset, p.size):
            fail(f"parameter {p.ordinal} ({p.tensor}) is at offset {off} size {size} in the cubin, "
                 f"expected offset {p.offset} size {p.size}")
    param_bytes = info.param_bytes or (params[-1].offset + params[-1].size if params else 0)
    if params and param_bytes < params[-1].offset + params[-1].size:
        fail(f"parameter buffer of {param_bytes} bytes is smaller than the parameters")
    problems = check_ptx_params(ptx, entry, params)
    if problems:
        fail("PTX parameter reads do not match the derived ABI: " + "; ".join(problems))
    if info.reqntid is None:
        fail("kernel has no required block size (reqntid); k3gen launches need a fixed block")
    if info.local_bytes:
        fail(f"kernel uses {info.local_bytes} bytes of local memory per thread (spills)")
    return CuteArtifact(arch=elf.arch, entry=entry, cubin=cubin,
                        params=tuple(params), param_bytes=param_bytes, block=info.reqntid,
                        dynamic_smem=int(result.get("dynamic_smem", 0)), registers=info.registers,
                        ptx=ptx, compile_seconds=seconds, log=log)


TMA_DESC_BYTES, TMA_DESC_ALIGN = 128, 64      # CUtensorMap, passed as a __grid_constant__ param


def layout_params(tensors: list[dict], tma: list[dict] = ()) -> list[KernelParam]:
    """C layout of the by-value tensor structs, one kernel parameter each, in argument order, then
    the TMA parameters (`tma`, in order): a descriptor is one 128-byte, 64-aligned field; a
    coordinate tensor carries only its dynamic shape entries (its "strides" are TMA bases)."""
    params = _layout_tensors(tensors)
    offset = params[-1].offset + params[-1].size if params else 0
    by_name = {p.tensor: p for p in params}
    for t in tma:
        src = by_name[t["tensor"]]
        if t["role"] == "desc":
            offset = -(-offset // TMA_DESC_ALIGN) * TMA_DESC_ALIGN
            fields = (ParamField(offset, TMA_DESC_BYTES, "tma", t["tensor"]),)
            size = TMA_DESC_BYTES
        else:
            items = [(s["width"] // 8, s["mode"], s.get("symbol")) for s in t["dyn_shape"]]
            if not items:
                continue                           # a static coordinate tensor is no parameter
            align = max(w for w, _, _ in items)
            offset = -(-offset // align) * align
            fields, pos = [], 0
            for w, mode, symbol in items:
                pos = -(-pos // w) * w
                fields.append(ParamField(offset + pos, w, "shape", t["tensor"], mode, symbol))
                pos += w
            fields, size = tuple(fields), -(-pos // align) * align
        params.append(KernelParam(len(params), offset, size, src.tensor, src.dtype, src.elem_bytes,
                                  src.align, src.shape, src.stride, fields,
                                  {k: v for k, v in t.items() if k not in ("tensor", "dyn_shape")}))
        offset += size
    return params


def _layout_tensors(tensors: list[dict]) -> list[KernelParam]:
    params, offset = [], 0
    for ordinal, t in enumerate(tensors):
        items = [("ptr", 8, None, None)]
        items += [("shape", s["width"] // 8, s["mode"], s.get("symbol")) for s in t["dyn_shape"]]
        items += [("stride", s["width"] // 8, s["mode"], s.get("symbol")) for s in t["dyn_stride"]]
        align = max(size for _, size, _, _ in items)
        offset = -(-offset // align) * align
        fields, pos = [], 0
        for kind, size, mode, symbol in items:
            pos = -(-pos // size) * size
            fields.append(ParamField(offset + pos, size, kind, t["name"], mode, symbol))
            pos += size
        struct_size = -(-pos // align) * align
        dt, nbytes = DTYPES[t["dtype"]]
        params.append(KernelParam(ordinal, offset, struct_size, t["name"], dt, nbytes, t["align"],
                                  tuple(t["shape"]), tuple(t["stride"]), tuple(fields)))
        offset += struct_size
    return params


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)", re.S)
_PARAM_DECL = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+(\w+?)_param_(\d+)(?:\[(\d+)\])?")
_LD_PARAM = re.compile(r"ld\.param(?:\.v(\d))?\.[bsuf](\d+)\s+[^\[]*\[(\w+?)_param_(\d+)(?:\+(\d+))?\]")


def check_ptx_params(ptx: str, entry: str, params: list[KernelParam]) -> list[str]:
    """Problems found comparing the PTX entry's parameters and loads with the derived ABI."""
    problems = []
    m = next((m for m in _ENTRY.finditer(ptx) if m.group(1) == entry), None)
    if m is None:
        return [f"no .entry {entry} in the PTX"]
    # groups: (align, type, entry name, ordinal, byte size of a .b8 array)
    decls = {int(d[3]): d for d in (x.groups() for x in _PARAM_DECL.finditer(m.group(2)))}
    if sorted(decls) != list(range(len(params))):
        problems.append(f"PTX declares parameters {sorted(decls)}, expected {len(params)}")
    by_ord = {p.ordinal: p for p in params}
    for i, d in decls.items():
        p = by_ord.get(i)
        size = int(d[4]) if d[4] else int(re.sub(r"\D", "", d[1]) or 0) // 8
        if p is not None and size != p.size:
            problems.append(f"param {i} ({p.tensor}) is {size} bytes in PTX, expected {p.size}")
    for ld in _LD_PARAM.finditer(ptx):
        if ld.group(3) != entry:
            continue
        vec, bits, i, off = int(ld.group(1) or 1), int(ld.group(2)), int(ld.group(4)), int(ld.group(5) or 0)
        p = by_ord.get(i)
        if p is None:
            problems.append(f"load from undeclared param {i}")
            continue
        starts = {f.offset - p.offset: f for f in p.fields}
        ends = {f.offset - p.offset + f.size for f in p.fields}
        end = off + vec * bits // 8
        if off not in starts or end not in ends:
            problems.append(f"{p.tensor}: {vec}x{bits}-bit load at +{off} does not match a field")
        elif vec == 1 and starts[off].size * 8 != bits:
            problems.append(f"{p.tensor}: {bits}-bit load of the {starts[off].size * 8}-bit "
                            f"{starts[off].kind} field at +{off}")
    return problems


# -- cubin (ELF) reading ---------------------------------------------------------------------------
# .nv.info record formats and attributes (see `cuobjdump -elf`).
_EIFMT_SVAL, _EIFMT_HVAL = 0x04, 0x03
_EIATTR_PARAM_CBANK, _EIATTR_REQNTID, _EIATTR_FRAME_SIZE = 0x0A, 0x10, 0x11
_EIATTR_KPARAM_INFO, _EIATTR_CBANK_PARAM_SIZE, _EIATTR_REGCOUNT = 0x17, 0x19, 0x2F
_STO_CUDA_ENTRY = 0x10
_EICOMPAT_ATTR_CUDA_ACCELERATOR_TARGET = 0x09


@dataclass
class KernelInfo:
    kparams: dict[int, tuple[int, int]] = field(default_factory=dict)  # ordinal -> (offset, size)
    param_bytes: int = 0
    reqntid: tuple[int, int, int] | None = None
    registers: int = 0
    local_bytes: int = 0


@dataclass
class CubinInfo:
    arch: str
    kernels: dict[str, KernelInfo]


def _nv_info_records(data: bytes):
    pos = 0
    while pos + 4 <= len(data):
        fmt, attr, val = data[pos], data[pos + 1], struct.unpack_from("<H", data, pos + 2)[0]
        pos += 4
        if fmt == _EIFMT_SVAL:
            yield attr, data[pos:pos + val]
            pos += val
        else:
            yield attr, val


def parse_cubin(cubin: bytes) -> CubinInfo:
    """Arch, kernel entries and their parameter/resource attributes from a cubin's ELF."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF")
    (e_shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    (e_flags,) = struct.unpack_from("<I", cubin, 0x30)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = []
    for i in range(e_shnum):
        name, typ, _, _, off, size, link, info, _, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", cubin, e_shoff + i * e_shentsize)
        secs.append((name, typ, off, size, link, info, entsize))
    shstr = secs[e_shstrndx]

    def cstr(tab, idx):
        start = tab[2] + idx
        return cubin[start:cubin.index(b"\0", start)].decode()

    names = [cstr(shstr, s[0]) for s in secs]
    symtab = next(s for s, n in zip(secs, names) if n == ".symtab")
    strtab = secs[symtab[4]]
    syms = []
    for i in range(symtab[3] // symtab[6]):
        st_name, st_info, st_other, _, _, _ = struct.unpack_from("<IBBHQQ", cubin, symtab[2] + i * symtab[6])
        syms.append((cstr(strtab, st_name), st_info, st_other))
    kernels = {n: KernelInfo() for n, st_info, other in syms
               if st_info & 0xF == 2 and st_info >> 4 == 1 and other & _STO_CUDA_ENTRY}
    accelerator = False
    for s, n in zip(secs, names):
        data = cubin[s[2]:s[2] + s[3]]
        if n == ".nv.compat":
            accelerator = any(attr == _EICOMPAT_ATTR_CUDA_ACCELERATOR_TARGET and val == 1
                              for attr, val in _nv_info_records(data))
        elif n == ".nv.info":
            for attr, val in _nv_info_records(data):
                if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and isinstance(val, bytes):
                    sym_idx, v = struct.unpack_from("<II", val)
                    k = kernels.get(syms[sym_idx][0])
                    if k is not None and attr == _EIATTR_REGCOUNT:
                        k.registers = v
                    elif k is not None:  # a stack frame is local memory: spills or local arrays
                        k.local_bytes = max(k.local_bytes, v)
        elif n.startswith(".nv.info.") and n[len(".nv.info."):] in kernels:
            k = kernels[n[len(".nv.info."):]]
            for attr, val in _nv_info_records(data):
                if attr == _EIATTR_KPARAM_INFO:
                    _, ordinal, off, packed = struct.unpack_from("<IHHI", val)
                    k.kparams[ordinal] = (off, (packed >> 18) & 0x3FFF)
                elif attr == _EIATTR_CBANK_PARAM_SIZE:
                    k.param_bytes = val
                elif attr == _EIATTR_REQNTID:
                    k.reqntid = struct.unpack_from("<III", val)
        elif n.startswith(".nv.local.") and n[len(".nv.local."):] in kernels:
            kernels[n[len(".nv.local."):]].local_bytes = s[3]
    return CubinInfo(arch=_arch(e_flags, accelerator), kernels=kernels)


def _arch(e_flags: int, accelerator: bool) -> str:
    # ELF ABI v8 keeps the SM number in e_flags bits 8..15; the arch-specific "a" variant is not
    # in e_flags but in .nv.compat (EICOMPAT_ATTR_CUDA_ACCELERATOR_TARGET = 1), which is where
    # `cuobjdump -elf` reads its "sm=90a" from.
    return f"sm_{(e_flags >> 8) & 0xFF}{'a' if accelerator else ''}"


# -- the worker (runs in the subprocess, imports cutlass) --------------------------------------
def describe_tensors(args) -> list[dict]:
    """[(name, CuTe fake tensor)] -> what layout_params needs (call where cutlass is imported)."""
    from cutlass.cute.typing import SymInt

    def dyn(values):
        return [{"mode": i, "width": v.width, "symbol": v.symbol}
                for i, v in enumerate(values) if isinstance(v, SymInt)]

    def static(values):
        return [(v.symbol or f"?{i}") if isinstance(v, SymInt) else int(v) for i, v in enumerate(values)]

    out = []
    for name, t in args:
        out.append({
            "name": name, "dtype": t.element_type.__name__, "align": t._assumed_align or 1,
            "shape": static(t.shape), "stride": static(t.stride),
            # Each dynamic entry has its SymInt's width in the kernel's struct, strides included
            # (export_to_c's host header may say int64 for a 32-bit stride; the kernel does not).
            "dyn_shape": dyn(t.shape),
            "dyn_stride": dyn(t.stride),
        })
    return out


def _worker(spec_text: str, target_name: str, workdir: Path) -> int:
    import importlib

    from k3gen.ops import spec_from_canonical
    from k3gen.targets import get_target

    target = get_target(target_name)
    spec = spec_from_canonical(spec_text, target)
    if os.environ.get("CUTE_DSL_ARCH") != target.arch:
        print(f"CUTE_DSL_ARCH={os.environ.get('CUTE_DSL_ARCH')!r}, expected {target.arch}", file=sys.stderr)
        return 2
    import cutlass.cute as cute
    from cutlass.runtime import make_fake_stream

    mod = importlib.import_module(f"k3gen.ops.{spec.op}.cute_kernel")
    fn, args = mod.compile_args(spec)
    compiled = cute.compile(fn, *[a for _, a in args], make_fake_stream())
    tensors = describe_tensors(args)
    dump = Path(os.environ["CUTE_DSL_DUMP_DIR"])
    arch = os.environ["CUTE_DSL_ARCH"]
    for ext in ("cubin", "ptx"):
        found = sorted(dump.glob(f"*.{arch}.{ext}"))
        if len(found) != 1:
            print(f"expected one *.{arch}.{ext} in {dump}, found {[f.name for f in found]}", file=sys.stderr)
            return 3
        shutil.copyfile(found[0], workdir / f"kernel.{ext}")
    maps = Path("/proc/self/maps")
    driver_loaded = maps.exists() and "libcuda.so" in maps.read_text()
    result = {"cubin": str(workdir / "kernel.cubin"), "ptx": str(workdir / "kernel.ptx"),
              "kernels": list(compiled.kernel_info),
              "tensors": tensors,
              # TMA parameters after the tensors (op modules that load by TMA describe them).
              "tma": list(getattr(fn, "tma_params", lambda: [])()),
              # A kernel sized per spec reports its shared memory on the traced object.
              "dynamic_smem": int(getattr(fn, "smem_bytes", 0) or getattr(mod, "DYNAMIC_SMEM_BYTES", 0)),
              "driver_loaded": driver_loaded}
    tmp = workdir / "result.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, workdir / "result.json")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3gen.pipeline.cute")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="compile one spec (CUTE_DSL_ARCH must be set); internal")
    w.add_argument("--spec", required=True)
    w.add_argument("--target", required=True)
    w.add_argument("--workdir", required=True)
    a = ap.parse_args(argv)
    return _worker(a.spec, a.target, Path(a.workdir))


if __name__ == "__main__":
    sys.exit(main())
