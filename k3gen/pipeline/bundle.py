"""The one prebuilt-bundle format (`k3gen build --out DIR`), written here and read by k3gen.runtime.resolve.

DIR/<target module>/bundle.json maps each kernel's file stem to its metadata, next to <stem>.cubin:
entry, arch, compiler, spec (canonical JSON), source_sha256, inputs_sha256 (k3gen.pipeline.inputs:
the digest of every file the source is generated from, so a reader can tell a stale cubin without
rendering), params (the CuTe launch ABI), resources.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from k3gen.ir.target import Target

INDEX = "bundle.json"
KEYS = ("entry", "arch", "compiler", "source_sha256", "inputs_sha256", "params", "resources", "spec")


def write_bundle(out: Path, target: Target, results) -> Path:
    """Write the cubins of `results` (k3gen.pipeline.stages.BuildResult) and their manifest."""
    d = Path(out) / target.module_name
    d.mkdir(parents=True, exist_ok=True)
    index = {}
    for r in results:
        stem = r.artifact.spec.file_stem
        (d / f"{stem}.cubin").write_bytes(r.cubin)
        index[stem] = {k: r.meta.get(k) for k in KEYS}
    (d / INDEX).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return d


# path -> (sha256 of the bytes, parsed manifest). Keyed by content, not mtime: a manifest rewritten
# within the filesystem's timestamp granularity must not be read stale.
_parsed: dict[str, tuple[str, dict]] = {}


def read_manifest(folder: Path, module_name: str) -> dict[str, dict]:
    """stem -> metadata of the bundle for one target ({} when the folder has none). A model loads
    every kernel through this, so each manifest is parsed once while its bytes stay the same."""
    idx = Path(folder) / module_name / INDEX
    try:
        data = idx.read_bytes()
    except FileNotFoundError:
        return {}
    digest = hashlib.sha256(data).hexdigest()
    hit = _parsed.get(str(idx))
    if hit is None or hit[0] != digest:
        hit = _parsed[str(idx)] = (digest, json.loads(data))
    return hit[1]


def cubin_path(folder: Path, module_name: str, stem: str) -> Path:
    return Path(folder) / module_name / f"{stem}.cubin"
