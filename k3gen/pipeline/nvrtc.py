"""CUDA C++ -> cubin with NVRTC (cuda.bindings). Needs no GPU and no driver."""
from __future__ import annotations

import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from k3gen.errors import CompileError
from k3gen.ir.target import Target
from k3gen.pipeline.toolchain import cuda_include_dir, nvrtc_version

INCLUDE_DIR = Path(__file__).resolve().parent.parent / "include"

# Flags that change the bytes. Include paths are machine-specific and enter the key through the
# header contents instead.
BASE_FLAGS = ("-std=c++17", "-default-device", "--restrict", "-lineinfo")


def flags_for(target: Target, extra: tuple[str, ...] = ()) -> list[str]:
    return [f"--gpu-architecture={target.arch}", *BASE_FLAGS, *extra]


def include_flags() -> list[str]:
    inc = [f"-I{INCLUDE_DIR}"]
    cuda_inc = cuda_include_dir()
    if cuda_inc is not None:
        inc.append(f"-I{cuda_inc}")
    return inc


def _check(res, what: str):
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise CompileError(f"NVRTC {what} failed: {err}")
    return res[1] if isinstance(res, tuple) and len(res) == 2 else res


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    log: str
    ptx: str = ""     # only when asked for: the dump stage wants it, the cache does not


def compile_cubin(source: str, name: str, target: Target, *, extra: tuple[str, ...] = (),
                  source_dir: Path | None = None) -> tuple[bytes, str]:
    """Compile `source` to a cubin for `target`. Returns (cubin, log)."""
    c = compile_program(source, name, target, extra=extra, source_dir=source_dir)
    return c.cubin, c.log


def compile_program(source: str, name: str, target: Target, *, extra: tuple[str, ...] = (),
                    source_dir: Path | None = None, want_ptx: bool = False) -> Compiled:
    """Compile `source` for `target`; with want_ptx the PTX of the same program comes back too
    (NVRTC keeps it when compiling for a real arch, so the cubin is the one a plain compile makes).

    On failure the source is written to disk and CompileError carries the log, the options and
    a repro command.
    """
    from cuda.bindings import nvrtc

    opts = flags_for(target, extra) + include_flags()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check(err, "create")
    try:
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\x00").decode(errors="replace")
        if int(res) != 0:
            d = Path(source_dir) if source_dir else Path(tempfile.mkdtemp(prefix="k3gen-fail-"))
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"{name}.cu"
            path.write_text(source)
            repro = (f"{shlex.quote(sys.executable)} -m k3gen.pipeline.nvrtc {shlex.quote(str(path))} "
                     f"--arch {target.arch}")
            raise CompileError(f"NVRTC {nvrtc_version()} failed to compile {name} for {target.arch}",
                               log=log, options=opts, source_path=str(path), repro=repro)
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "get cubin")
        ptx = ""
        if want_ptx:
            _, size = nvrtc.nvrtcGetPTXSize(prog)
            buf = b" " * size
            _check(nvrtc.nvrtcGetPTX(prog, buf), "get PTX")
            ptx = buf.rstrip(b"\x00").decode()
        return Compiled(cubin, log, ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def main(argv=None) -> int:
    """Repro entry: python -m k3gen.pipeline.nvrtc FILE.cu --arch sm_90a [-o out.cubin]."""
    import argparse

    from k3gen.targets import TARGETS
    ap = argparse.ArgumentParser(prog="python -m k3gen.pipeline.nvrtc")
    ap.add_argument("file")
    ap.add_argument("--arch", required=True, help="e.g. sm_90a")
    ap.add_argument("-o", "--output")
    a = ap.parse_args(argv)
    tgt = next((t for t in TARGETS.values() if t.arch == a.arch), None)
    if tgt is None:
        print(f"unknown arch {a.arch}", file=sys.stderr)
        return 2
    try:
        cubin, log = compile_cubin(Path(a.file).read_text(), Path(a.file).stem, tgt)
    except CompileError as e:
        print(e, file=sys.stderr)
        return 1
    out = Path(a.output or Path(a.file).with_suffix(".cubin"))
    out.write_bytes(cubin)
    print(f"wrote {out} ({len(cubin)} bytes){' log: ' + log if log.strip() else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
