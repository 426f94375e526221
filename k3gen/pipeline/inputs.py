"""What a kernel's bytes are made from, known without rendering: the inputs digest and the cache key.

The runtime looks a spec up in a bundle manifest and in the cache before anything is rendered (the
GPU machine loads kernels without Jinja2 ever running), so both keys are computed from the spec and
the files its source is generated from, never from the source itself. Nothing here imports Jinja2,
NVRTC or CuTe DSL at module level.
"""
from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

from k3gen.config import settings
from k3gen.ir.spec import OpSpec
from k3gen.pipeline.cute import cute_flags
from k3gen.pipeline.nvrtc import INCLUDE_DIR, flags_for
from k3gen.pipeline.store import cache_key
from k3gen.pipeline.toolchain import cutlass_dsl_version, nvrtc_version

PACKAGE_DIR = Path(__file__).resolve().parent.parent
OPS_DIR = PACKAGE_DIR / "ops"

# Files of an op folder that never reach a kernel's bytes: a launcher edit on the GPU machine must
# not make a bundle built elsewhere stale.
_RUNTIME_ONLY = frozenset({"launcher.py", "reference.py"})
# Python every template and CuTe module may read besides op folders: the IR, per-arch facts and the
# FP32 quantizers (the layer rule keeps spec.py/variants.py to these).
_SHARED = ("ir", "arch", "numerics.py")
# What each lowering adds: the renderer (its header and frozen include paths are in every source)
# and the NVRTC flags; the CuTe worker that traces the module. The headers of the include root
# come per op (`_headers`).
_LOWERING = {"nvrtc": ("pipeline/render.py", "pipeline/nvrtc.py"),
             "cute": ("pipeline/cute.py",)}
_SUFFIXES = (".py", ".j2", ".cuh", ".h")
_OP_IMPORT = re.compile(r"\bk3gen\.ops\.(\w+)")
_INCLUDE = re.compile(r'#\s*include\s+"([^"]+)"')


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _SUFFIXES
                  and "__pycache__" not in p.parts)


def _op_files(op: str) -> list[Path]:
    return [p for p in _files(OPS_DIR / op) if p.name not in _RUNTIME_ONLY]


def op_folders(op: str) -> list[str]:
    """The op and, transitively, every op its files import (mla_q_absorb builds on the GEMM's spec)."""
    seen, todo = [], [op]
    while todo:
        cur = todo.pop()
        if cur in seen or not (OPS_DIR / cur).is_dir():
            continue
        seen.append(cur)
        for p in _op_files(cur):
            if p.suffix == ".py":
                todo.extend(m for m in _OP_IMPORT.findall(p.read_text()) if m not in seen)
    return sorted(seen)


_HEADER_REF = re.compile(r"[\"']k3gen/(\w+)/([^\"']*)")


def _named_headers(root: Path, texts: list[str]) -> list[Path] | None:
    """The headers an op's files name in quotes ("k3gen/mla/prefill.cuh"): a whole name is that header;
    a name completed at render time ("k3gen/mla/decode_wg_{...}") is every header of its folder whose
    name starts with the literal part. None when the files name no include folder."""
    out, named = [], False
    for t in texts:
        for d, rest in _HEADER_REF.findall(t):
            folder = root / "k3gen" / d
            if not folder.is_dir():
                continue
            named = True
            lit = re.split(r"[{}%]", rest)[0]   # a whole name is its own prefix
            out += [f for f in _files(folder) if f.relative_to(folder).as_posix().startswith(lit)]
    return out if named else None


def _headers(sources: list[Path]) -> list[Path]:
    """The include-root headers these op files reach through `#include "..."`, transitively, so a
    header edit rebuilds only the ops that include it.

    A template whose include path is computed (`#include "{{ ... }}"`, the header a variant names)
    may reach any header its files name in quotes ("k3gen/mla/prefill.cuh"; a name with a rendered
    part, every header of that folder matching its literal prefix), and the root's own forwarding
    headers (frozen targets' old paths); with no folder named, the whole root. (Whole folders were
    the rule until 2026-12-08: an edit of mla/prefill.cuh made kv_cache_write's bundle entries
    stale.)"""
    root = PACKAGE_DIR / INCLUDE_DIR.name
    texts = [p.read_text() for p in sources]
    includes = [inc for p, t in zip(sources, texts) if p.suffix in (".j2", ".cuh", ".h")
                for inc in _INCLUDE.findall(t)]
    seeds = [root / inc for inc in includes if "{" not in inc]
    if any("{" in inc for inc in includes):
        named = _named_headers(root, texts)
        if named is None:
            return _files(root)
        seeds += named
        seeds += [f for f in (root / "k3gen").iterdir() if f.is_file() and f.suffix in _SUFFIXES]
    seen: set[Path] = set()
    todo = [p for p in seeds if p.is_file()]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        todo += [root / inc for inc in _INCLUDE.findall(p.read_text()) if (root / inc).is_file()]
    return sorted(seen)


@functools.lru_cache(maxsize=None)
def inputs_digest(op: str, lowering: str) -> str:
    """sha256 over every file a source of this op and lowering is generated from (cached per op)."""
    if lowering not in _LOWERING:
        raise ValueError(f"unknown lowering {lowering!r}")
    files: list[Path] = []
    for o in op_folders(op):
        files += _op_files(o)
    if lowering == "nvrtc":
        files += _headers(files)
    for rel in _SHARED + _LOWERING[lowering]:
        files += _files(PACKAGE_DIR / rel)
    h = hashlib.sha256()
    for f in sorted(set(files)):
        h.update(str(f.relative_to(PACKAGE_DIR)).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()


def spec_inputs_digest(spec: OpSpec) -> str:
    return inputs_digest(spec.op, spec.lowering)


def compiler_id(spec: OpSpec) -> str:
    return f"nvrtc-{nvrtc_version()}" if spec.lowering == "nvrtc" else f"cutlass-dsl-{cutlass_dsl_version()}"


def flags(spec: OpSpec) -> list[str]:
    """The flags that change the bytes (K3GEN_NVRTC_EXTRA included)."""
    if spec.lowering == "nvrtc":
        return flags_for(spec.target, tuple(settings().nvrtc_extra.split()))
    return cute_flags(spec)


def kernel_key(spec: OpSpec) -> str:
    """The cache key of a spec's cubin, without rendering its source."""
    return cache_key(spec_digest=spec.digest(), inputs_digest=spec_inputs_digest(spec),
                     compiler=compiler_id(spec), target=spec.target.arch, flags=flags(spec))
