"""The content-addressed cache: key sensitivity, corruption recovery, concurrent builders."""
import hashlib
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from k3gen.pipeline.build import lower
from k3gen.ir.dtypes import KvDtype
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
from k3gen.pipeline.store import KernelCache, cache_key
from k3gen.targets import TARGETS

BASE = dict(spec_digest="a" * 64, source="src", inputs_digest="b" * 64, compiler="nvrtc-13.5",
            target="sm_90a", flags=["-std=c++17"], k3gen_hash="c" * 64)


@pytest.mark.parametrize("field,value", [
    ("spec_digest", "d" * 64), ("source", "src2"), ("inputs_digest", "e" * 64), ("compiler", "nvrtc-13.4"),
    ("target", "sm_103a"), ("flags", ["-std=c++17", "-G"]), ("k3gen_hash", "f" * 64)])
def test_key_is_sensitive(field, value):
    assert cache_key(**{**BASE, field: value}) != cache_key(**BASE)


def test_key_ignores_thread_count(monkeypatch):
    s = KvCacheWriteSpec(target=TARGETS["sm90"], kv=KvDtype.BF16)
    k1 = lower(s).key
    monkeypatch.setenv("K3GEN_JOBS", "7")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert lower(s).key == k1


def test_template_change_changes_key(monkeypatch):
    import k3gen.pipeline.render as J
    s = KvCacheWriteSpec(target=TARGETS["sm90"], kv=KvDtype.BF16)
    k1 = lower(s).key
    monkeypatch.setattr(J, "template_inputs_digest", lambda op: "0" * 64)
    assert lower(s).key != k1


def test_nvrtc_flags_change_key(monkeypatch):
    s = KvCacheWriteSpec(target=TARGETS["sm90"], kv=KvDtype.BF16)
    k1 = lower(s).key
    monkeypatch.setenv("K3GEN_NVRTC_EXTRA", "-maxrregcount=64")
    assert lower(s).key != k1


def test_put_get_and_corruption_recovery(tmp_path):
    c = KernelCache(tmp_path)
    key = "ab" + "0" * 62
    calls = []

    def build():
        calls.append(1)
        return b"CUBIN-BYTES", {"entry": "k"}
    e, built = c.get_or_build(key, build)
    assert built and e.cubin == b"CUBIN-BYTES" and c.get(key).meta["entry"] == "k"
    e, built = c.get_or_build(key, build)
    assert not built and len(calls) == 1
    # Corrupt the cubin: detected by hash, removed, rebuilt.
    (c._dir(key) / "kernel.cubin").write_bytes(b"garbage")
    assert c.verify() == (0, [key])
    e, built = c.get_or_build(key, build)
    assert built and e.cubin == b"CUBIN-BYTES" and len(calls) == 2
    # A torn manifest (written last) also reads as absent.
    (c._dir(key) / "manifest.json").write_text("{not json")
    assert c.get(key) is None
    c.put(key, b"CUBIN-BYTES", {"entry": "k"})
    assert c.clear() == 1 and c.entries() == [] and c.get(key) is None


def _worker(root, key, counter, barrier):
    barrier.wait()
    c = KernelCache(Path(root))

    def build():
        with open(counter, "a") as f:
            f.write("x")
        time.sleep(0.5)  # long enough that every process arrives while the first compiles
        return hashlib.sha256(b"deterministic").digest() * 100, {"entry": "k"}
    e, _ = c.get_or_build(key, build)
    return hashlib.sha256(e.cubin).hexdigest()


def test_eight_processes_one_compile(tmp_path):
    key = "cd" + "1" * 62
    counter = tmp_path / "count"
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        barrier = m.Barrier(8)
        with ctx.Pool(8) as pool:
            hashes = pool.starmap(_worker, [(str(tmp_path / "c"), key, str(counter), barrier)] * 8)
    assert counter.read_text() == "x"
    assert len(set(hashes)) == 1
