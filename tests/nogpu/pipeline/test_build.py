"""The build pipeline end to end on the CPU: compiles for all four targets, resources and SASS,
determinism, the committed generated trees, the frozen original target, JIT-off mode."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3gen.pipeline.build import (GENERATED_ROOT, build_many, build_one, check_generated, generated_files,
                                  write_bundle, write_generated)
from k3gen.runtime.resolve import resolve
from k3gen.pipeline.inspect import KernelResources, cubin_arch
from k3gen.errors import CompileError, MissingKernelError
from k3gen.ir.dtypes import KvDtype
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
from k3gen.targets import TARGETS, build_specs

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "tests" / "golden" / "sm100_mxfp4.json"


@pytest.mark.parametrize("name", list(TARGETS))
def test_generated_tree_is_up_to_date(name):
    t = TARGETS[name]
    assert check_generated(t, build_specs(t)) == []


def test_regenerating_removes_stale_sources_except_on_frozen_targets(tmp_path):
    """A source whose spec no longer resolves to it (say, a new default schedule) is removed by
    `k3gen build`, so the check passes after a rebuild; the frozen target keeps every landed file."""
    for name in ("sm90", "sm100-mxfp4"):
        t = TARGETS[name]
        specs = [s for s in build_specs(t) if s.op == "kv_cache_write"][:2]
        assert specs
        write_generated(t, specs, tmp_path)
        stale = tmp_path / t.module_name / "kv_cache_write__old-spec__00000000.cu"
        stale.write_text("// an old kernel\n")
        changed = write_generated(t, specs, tmp_path)
        if t.frozen:
            assert stale.exists() and changed == [] and check_generated(t, specs, tmp_path) == [f"stale: {stale}"]
        else:
            assert not stale.exists() and changed == [stale.name] and check_generated(t, specs, tmp_path) == []


def test_generation_is_deterministic():
    for t in TARGETS.values():
        assert generated_files(t, build_specs(t)) == generated_files(t, build_specs(t))


def test_frozen_original_target_sources():
    """Each landed sm100-mxfp4 kernel source keeps its bytes; new files may be added."""
    golden = json.loads(GOLDEN.read_text())
    assert golden, "the golden list of frozen sources is empty"
    d = GENERATED_ROOT / "sm100_mxfp4"
    for name, digest in golden.items():
        assert hashlib.sha256((d / name).read_bytes()).hexdigest() == digest, f"frozen {name} changed"
    now = {n for n in generated_files(TARGETS["sm100-mxfp4"], build_specs(TARGETS["sm100-mxfp4"]))
           if n.endswith(".cu")}
    assert set(golden) <= now, "a frozen kernel is no longer generated"
    assert now <= set(golden), "new sm100 sources: add them with `python -m k3gen.pipeline.golden --add`"


def test_frozen_original_target_sass():
    """The frozen sources include shared headers (the original verify kernel: kda/verify.cuh and
    kda/common.cuh, which the NVFP4 verify kernels share), so source bytes alone do not prove the
    kernels unchanged: each must still compile to the SASS recorded for this NVRTC."""
    from k3gen.pipeline.golden import GOLDEN_SASS, current_sass, nvrtc_key
    recorded = json.loads(GOLDEN_SASS.read_text()).get(nvrtc_key())
    assert recorded, f"no SASS record for {nvrtc_key()}: check the frozen sources, then `python -m k3gen.pipeline.golden --add`"
    assert set(recorded) == set(json.loads(GOLDEN.read_text())), "SASS and source records cover the same files"
    now = current_sass()
    moved = sorted(n for n, h in recorded.items() if now.get(n) != h)
    assert not moved, f"frozen kernels compile differently: {moved}"
    assert any(n.startswith("kda_verify__") and "-orig__" in n for n in recorded), "original verify kernel frozen"


@pytest.mark.parametrize("name", list(TARGETS))
def test_compile_resources_and_sass(name):
    t = TARGETS[name]
    results = build_many(build_specs(t), jobs=2)
    for r in results:
        assert cubin_arch(r.cubin) == t.arch
        for res in (KernelResources(**x) for x in r.resources):
            assert not res.spills, f"{r.artifact.spec.kernel_name}: {res.local} B local memory"
            assert res.registers <= 255  # no spills is the bar; each kernel's launch bounds cap it
            spec = r.artifact.spec
            if getattr(spec, "kv", None) is KvDtype.NVFP4:
                # SM100-family converts to E2M1 in hardware; Hopper has no such instruction.
                assert ("F2FP" in res.sass) == t.fp4_cvt or not t.fp4_cvt
                if t.fp4_cvt:
                    assert res.sass.get("F2FP", 0) > 0


def test_second_build_recompiles_nothing_and_bytes_match(tmp_path, monkeypatch):
    t = TARGETS["sm90"]
    specs = build_specs(t, KvDtype.FP8)
    first = build_many(specs, jobs=1)
    second = build_many(specs, jobs=1)
    assert not any(r.built for r in second)
    assert [r.cubin for r in first] == [r.cubin for r in second]
    # A fresh cache rebuilds the same bytes.
    monkeypatch.setenv("K3GEN_CACHE_DIR", str(tmp_path / "fresh"))
    third = build_many(specs, jobs=1)
    assert all(r.built for r in third) and [r.cubin for r in third] == [r.cubin for r in first]


def test_disable_jit_raises_missing_kernel(tmp_path, monkeypatch):
    spec = KvCacheWriteSpec(target=TARGETS["sm90"], kv=KvDtype.BF16)
    monkeypatch.setenv("K3GEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("K3GEN_DISABLE_JIT", "1")
    with pytest.raises(MissingKernelError, match=spec.kernel_name):
        resolve(spec)
    # A prebuilt bundle satisfies it without compiling.
    monkeypatch.setenv("K3GEN_DISABLE_JIT", "0")
    r = build_one(spec)
    bundle = tmp_path / "bundle"
    write_bundle(bundle, spec.target, [r])
    monkeypatch.setenv("K3GEN_CACHE_DIR", str(tmp_path / "empty2"))
    monkeypatch.setenv("K3GEN_DISABLE_JIT", "1")
    monkeypatch.setenv("K3GEN_PREBUILT", str(bundle))
    cubin, meta = resolve(spec)
    assert cubin == r.cubin and meta["entry"] == spec.entry


def test_compile_error_carries_log_options_and_repro(tmp_path):
    from k3gen.pipeline.nvrtc import compile_cubin
    with pytest.raises(CompileError) as e:
        compile_cubin('extern "C" __global__ void k() { undefined_thing(); }', "broken", TARGETS["sm90"],
                      source_dir=tmp_path)
    err = e.value
    assert "undefined_thing" in err.log and "--gpu-architecture=sm_90a" in err.options
    assert Path(err.source_path).exists() and "k3gen.pipeline.nvrtc" in err.repro
    # The repro command reproduces the failure.
    proc = subprocess.run(err.repro, shell=True, capture_output=True, text=True)
    assert proc.returncode == 1 and "undefined_thing" in proc.stderr


def test_cli_build_warm_compiles_nothing_and_writes_bundle(tmp_path):
    """The second build takes every cubin from the cache (its time: `python -m bench --op build`)."""
    env = {**os.environ, "K3GEN_CACHE_DIR": os.environ["K3GEN_CACHE_DIR"]}
    cmd = [sys.executable, "-m", "k3gen", "build", "--arch", "sm103", "--kv", "nvfp4", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    p = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    assert "0 compiled" in p.stdout, p.stdout
    idx = json.loads((tmp_path / "sm103_nvfp4" / "bundle.json").read_text())
    assert idx and all(v["arch"] == "sm_103a" for v in idx.values())


def _build_in_process(canonical: str, barrier) -> tuple[bool, str]:
    from k3gen.targets import get_target
    from k3gen.ops import spec_from_canonical
    spec = spec_from_canonical(canonical, get_target("sm90"))
    barrier.wait()
    r = build_one(spec)
    return r.built, hashlib.sha256(r.cubin).hexdigest()


def test_eight_processes_build_one_real_kernel_once(tmp_path, monkeypatch):
    """Eight processes JIT the same real kernel at once: NVRTC runs once, all get the same bytes."""
    import multiprocessing as mp
    monkeypatch.setenv("K3GEN_CACHE_DIR", str(tmp_path / "c"))
    spec = KvCacheWriteSpec(target=TARGETS["sm90"], kv=KvDtype.NVFP4, max_drafts=5)
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        barrier = m.Barrier(8)
        with ctx.Pool(8) as pool:
            out = pool.starmap(_build_in_process, [(spec.canonical(), barrier)] * 8)
    assert sum(built for built, _ in out) == 1
    assert len({h for _, h in out}) == 1


def test_cold_build_of_one_target_compiles_every_kernel(tmp_path):
    """From an empty cache every kernel goes through the compiler (its time: `python -m bench --op build`)."""
    env = {**os.environ, "K3GEN_CACHE_DIR": str(tmp_path / "cold")}
    p = subprocess.run([sys.executable, "-m", "k3gen", "build", "--arch", "sm103", "-j", "2"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert "0 from cache" in p.stdout


def test_generated_module_imports_without_a_gpu():
    """model/ imports the typed launchers; importing must not load cubins or touch the driver."""
    import importlib
    mod = importlib.import_module("generated.sm90.kernels")
    k = mod.kv_cache_write_nvfp4_p128_linear_m3
    assert k.spec.max_drafts == 3 and k._kernel is None
    assert set(mod.__all__) == {s.kernel_name for s in build_specs(TARGETS["sm90"])}
