"""Content-addressed cubin cache.

Key = sha256 over: spec digest, the digest of every file the source is generated from
(k3gen.pipeline.inputs), k3gen's own source hash, compiler versions, target and flags. The source
is a function of the first two, so the key is known without rendering it; thread count is
deliberately not in it. Entries are written atomically (temp file +
os.replace) under a per-key file lock, the manifest last; an entry whose cubin does not hash
to its manifest's value is corrupt and is rebuilt. Entries are removed only under their lock, so a
reader never deletes what a writer is finishing; `verify()` removes what it reports removed.
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

from filelock import FileLock, Timeout

from k3gen.config import settings
from k3gen.errors import CacheError

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


@dataclass(frozen=True)
class Damaged:
    """A cache entry `verify()` removed: its key, the kernel it held (op and slug) and why."""
    key: str
    kernel: str
    why: str


@dataclass
class Verified:
    good: int
    removed: list[Damaged]
    busy: list[str]        # keys a build held locked: left alone, checked by the next run


def _kernel_name(d: Path, meta: dict | None) -> str:
    """'op slug' from the manifest's file name, else the op and target of the source's spec line."""
    stem = str((meta or {}).get("file", "")).split(".")[0]
    if stem.count("__") >= 2:
        op, slug = stem.split("__")[:2]
        return f"{op} {slug}"
    try:
        head = (d / "source.cu").read_text(errors="replace")[:4096]
    except OSError:
        return "unknown kernel (no manifest, no source)"
    for line in head.splitlines():
        if line.lstrip("/# ").startswith("spec: "):
            try:
                spec = json.loads(line.split("spec: ", 1)[1])
            except ValueError:
                break
            return f"{spec.get('op', '?')} (target {spec.get('target', {}).get('name', '?')})"
    return "unknown kernel (unreadable source)"


class KernelCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else settings().cache_dir

    def _dir(self, key: str) -> Path:
        return self.root / "kernels" / key[:2] / key

    def _lock(self, key: str) -> FileLock:
        try:
            (self.root / "locks").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"kernel cache {self.root} is unusable: {e.strerror or e}") from e
        # One lock object per path in a process, so its holder may re-enter it (scan -> _discard).
        return FileLock(str(self.root / "locks" / f"{key}.lock"), is_singleton=True)

    def ensure_usable(self) -> Path:
        """Make the root; CacheError unless it is a folder this process can write."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"kernel cache {self.root} is unusable: {e.strerror or e}") from e
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CacheError(f"kernel cache {self.root} is unusable: not a writable folder "
                             "(set K3GEN_CACHE_DIR to one)")
        return self.root

    def _read(self, key: str) -> tuple[Entry | None, str]:
        """(entry, "") when good; (None, "") when absent; (None, why) when the folder is damaged."""
        d = self._dir(key)
        man = d / "manifest.json"
        if not man.exists():
            return None, ("no manifest (incomplete write)" if d.is_dir() else "")
        try:
            meta = json.loads(man.read_text())
            cubin = (d / "kernel.cubin").read_bytes()
        except OSError as e:
            return None, f"unreadable: {e.strerror or e}"
        except ValueError:
            return None, "manifest is not JSON"
        if not isinstance(meta, dict) or meta.get("key") != key:
            return None, "manifest names another key"
        if hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256"):
            return None, "cubin does not match its manifest's hash"
        return Entry(key, cubin, meta), ""

    def _discard(self, key: str, timeout: float) -> Damaged | None:
        """Under the key's lock: remove the entry's folder if it is still damaged (None: good, absent
        or locked by someone else for longer than `timeout`)."""
        lock = self._lock(key)
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            return None
        try:
            d = self._dir(key)
            e, why = self._read(key)
            if e is not None or not d.is_dir():
                return None
            try:
                meta = json.loads((d / "manifest.json").read_text())
            except (OSError, ValueError):
                meta = None
            dmg = Damaged(key, _kernel_name(d, meta if isinstance(meta, dict) else None), why)
            shutil.rmtree(d)
            return dmg
        finally:
            lock.release()

    def get(self, key: str) -> Entry | None:
        """The entry, or None if absent. A corrupt entry is removed (under its lock) and reads as
        absent; a folder without a manifest may be a write in progress and is left to its writer."""
        e, why = self._read(key)
        if e is None and why and (self._dir(key) / "manifest.json").exists():
            self._discard(key, timeout=0)   # locked: its writer is replacing it; do not wait
        return e

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

    def scan(self) -> Verified:
        """Check every entry under its lock and remove the damaged ones: those without a manifest
        too (nothing holds their lock, so no write is in progress), and the temp files of killed
        writes. Entries a build holds locked are reported busy and left alone."""
        good, removed, busy = 0, [], []
        for k in self.entries():
            lock = self._lock(k)
            try:
                lock.acquire(timeout=0)
            except Timeout:
                busy.append(k)
                continue
            try:
                if self._read(k)[0] is not None:
                    good += 1
                    for t in self._dir(k).glob(".tmp-*"):
                        t.unlink(missing_ok=True)
                else:
                    d = self._discard(k, timeout=0)   # re-entrant: this process holds the lock
                    if d is not None:
                        removed.append(d)
            finally:
                lock.release()
        return Verified(good, removed, busy)

    def verify(self) -> tuple[int, list[str]]:
        """(number of good entries, keys of the damaged ones, which are removed)."""
        v = self.scan()
        return v.good, [d.key for d in v.removed]

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in (self.root / "kernels").rglob("*") if f.is_file()) \
            if (self.root / "kernels").exists() else 0

    def clear(self) -> int:
        n = len(self.entries())
        shutil.rmtree(self.root / "kernels", ignore_errors=True)
        shutil.rmtree(self.root / "locks", ignore_errors=True)
        return n


