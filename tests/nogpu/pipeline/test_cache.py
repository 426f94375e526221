"""The content-addressed cache: key sensitivity, corruption recovery, concurrent builders."""
import hashlib
import multiprocessing as mp
import time
from pathlib import Path

import pytest

import k3gen.pipeline.inputs as I
from k3gen.pipeline.build import lower, plan
from k3gen.ir.dtypes import KvDtype
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
from k3gen.pipeline.store import KernelCache, cache_key
from k3gen.targets import TARGETS

BASE = dict(spec_digest="a" * 64, inputs_digest="b" * 64, compiler="nvrtc-13.5",
            target="sm_90a", flags=["-std=c++17"], k3gen_hash="c" * 64)
PKG = Path(I.__file__).resolve().parents[1]


@pytest.mark.parametrize("field,value", [
    ("spec_digest", "d" * 64), ("inputs_digest", "e" * 64), ("compiler", "nvrtc-13.4"),
    ("target", "sm_103a"), ("flags", ["-std=c++17", "-G"]), ("k3gen_hash", "f" * 64)])
def test_key_is_sensitive(field, value):
    assert cache_key(**{**BASE, field: value}) != cache_key(**BASE)


def test_key_needs_no_render(monkeypatch):
    """The runtime computes the key of a spec before (and instead of) rendering it."""
    import k3gen.pipeline.render as R
    s = KvCacheWriteSpec(target=TARGETS["sm90"], kv=KvDtype.NVFP4, max_drafts=3)
    k = lower(s).key
    monkeypatch.setattr(R, "render", lambda spec: pytest.fail("rendered"))
    assert plan(s).key == k and plan(s).source == ""


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    """inputs_digest over a copy of the package, so a test may edit any file."""
    import shutil
    root = tmp_path / "k3gen"
    for rel in ("ops", "include", "ir", "arch", "numerics.py", "pipeline"):
        src = PKG / rel
        (shutil.copytree if src.is_dir() else shutil.copy)(src, root / rel)
    monkeypatch.setattr(I, "PACKAGE_DIR", root)
    monkeypatch.setattr(I, "OPS_DIR", root / "ops")

    def digest(op, lowering="nvrtc"):
        I.inputs_digest.cache_clear()
        return I.inputs_digest(op, lowering)
    yield root, digest
    I.inputs_digest.cache_clear()


def test_inputs_digest_covers_what_the_bytes_are_made_from(package_copy):
    root, digest = package_copy
    before = {op: digest(op) for op in ("kv_cache_write", "kda_prefill", "kda_decode")}
    cute = digest("act_quant_fp8", "cute")

    def edited(rel: str) -> dict:
        p = root / rel
        p.write_text(p.read_text() + "\n// edited\n")
        return {op: digest(op) for op in before}
    after = edited("ops/kv_cache_write/template.cu.j2")
    assert after["kv_cache_write"] != before["kv_cache_write"] and after["kda_decode"] == before["kda_decode"]
    before = after
    after = edited("include/k3gen/common/pdl.cuh")
    assert all(after[op] != before[op] for op in before)
    assert digest("act_quant_fp8", "cute") == cute  # CuTe modules include no headers
    before = after
    after = edited("ops/kda_decode/spec.py")  # kda_prefill's spec imports kda_decode's
    assert after["kda_prefill"] != before["kda_prefill"] and after["kv_cache_write"] == before["kv_cache_write"]
    for rel in ("ir/layouts.py", "arch/sm90.py", "numerics.py", "pipeline/render.py"):
        before = after
        after = edited(rel)
        assert after["kv_cache_write"] != before["kv_cache_write"], rel
    before = after
    assert edited("ops/kv_cache_write/launcher.py") == before  # runtime-only files never reach the bytes
    assert edited("ops/kv_cache_write/reference.py") == before
    assert digest("act_quant_fp8", "cute") != cute
    # Templates with a computed include reach the headers their op files name, not whole folders: an edit
    # of the prefill kernel leaves kv_cache_write's and mla_decode's bundle entries valid, and a decode
    # schedule named with a rendered suffix ("k3gen/mla/decode_wg_{...}") still reaches mla_decode.
    ops = ("kv_cache_write", "mla_prefill", "mla_decode")
    was = {op: digest(op) for op in ops}
    edited("include/k3gen/mla/prefill.cuh")
    now = {op: digest(op) for op in ops}
    assert now["mla_prefill"] != was["mla_prefill"]
    assert now["kv_cache_write"] == was["kv_cache_write"] and now["mla_decode"] == was["mla_decode"]
    edited("include/k3gen/mla/decode_wg_qm.cuh")
    assert digest("mla_decode") != now["mla_decode"] and digest("mla_prefill") == now["mla_prefill"]
    before_cute = digest("act_quant_fp8", "cute")
    edited("ops/act_quant_fp8/cute_kernel.py")
    assert digest("act_quant_fp8", "cute") != before_cute


def test_key_ignores_thread_count(monkeypatch):
    s = KvCacheWriteSpec(target=TARGETS["sm90"], kv=KvDtype.BF16)
    k1 = lower(s).key
    monkeypatch.setenv("K3GEN_JOBS", "7")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert lower(s).key == k1


def test_template_change_changes_key(monkeypatch):
    s = KvCacheWriteSpec(target=TARGETS["sm90"], kv=KvDtype.BF16)
    k1 = lower(s).key
    monkeypatch.setattr(I, "spec_inputs_digest", lambda spec: "0" * 64)
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


def test_a_header_edit_rebuilds_only_the_ops_that_include_it(package_copy):
    root, digest = package_copy
    ops = ("attn_res", "moe_experts", "fp8_block_gemm", "mla_decode")
    before = {op: digest(op) for op in ops}

    def edited(rel: str) -> dict:
        p = root / rel
        p.write_text(p.read_text() + "\n// edited\n")
        return {op: digest(op) for op in ops}
    after = edited("include/k3gen/attn_res/mix.cuh")
    assert after["attn_res"] != before["attn_res"]
    assert after["moe_experts"] == before["moe_experts"] and after["fp8_block_gemm"] == before["fp8_block_gemm"]
    assert after["mla_decode"] == before["mla_decode"]
    before = after
    after = edited("include/k3gen/mla/proj.cuh")   # reached from attn_res through mix.cuh
    assert after["attn_res"] != before["attn_res"] and after["moe_experts"] == before["moe_experts"]
    before = after
    after = edited("include/k3gen/moe/fp4.cuh")    # through experts.cuh
    assert after["moe_experts"] != before["moe_experts"] and after["attn_res"] == before["attn_res"]
    before = after
    # A computed include path (variants name "k3gen/mla/decode_wg_{fp8|nvfp4}.cuh"): every header
    # of the folders the op's files name, and the root's forwarding headers.
    after = edited("include/k3gen/mla/decode_wg_nvfp4.cuh")
    assert after["mla_decode"] != before["mla_decode"] and after["fp8_block_gemm"] == before["fp8_block_gemm"]
    before = after
    after = edited("include/k3gen/kda_verify.cuh")
    assert after["mla_decode"] != before["mla_decode"] and after["attn_res"] == before["attn_res"]
