"""Pipeline stages as data (one dump loop: spec, source, PTX, cubin, SASS) and runtime.resolve, which
finds a cubin in a bundle or the cache without rendering a template."""
import json

import jinja2
import pytest

from k3gen.errors import MissingKernelError
from k3gen.ir.dtypes import KvDtype
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
from k3gen.pipeline.bundle import INDEX, read_manifest, write_bundle
from k3gen.pipeline.stages import STAGES, build_one
from k3gen.runtime.resolve import resolve
from k3gen.targets import TARGETS

SPEC = KvCacheWriteSpec(target=TARGETS["sm90"], kv=KvDtype.BF16)


def forbid_rendering(monkeypatch):
    """From here on, any Jinja2 rendering (or CuTe source read) fails the test."""
    import k3gen.pipeline.cute as C

    def boom(*a, **k):
        pytest.fail("a template was rendered")
    monkeypatch.setattr(jinja2.Template, "render", boom)
    monkeypatch.setattr(jinja2.Environment, "get_template", boom)
    monkeypatch.setattr(C, "cute_source", boom)


def test_stages_are_data_with_every_product():
    assert [s.name for s in STAGES] == ["lower", "compile", "inspect"]
    assert [p.what for s in STAGES for p in s.products] == ["spec", "source", "ptx", "cubin", "sass"]


def test_dump_writes_spec_source_ptx_cubin_and_sass(tmp_path, monkeypatch):
    d = tmp_path / "dump"
    monkeypatch.setenv("K3GEN_DUMP", str(d))
    monkeypatch.setenv("K3GEN_CACHE_DIR", str(tmp_path / "fresh"))
    r = build_one(SPEC)
    stem = SPEC.file_stem
    assert r.built
    assert json.loads((d / f"{stem}.spec.json").read_text()) == json.loads(SPEC.canonical())
    assert (d / f"{stem}.cu").read_text() == r.artifact.source
    assert ".entry k3gen_kv_cache_write" in (d / f"{stem}.ptx").read_text()
    assert (d / f"{stem}.cubin").read_bytes() == r.cubin
    assert "code for sm_90a" in (d / f"{stem}.sass").read_text()
    # A cache hit runs no compile, yet the dump still gets the cubin and its SASS.
    for p in d.iterdir():
        p.unlink()
    r2 = build_one(SPEC)
    assert not r2.built and (d / f"{stem}.cubin").read_bytes() == r.cubin and (d / f"{stem}.sass").exists()


def test_resolve_from_a_bundle_renders_nothing(tmp_path, monkeypatch):
    r = build_one(SPEC)
    write_bundle(tmp_path / "bundle", SPEC.target, [r])
    assert read_manifest(tmp_path / "bundle", SPEC.target.module_name)[SPEC.file_stem]["entry"] == SPEC.entry
    forbid_rendering(monkeypatch)
    monkeypatch.setenv("K3GEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("K3GEN_DISABLE_JIT", "1")
    monkeypatch.setenv("K3GEN_PREBUILT", str(tmp_path / "bundle"))
    cubin, meta = resolve(SPEC)
    assert cubin == r.cubin and meta["entry"] == SPEC.entry and meta["spec"] == SPEC.canonical()


def test_resolve_from_the_cache_renders_nothing(tmp_path, monkeypatch):
    r = build_one(SPEC)
    forbid_rendering(monkeypatch)
    monkeypatch.setenv("K3GEN_DISABLE_JIT", "1")
    cubin, meta = resolve(SPEC)
    assert cubin == r.cubin and meta["key"] == r.artifact.key


def test_a_stale_bundle_entry_is_not_used(tmp_path, monkeypatch):
    """A bundle built from other inputs (an edited template or header) or for another spec with the
    same file stem is passed over; with JIT off that names the missing kernel."""
    r = build_one(SPEC)
    b = tmp_path / "bundle"
    d = write_bundle(b, SPEC.target, [r])
    monkeypatch.setenv("K3GEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("K3GEN_DISABLE_JIT", "1")
    monkeypatch.setenv("K3GEN_PREBUILT", str(b))
    assert resolve(SPEC)[0] == r.cubin
    index = json.loads((d / INDEX).read_text())
    for field, value in (("inputs_sha256", "0" * 64), ("spec", "{}")):
        stale = {k: {**v, field: value} for k, v in index.items()}
        (d / INDEX).write_text(json.dumps(stale, indent=1, sort_keys=True) + "\n")
        with pytest.raises(MissingKernelError, match=SPEC.kernel_name):
            resolve(SPEC)