# -- random checkpoints ---------------------------------------------------------------------------
# `k3gen generate` without --checkpoint runs a random checkpoint; it is made once per key (the
# model side derives it from the config, seed and writer) under <cache dir>/checkpoints/<key>/ and
# reused. k3gen owns only the folder and its life cycle (it never imports model/): the writer is
# passed in. A folder is complete once it has its final name: it is written under a temp name and
# renamed under the key's lock, so concurrent runs write it once and a killed run leaves only a
# `.tmp-*` folder, which the next writer of any key and `cache clear` remove.

def checkpoints_root(root: Path | None = None) -> Path:
    return (Path(root) if root is not None else settings().cache_dir) / "checkpoints"


def cached_checkpoint(key: str, write: Callable[[Path], object], root: Path | None = None) -> tuple[Path, bool]:
    """(folder, written): the folder of `key`, made by `write(temp folder)` if absent."""
    base = checkpoints_root(root)
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheError(f"checkpoint cache {base} is unusable: {e.strerror or e}") from e
    final = base / key
    if final.is_dir():
        return final, False
    with FileLock(str(base / f".{key}.lock")):
        if final.is_dir():
            return final, False
        for old in base.glob(".tmp-*"):
            _remove_stale(base, old, key)
        tmp = Path(tempfile.mkdtemp(dir=base, prefix=f".tmp-{key}-"))
        try:
            write(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final, True


def _remove_stale(base: Path, old: Path, held: str) -> None:
    """Remove a temp folder of a killed writer. Its key's lock tells: a live writer holds it (the
    caller holds `held`'s, so a temp folder of that key is stale)."""
    k = old.name[len(".tmp-"):].rsplit("-", 1)[0]   # mkdtemp's random suffix has no dash
    if k == held:
        shutil.rmtree(old, ignore_errors=True)
        return
    lk = FileLock(str(base / f".{k}.lock"))
    try:
        lk.acquire(timeout=0)
    except Timeout:
        return
    try:
        shutil.rmtree(old, ignore_errors=True)
    finally:
        lk.release()


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())


def clear_checkpoints(root: Path | None = None) -> int:
    """Remove every cached random checkpoint (and the leftovers of killed writes); returns how many."""
    base = checkpoints_root(root)
    if not base.is_dir():
        return 0
    n = sum(1 for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
    shutil.rmtree(base, ignore_errors=True)
    return n
