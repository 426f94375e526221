"""Hashes of the frozen generated sources of the original target (sm100-mxfp4).

Two records, both append-only:
- `sm100_mxfp4.json`: sha256 of each generated source file. The sources include shared headers
  (e.g. the original verify kernel includes kda/verify.cuh / kda/common.cuh, which the NVFP4
  kernels share), so the file bytes alone cannot prove a frozen kernel unchanged;
- `sm100_mxfp4_sass.json`: per NVRTC version, sha256 of the SASS each frozen source compiles to
  (cuobjdump text: instructions and encodings, no line info), which changes whenever anything the
  kernel is built from changes its code, and does not when a shared header gains lines or code
  the frozen kernel does not use.

`python -m k3gen.pipeline.golden --add` records sources that are new (and the SASS of every frozen source
for the running NVRTC when that version has no record yet); it refuses to change a recorded hash,
because those kernels are frozen byte for byte once landed.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from k3gen.pipeline.generated import GENERATED_ROOT, REPO_ROOT

GOLDEN = REPO_ROOT / "tests" / "golden" / "sm100_mxfp4.json"
GOLDEN_SASS = REPO_ROOT / "tests" / "golden" / "sm100_mxfp4_sass.json"
FROZEN_TARGET = "sm100-mxfp4"


def current() -> dict[str, str]:
    d = GENERATED_ROOT / "sm100_mxfp4"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.cu"))}


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def sass_digest(cubin: bytes) -> str:
    """sha256 of the disassembly; the cubin itself also carries line info (-lineinfo), which moves
    whenever a shared header gains a line."""
    from k3gen.pipeline.inspect import sass_text
    lines = [ln.rstrip() for ln in sass_text(cubin).splitlines() if ln.strip()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def current_sass() -> dict[str, str]:
    """SASS digest of every source the frozen target builds now, by generated file name."""
    from k3gen.pipeline.stages import build_many
    from k3gen.targets import build_specs, get_target
    return {r.artifact.file_name: sass_digest(r.cubin)
            for r in build_many(build_specs(get_target(FROZEN_TARGET)), jobs=2)}


def nvrtc_key() -> str:
    from k3gen.pipeline.toolchain import nvrtc_version
    return f"nvrtc-{nvrtc_version()}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    recorded = _load(GOLDEN)
    now = current()
    changed = [n for n, h in recorded.items() if n in now and now[n] != h]
    if changed:
        print("frozen sources changed (not allowed): " + ", ".join(changed), file=sys.stderr)
        return 1
    new = {n: h for n, h in now.items() if n not in recorded}
    sass_all = _load(GOLDEN_SASS)
    key = nvrtc_key()
    sass_rec = sass_all.get(key, {})
    sass_now = current_sass()
    moved = [n for n, h in sass_rec.items() if n in sass_now and sass_now[n] != h]
    if moved:
        print(f"frozen kernels compile to different SASS ({key}; not allowed): " + ", ".join(moved), file=sys.stderr)
        return 1
    sass_new = {n: h for n, h in sass_now.items() if n not in sass_rec}
    if "--add" in argv:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({**recorded, **new}, indent=1, sort_keys=True) + "\n")
        sass_all[key] = {**sass_rec, **sass_new}
        GOLDEN_SASS.write_text(json.dumps(sass_all, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(new)} new frozen sources, {len(sass_new)} new SASS digests ({key})")
    else:
        print(f"{len(recorded)} frozen, {len(new)} new; SASS {len(sass_rec)} recorded, {len(sass_new)} new "
              f"({key}; use --add to record them)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
