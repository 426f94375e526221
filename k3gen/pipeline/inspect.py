"""Resource and SASS inspection of cubins with the cuobjdump / nvdisasm of the CUDA wheels."""
from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field

from k3gen.errors import K3genError
from k3gen.pipeline.toolchain import tool

# Opcodes worth a column in the build table: matrix units, FP4/FP8 conversions, async copies.
NOTABLE = ("HGMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA", "UTCMMA", "UTCBAR", "HMMA", "QMMA", "OMMA",
           "F2FP", "UTMALDG", "UTMASTG", "LDGSTS", "SYNCS", "F2I", "I2F")


@dataclass
class KernelResources:
    function: str
    registers: int
    shared: int
    local: int        # bytes of local memory per thread: non-zero means spills or stack arrays
    stack: int
    constant0: int
    sass: dict[str, int] = field(default_factory=dict)

    @property
    def spills(self) -> bool:
        # ptxas may spill to the stack frame with LOCAL still 0; either counts.
        return self.local > 0 or self.stack > 0

    def notable(self) -> str:
        parts = [f"{op}x{n}" for op, n in sorted(self.sass.items())
                 if any(op.startswith(p) for p in NOTABLE)]
        return " ".join(parts)

    def to_json(self) -> dict:
        return asdict(self)


def _run(args: list[str]) -> str:
    exe = tool(args[0])
    if exe is None:
        raise K3genError(f"{args[0]} not found: install nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm")
    proc = subprocess.run([exe, *args[1:]], capture_output=True, text=True)
    if proc.returncode != 0:
        raise K3genError(f"{args[0]} failed: {proc.stderr.strip()}")
    return proc.stdout


def _with_file(cubin: bytes, fn):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return fn(f.name)


_RES = re.compile(r"Function (\S+):\s*\n\s*(REG:.*)")


def resources(cubin: bytes, with_sass: bool = True) -> list[KernelResources]:
    def go(path):
        text = _run(["cuobjdump", "-res-usage", path])
        out = []
        for m in _RES.finditer(text):
            kv = dict(f.split(":", 1) for f in m[2].split())
            out.append(KernelResources(m[1], int(kv["REG"]), int(kv.get("SHARED", 0)), int(kv.get("LOCAL", 0)),
                                       int(kv.get("STACK", 0)), int(kv.get("CONSTANT[0]", 0))))
        if with_sass:
            hist = sass_histograms_file(path)
            for r in out:
                r.sass = hist.get(r.function, {})
        return out
    return _with_file(cubin, go)


_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def sass_histograms_file(path: str) -> dict[str, dict[str, int]]:
    text = _run(["cuobjdump", "-sass", path])
    hists: dict[str, collections.Counter] = {}
    cur = None
    for line in text.splitlines():
        if "Function :" in line:
            cur = line.split("Function :")[1].strip()
            hists[cur] = collections.Counter()
            continue
        m = _SASS_LINE.match(line)
        if m and cur is not None:
            hists[cur][m.group(1).split(".")[0]] += 1
    return {k: dict(v) for k, v in hists.items()}


def sass_text(cubin: bytes) -> str:
    return _with_file(cubin, lambda p: _run(["cuobjdump", "-sass", p]))


def cubin_arch(cubin: bytes) -> str:
    """The SM the cubin was built for, e.g. 'sm_90a', read from its ELF header flags."""
    text = _with_file(cubin, lambda p: _run(["cuobjdump", "-sass", p]))
    m = re.search(r"code for (sm_\w+)", text)
    if not m:
        raise K3genError("could not read the cubin's arch")
    return m.group(1)
