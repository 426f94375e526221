"""Content-addressed cubin cache.

Key = sha256 over: spec digest, the digest of every file the source is generated from
(k3gen.pipeline.inputs), k3gen's own source hash, compiler versions, target and flags. The source
is a function of the first two, so the key is known without rendering it; thread count is
deliberately not in it. Entries are written atomically (temp file +
os.replace) under a per-key file lock, the manifest last; an entry whose cubin does not hash
to its manifest's value is corrupt and is rebuilt.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from filelock import FileLock

from k3gen.config import settings

PACKAGE_DIR = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def k3gen_source_hash() -> str:
    """Hash of k3gen's own Python sources and templates: any change invalidates cubins."""
    h = hashlib.sha256()
    for f in sorted(PACKAGE_DIR.rglob("*")):
        if f.suffix in (".py", ".j2", ".cuh") and "__pycache__" not in f.parts:
            h.update(str(f.relative_to(PACKAGE_DIR)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def cache_key(*, spec_digest: str, inputs_digest: str, compiler: str, target: str,
              flags: list[str] | tuple[str, ...], k3gen_hash: str | None = None) -> str:
    payload = {
        "spec": spec_digest,
        "inputs": inputs_digest,
        "k3gen": k3gen_hash if k3gen_hash is not None else k3gen_source_hash(),
        "compiler": compiler,
        "target": target,
        "flags": list(flags),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass
class Entry:
    key: str
    cubin: bytes
    meta: dict


class KernelCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else settings().cache_dir

    def _dir(self, key: str) -> Path:
        return self.root / "kernels" / key[:2] / key

    def _lock(self, key: str) -> FileLock:
        (self.root / "locks").mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / "locks" / f"{key}.lock"))

    def get(self, key: str) -> Entry | None:
        """The entry, or None if absent. A corrupt entry is removed and reported as absent."""
        d = self._dir(key)
        man = d / "manifest.json"
        if not man.exists():
            return None
        try:
            meta = json.loads(man.read_text())
            cubin = (d / "kernel.cubin").read_bytes()
            ok = meta.get("key") == key and hashlib.sha256(cubin).hexdigest() == meta.get("cubin_sha256")
        except (OSError, ValueError):
            ok = False
        if not ok:
            shutil.rmtree(d, ignore_errors=True)
            return None
        return Entry(key, cubin, meta)

    def put(self, key: str, cubin: bytes, meta: dict, source: str | None = None) -> Entry:
        d = self._dir(key)
        d.mkdir(parents=True, exist_ok=True)
        # Manifest last: its presence is what marks the entry complete.
        man = d / "manifest.json"
        if man.exists():
            man.unlink()
        if source is not None:
            _atomic_write(d / "source.cu", source.encode())
        _atomic_write(d / "kernel.cubin", cubin)
        meta = {**meta, "key": key, "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
                "cubin_bytes": len(cubin)}
        _atomic_write(man, json.dumps(meta, sort_keys=True, indent=1).encode())
        return Entry(key, cubin, meta)

    def get_or_build(self, key: str, build: Callable[[], tuple[bytes, dict]],
                     source: str | None = None) -> tuple[Entry, bool]:
        """Return (entry, built). Many processes asking for one key compile it once."""
        e = self.get(key)
        if e is not None:
            return e, False
        with self._lock(key):
            e = self.get(key)
            if e is not None:
                return e, False
            cubin, meta = build()
            return self.put(key, cubin, meta, source), True

    def update_meta(self, key: str, extra: dict) -> None:
        e = self.get(key)
        if e is None:
            return
        with self._lock(key):
            meta = {**e.meta, **extra}
            _atomic_write(self._dir(key) / "manifest.json", json.dumps(meta, sort_keys=True, indent=1).encode())

    # -- maintenance ------------------------------------------------------------------------
    def entries(self) -> list[str]:
        base = self.root / "kernels"
        if not base.exists():
            return []
        return sorted(p.name for p in base.glob("*/*") if p.is_dir())

    def verify(self) -> tuple[int, list[str]]:
        """(number of good entries, keys of corrupt ones, which are removed)."""
        good, bad = 0, []
        for k in self.entries():
            if self.get(k) is None:
                bad.append(k)
            else:
                good += 1
        return good, bad

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in (self.root / "kernels").rglob("*") if f.is_file()) \
            if (self.root / "kernels").exists() else 0

    def clear(self) -> int:
        n = len(self.entries())
        shutil.rmtree(self.root / "kernels", ignore_errors=True)
        shutil.rmtree(self.root / "locks", ignore_errors=True)
        return n
