"""Build, on the CPU machine, every sm90 spec the GPU tests and benchmarks use, into one bundle.

The H200's driver rejects PTX from our NVRTC but loads its cubins, so the GPU run carries this
bundle (K3GEN_PREBUILT). Specs are found by importing each tests/gpu module (CPU torch is enough)
and collecting OpSpec objects from its globals; `k3gen build`'s list for sm90 is added too.
Usage: python scripts/prebuild_gpu.py OUT_DIR [--ops op1,op2]
`--ops` keeps only those ops (a partial bundle for a targeted run: the device carries at most 64 MiB,
and the whole bundle is about 60 MB).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3gen.pipeline.build import build_many, write_bundle  # noqa: E402
from k3gen.ir.spec import OpSpec  # noqa: E402
from k3gen.targets import build_specs, get_target  # noqa: E402


def _collect(obj, out: dict, depth: int = 0) -> None:
    if isinstance(obj, OpSpec):
        out[obj.digest()] = obj
    elif depth < 3 and isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out, depth + 1)
    elif depth < 3 and isinstance(obj, (list, tuple, set)):
        for v in obj:
            _collect(v, out, depth + 1)


def main(argv: list[str]) -> int:
    ops = None
    if "--ops" in argv:
        i = argv.index("--ops")
        ops = set(argv[i + 1].split(","))
        argv = argv[:i] + argv[i + 2:]
    out = Path(argv[0] if argv else "build-out")
    tgt = get_target("sm90")
    specs = {s.digest(): s for s in build_specs(tgt)}
    for f in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
        spec = importlib.util.spec_from_file_location(f"_gpu_{f.stem}", f)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001 - a module that needs a GPU at import is reported
            print(f"skip {f.name}: {e}")
            continue
        for name in dir(mod):
            _collect(getattr(mod, name), specs)
        extra = getattr(mod, "prebuild_specs", None)
        if callable(extra):
            for s in extra():
                specs[s.digest()] = s
    sm90 = [s for s in specs.values() if s.target.name == "sm90" and (ops is None or s.op in ops)]
    results = build_many(sm90, jobs=2)
    d = write_bundle(out, tgt, results)
    print(f"{len(results)} sm90 kernels ({sum(r.built for r in results)} compiled) -> {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
