"""Build, on the CPU machine, every sm90 spec the GPU tests, benchmarks and model runs use, into one
bundle.

The H200's driver rejects PTX from our NVRTC but loads its cubins, so the GPU run carries this
bundle (K3GEN_PREBUILT). What it holds comes from data, never from executing a test module: the
committed sm90 tree (targets.build_specs), the enumerator's list for every model preset the H200
runs (`k3gen generate --config small` at every KV/SSM dtype and recipe, 0, 3 or 7 drafts), and the
tests' explicit lists (tests/gpu/specs.py).
Usage: python tools/prebuild_gpu.py OUT_DIR [--ops op1,op2] [--list]
`--ops` keeps only those ops (a partial bundle for a targeted run: the device carries at most 64 MiB,
and the whole bundle is about 60 MB); `--list` prints the spec count per source and builds nothing.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3gen.targets import DEFAULT_DRAFTS, build_specs, get_target, serving_sweep, sweep_specs  # noqa: E402

# Model presets the GPU runs end to end, at TP1 (one H200).
GPU_MODELS = ("small",)


def sources(target) -> dict[str, list]:
    """Each source of specs by name (tests/gpu/specs.py imported as data)."""
    from tests.gpu import specs as gpu_specs
    out = {"tree": build_specs(target)}
    for m in GPU_MODELS:
        out[f"model:{m}"] = sweep_specs(target, m, (1,), serving_sweep(target, drafts=DEFAULT_DRAFTS))
    out["tests"] = gpu_specs.all_specs()
    return out


def collect(target, ops: set[str] | None = None) -> list:
    specs: dict[str, object] = {}
    for lst in sources(target).values():
        for s in lst:
            if s.target == target and (ops is None or s.op in ops):
                specs.setdefault(s.digest(), s)
    return list(specs.values())


def main(argv: list[str]) -> int:
    ops = None
    if "--ops" in argv:
        i = argv.index("--ops")
        ops = set(argv[i + 1].split(","))
        argv = argv[:i] + argv[i + 2:]
    tgt = get_target("sm90")
    if "--list" in argv:
        for name, lst in sources(tgt).items():
            print(f"{name}: {len(lst)}")
        print(f"total (each once): {len(collect(tgt, ops))}")
        return 0
    from k3gen.pipeline.build import build_many, write_bundle
    out = Path(argv[0] if argv else "build-out")
    results = build_many(collect(tgt, ops), jobs=2)
    d = write_bundle(out, tgt, results)
    print(f"{len(results)} sm90 kernels ({sum(r.built for r in results)} compiled) -> {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
