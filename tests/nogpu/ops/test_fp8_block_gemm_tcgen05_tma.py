"""fp8_block_gemm "tcgen05_tma" (sm103/sm107) launch path without a GPU: the CUtensorMaps the runtime
encodes (k3gen.runtime.cute_launch over k3gen.runtime.tma.encode_tma) are the ones CuTe's own host
code would build for the kernel's TMA atoms, they land at the parameter offsets the cubin reads, and
bad tensors raise SpecError before anything is written or encoded.

The expectations are independent of the geometry the build records (cute_parts.tma_geometry reads
the atoms' types): CuTe DSL encodes a descriptor inline in its host wrapper (no driver call), so a
compile of the same kernel with M static leaves the descriptor words as constants in the lowered
host IR, and `decode` reads them back. Its field map was found by compiling one-atom probes that
vary one parameter at a time (dims, row stride, box, swizzle 0/32/64/128, u8 / bf16):

  word 1: bits 8-11 data format (0 = U8), bits 13-14 swizzle (0 none, 1 32B, 2 64B, 3 128B),
          bit 21 set when the tensor spans >= 128 KiB, bits 32-63 the dim-1 byte stride / 16;
  word 4: dim0 - 1 (bits 0-31), dim1 - 1 (bits 32-63);  word 6 bits 56-63: box0 - 1;
  word 7 bits 0-7: box1 - 1;  everything else is constant: word 1's other bits 0x40012, words
  2, 3, 5 zero, the rest of words 6/7 zero (element strides 1 stored as 0).

The constant bits are CuTe's fixed choices (CuTe C++ make_tma_copy_desc: interleave none, L2
promotion 128 B, OOB fill none = zeros, element strides 1); a probe cannot vary them, so they are
pinned: if CuTe changes them this test fails and the launcher's TMA_FIXED must follow. The PTX
confirms rank and box bytes (cp.async.bulk.tensor.2d, expect_tx = the two boxes). What no CPU can
show: that the driver accepts these arguments and the kernel then runs (no Blackwell GPU here).
"""
from __future__ import annotations

import functools
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
from k3gen.targets import TARGETS

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

UE8M0, FP32 = ScaleRecipe.UE8M0, ScaleRecipe.FP32
# (target, recipe, N, K, bm, the static M of the host-IR compile): a K tail, a 128 KiB+ x tensor,
# bm 32 / 64 / 128, both recipes and both Blackwell targets.
CASES = [("sm103-nvfp4", UE8M0, 200, 272, 64, 300), ("sm107-nvfp4", FP32, 2304, 1536, 32, 100),
         ("sm103-nvfp4", UE8M0, 1536, 7168, 128, 40)]
IDS = [f"{c[0]}-{c[1].value}-n{c[2]}-k{c[3]}-bm{c[4]}" for c in CASES]
SWIZZLE = {0: 0, 1: 32, 2: 64, 3: 128}
FIXED_W1 = 0x40012

HELPER = r"""
import sys
import cutlass.cute as cute
from cutlass.runtime import make_fake_stream
from k3gen.ops import spec_from_canonical
from k3gen.targets import get_target
from k3gen.ops.fp8_block_gemm import cute_kernel as mod
spec = spec_from_canonical(sys.argv[1], get_target(sys.argv[2]))
m = int(sys.argv[3])
cute.sym_int32 = lambda symbol=None: m        # the same kernel with M static
fn, args = mod.compile_args(spec)
open(sys.argv[4], "w").write(str(cute.compile(fn, *[a for _, a in args], make_fake_stream()).ir_module))
"""


def _spec(name, recipe, n, k, bm, _m=None):
    return Fp8BlockGemmSpec(target=TARGETS[name], n=n, k=k, recipe=recipe, bm=bm)


@functools.cache
def artifact(case):
    from k3gen.pipeline.cute import compile_cute
    return compile_cute(_spec(*case))


@functools.cache
def cute_descriptors(case) -> tuple[dict, ...]:
    """The 64 meaningful bytes of each descriptor CuTe's host code builds, as 8 words (None where
    not a constant: the address), in atom order."""
    from k3gen.pipeline.cute import REPO_ROOT, worker_env
    spec = _spec(*case)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "dump").mkdir()
        out = Path(d) / "host.mlir"
        subprocess.run([sys.executable, "-c", HELPER, spec.canonical(), spec.target.name, str(case[5]), str(out)],
                       env=worker_env(spec.target.arch, Path(d) / "dump"), cwd=str(REPO_ROOT), check=True,
                       capture_output=True, timeout=600)
        return host_descriptors(out.read_text())


def host_descriptors(ir: str) -> tuple[list, ...]:
    consts = dict(re.findall(r"(%\d+) = llvm\.mlir\.constant\((-?\d+) : i64\)", ir))
    descs = []
    for alloca in re.findall(r"(%\d+) = llvm\.alloca %\d+ x i64 \{alignment = 64 : i64\}", ir):
        geps = dict(re.findall(rf"(%\d+) = llvm\.getelementptr {alloca}\[0, (\d+)\]", ir))
        words = [None] * 8
        for v, ptr in re.findall(r"llvm\.store (%\d+), (%\d+) : i64", ir):
            if ptr in geps:
                words[int(geps[ptr])] = int(consts[v]) % 2 ** 64 if v in consts else None
        descs.append(words)
    return tuple(descs)


def decode(words: list) -> dict:
    """encode_tma's arguments from CuTe's descriptor words (field map: the module docstring)."""
    w1, w4, w6, w7 = words[1], words[4], words[6], words[7]
    low = w1 & 0xFFFFFFFF
    return {"dims": ((w4 & 0xFFFFFFFF) + 1, (w4 >> 32) + 1), "strides": ((w1 >> 32) * 16,),
            "box": ((w6 >> 56) + 1, (w7 & 0xFF) + 1),
            "dtype": {0: "u8"}.get((low >> 8) & 0xF, (low >> 8) & 0xF), "swizzle": SWIZZLE[(low >> 13) & 3],
            # CuTe's fixed fields, compared whole (see the docstring)
            "fixed": (low & ~(0xF << 8 | 3 << 13 | 1 << 21), words[2], words[3], words[5],
                      w6 & (2 ** 56 - 1), w7 >> 8)}


CUTE_FIXED = (FIXED_W1, 0, 0, 0, 0, 0)
# What the launcher must pass for CuTe's fixed fields (cute_parts.TMA_FIXED + unit element strides).
FIXED_OPTS = {"interleave": "none", "l2_promotion": 128, "oob": "zero", "elem_strides": (1, 1)}


class Recorder:
    """Stands in for the driver's encoder: records the arguments, returns a recognizable map."""

    def __init__(self):
        self.calls = []

    def __call__(self, ptr, dims, strides, box, **opts):
        self.calls.append({"ptr": ptr, "dims": dims, "strides": strides, "box": box, **opts})
        return bytes((len(self.calls) * 37 + i) % 251 for i in range(128))


def _kernel(case, monkeypatch):
    from k3gen.runtime import tma
    from k3gen.runtime.cute_launch import CuteKernel
    rec = Recorder()
    monkeypatch.setattr(tma, "encode_tma", rec)
    art = artifact(case)
    return CuteKernel(art.cubin, art.params_json()), rec


def _tensors(spec, m, *, g=None):
    """Host tensors with the kernel's shapes (only data_ptr / shape / stride are read)."""
    sdt = torch.uint8 if spec.recipe is UE8M0 else torch.float32
    return [torch.zeros(m, spec.k, dtype=torch.uint8), torch.zeros(m, spec.k_blocks, dtype=sdt),
            torch.zeros(spec.n, spec.k, dtype=torch.uint8), torch.zeros(spec.n_blocks, spec.k_blocks, dtype=sdt),
            torch.zeros(m, spec.n, dtype=torch.bfloat16)]


def _geometry_matches(abi_kernel, rec, tensors, descs) -> list[str]:
    """Problems comparing the encoder calls of one pack with CuTe's descriptors (W's, x's)."""
    rec.calls.clear()
    abi_kernel.pack(tensors)
    problems = []
    x, w = tensors[0], tensors[2]
    by_ptr = {c["ptr"]: c for c in rec.calls}
    for name, t, words in (("w", w, descs[0]), ("x", x, descs[1])):
        want, got = decode(words), by_ptr.get(t.data_ptr())
        if got is None:
            problems.append(f"{name}: no map encoded")
            continue
        for key in ("dims", "strides", "box", "dtype", "swizzle"):
            g = tuple(got[key]) if isinstance(got[key], (list, tuple)) else got[key]
            if g != want[key]:
                problems.append(f"{name}.{key}: launcher {g}, CuTe {want[key]}")
        if want["fixed"] != CUTE_FIXED:
            problems.append(f"{name}: CuTe's fixed descriptor fields changed: {want['fixed']}")
        for key, v in FIXED_OPTS.items():
            g = tuple(got[key]) if isinstance(got[key], (list, tuple)) else got[key]
            if g != v:
                problems.append(f"{name}.{key}: launcher {g}, CuTe's {v}")
    return problems


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_maps_are_cutes(case, monkeypatch):
    kern, rec = _kernel(case, monkeypatch)
    spec, m = _spec(*case), case[5]
    descs = cute_descriptors(case)
    assert len(descs) == 2, descs
    tensors = _tensors(spec, m)
    kern.check(tensors, device=False)
    assert _geometry_matches(kern, rec, tensors, descs) == []
    assert len(rec.calls) == 2
    # The same geometry spelled out from the spec (innermost K first; a full box even past M or N).
    w, x = decode(descs[0]), decode(descs[1])
    assert (w["dims"], w["strides"], w["box"]) == ((spec.k, spec.n), (spec.k,), (128, 128))
    assert (x["dims"], x["strides"], x["box"]) == ((spec.k, m), (spec.k,), (128, spec.bm))
    assert w["swizzle"] == x["swizzle"] == 128 and w["dtype"] == x["dtype"] == "u8"


@pytest.mark.parametrize("case", CASES[:1], ids=IDS[:1])
@pytest.mark.parametrize("mutation", ["box", "swizzle", "modes", "l2"])
def test_a_wrong_map_is_caught(case, mutation, monkeypatch):
    """The comparison fails for a geometry that differs from CuTe's in any one field."""
    from k3gen.runtime.cute_launch import CuteKernel
    art = artifact(case)
    abi = art.params_json()
    x_map = next(p for p in abi["params"] if p.get("tma", {}).get("role") == "desc" and p["tensor"] == "x_codes")
    t = dict(x_map["tma"])
    if mutation == "box":
        t["box"] = [128, 32]            # e.g. min(bm, M): the kernel's expect_tx counts the full box
    elif mutation == "swizzle":
        t["swizzle"] = 64
    elif mutation == "modes":
        t["modes"] = [0, 1]
    else:
        t["l2_promotion"] = 256
    x_map["tma"] = t
    from k3gen.runtime import tma
    rec = Recorder()
    monkeypatch.setattr(tma, "encode_tma", rec)
    try:
        kern = CuteKernel(art.cubin, abi)
    except SpecError:
        assert mutation in ("modes", "swizzle")   # refused at load: K-major / span rules
        return
    spec = _spec(*case)
    assert _geometry_matches(kern, rec, _tensors(spec, case[5]), cute_descriptors(case)) != []


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_ptx_tensormap_use(case):
    """Rank and box bytes as the kernel's PTX uses the maps: 2-D tiled loads of both operands on one
    barrier whose transaction count is exactly the two boxes."""
    art, spec = artifact(case), _spec(*case)
    loads = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.\S+ \[[^\]]+\], \[%rd\d+, \{([^}]*)\}\]", art.ptx)
    assert [r for r, _ in loads] == ["2", "2"] and all(len(c.split(",")) == 2 for _, c in loads), loads
    boxes = [p["tma"]["box"] for p in art.params_json()["params"] if p.get("tma", {}).get("role") == "desc"]
    tx = sum(b0 * b1 for b0, b1 in boxes)
    assert tx == (128 + spec.bm) * 128
    assert re.search(rf"mov\.b32\s+(%r\d+), {tx};", art.ptx), tx
    assert len(re.findall(r"prefetch\.tensormap", art.ptx)) == 2


@pytest.mark.parametrize("case", CASES[:2], ids=IDS[:2])
def test_param_bytes(case, monkeypatch):
    kern, rec = _kernel(case, monkeypatch)
    spec, m = _spec(*case), 7
    tensors = _tensors(spec, m)
    kern.pack(tensors)
    buf = kern.packed()
    params = {(p["tensor"], p.get("tma", {}).get("role")): p for p in kern.abi["params"]}
    assert len(rec.calls) == 2
    for name, t in (("w_codes", tensors[2]), ("x_codes", tensors[0])):
        p = params[(name, "desc")]
        i = next(j for j, c in enumerate(rec.calls) if c["ptr"] == t.data_ptr())
        want = bytes(((i + 1) * 37 + b) % 251 for b in range(128))
        assert buf[p["offset"]:p["offset"] + 128] == want, name
    (f,) = params[("x_codes", "coord")]["fields"]
    assert struct.unpack_from("<i", buf, f["offset"]) == (m,)
    for i, name in enumerate(["x_codes", "x_scales", "w_codes", "w_scales", "out"]):
        assert struct.unpack_from("<Q", buf, params[(name, None)]["offset"]) == (tensors[i].data_ptr(),)
    # Cached per tensor pointer and shape: a second pack encodes nothing; a new M encodes x only.
    kern.pack(tensors)
    assert len(rec.calls) == 2
    tensors2 = _tensors(spec, 9)
    tensors2[2:4] = tensors[2:4]
    kern.pack(tensors2)
    assert len(rec.calls) == 3 and rec.calls[-1]["ptr"] == tensors2[0].data_ptr()
    assert rec.calls[-1]["dims"] == (spec.k, 9)


def _bad(spec, m):
    ok = _tensors(spec, m)
    cases = {}
    t = list(ok); t[0] = torch.zeros(m * spec.k + 1, dtype=torch.uint8)[1:].view(m, spec.k); cases["x misaligned"] = t
    t = list(ok); t[2] = torch.zeros(spec.k, spec.n, dtype=torch.uint8).t(); cases["w transposed"] = t
    t = list(ok); t[2] = torch.zeros(spec.n, spec.k + 16, dtype=torch.uint8)[:, :spec.k]; cases["w padded rows"] = t
    t = list(ok); t[0] = torch.zeros(m, spec.k + 16, dtype=torch.uint8); cases["x wrong K"] = t
    t = list(ok); t[2] = torch.zeros(spec.n, spec.k, dtype=torch.int8); cases["w int8"] = t
    t = list(ok); t[4] = torch.zeros(m + 1, spec.n, dtype=torch.bfloat16); cases["out wrong M"] = t
    t = list(ok); t[0] = torch.zeros(m, spec.k, dtype=torch.uint8)[None]; cases["x rank 3"] = t
    return cases


@pytest.mark.parametrize("bad", list(_bad(_spec(*CASES[0]), 5)))
def test_bad_tensors_write_nothing(bad, monkeypatch):
    case = CASES[0]
    kern, rec = _kernel(case, monkeypatch)
    spec = _spec(*case)
    kern.pack(_tensors(spec, 5))
    before, calls = kern.packed(), len(rec.calls)
    tensors = _bad(spec, 5)[bad]
    with pytest.raises(SpecError):
        kern.check(tensors, device=False)
        kern.pack(tensors)        # reached only if check() let it through: must still raise
    assert kern.packed() == before and len(rec.calls) == calls


def test_launch_plan_and_cluster(monkeypatch):
    """Fp8BlockGemm launches the tcgen05_tma kernel with the spec's split plan as a cluster."""
    from k3gen.ops.fp8_block_gemm.launcher import Fp8BlockGemm
    case = CASES[2]
    kern, rec = _kernel(case, monkeypatch)
    spec = _spec(*case)
    launches = []

    class FakeFn:
        def function(self, dev):
            return "f"

        def launch_ex(self, grid, block, cluster, args, types, dev, stream, smem=0, pdl=False):
            launches.append((grid, block, cluster, smem, args))

    kern._kernel = FakeFn()
    monkeypatch.setattr(kern, "check", functools.partial(type(kern).check, kern, device=False))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: type("S", (), {"cuda_stream": 0})())
    launcher = Fp8BlockGemm(spec)
    launcher._kernel, launcher.__dict__["sm_count"] = kern, 148
    monkeypatch.setattr(Fp8BlockGemm, "check", lambda self, x, *a: x.shape[0])
    m = 3
    tensors = _tensors(spec, m)
    launcher(*tensors)
    plan = spec.plan(m, 148)
    assert plan.split > 1, plan
    ((grid, block, cluster, smem, args),) = launches
    assert grid == plan.grid == (plan.split, 1, spec.n_blocks) and cluster == (plan.split, 1, 1)
    assert block == kern.block and smem == kern.dynamic_smem and args == kern._argv_addr
    with pytest.raises(SpecError, match="ctas"):
        launcher(*tensors, ctas=4)
    with pytest.raises(SpecError, match="split"):
        launcher(*tensors, split=9)


def test_b300_projection():
    """`k3gen bench --op fp8_block_gemm_b300`: bytes counted by hand at 8 TB/s, the padded MMA work
    at the assumed FP8 peak, the larger wins; one row per (shape, M), nothing measured."""
    from bench.cases.fp8_block_gemm import B300_FP8_FLOPS, b300_gemm_projection, fp8_block_gemm_b300
    spec = Fp8BlockGemmSpec(target=TARGETS["sm103-nvfp4"], n=7168, k=12288)   # o_proj TP1, UE8M0
    assert spec.mma == "tcgen05_tma" and spec.bm == 64
    for m in (1, 128):
        p = b300_gemm_projection(spec, m)
        nbytes = 7168 * 12288 + 56 * 96 + m * (12288 + 96) + m * 7168 * 2
        assert p["bytes"] == nbytes
        assert p["mem_us"] == pytest.approx(nbytes / 8e12 * 1e6)
        flops = 2 * (-(-m // 64) * 64) * 7168 * 12288
        assert p["mma_us"] == pytest.approx(flops / B300_FP8_FLOPS * 1e6)
        assert p["proj_us"] == max(p["mem_us"], p["mma_us"]) and p["bound"] == "memory"
    rows = fp8_block_gemm_b300(quick=True)
    assert len(rows) == 4 * 4 and all("not measured" in r["detail"] for r in rows)
    assert all(r["case"].startswith("tcgen05_tma ") for r in rows)


def test_empty_m_launches_nothing(monkeypatch):
    """M = 0: the checks pass (no map to encode), the launch returns before packing or the driver."""
    kern, rec = _kernel(CASES[0], monkeypatch)
    tensors = _tensors(_spec(*CASES[0]), 0)
    assert kern.check(tensors, device=False) == {"M": 0}
    before = kern.packed()
    monkeypatch.setattr(kern, "check", functools.partial(type(kern).check, kern, device=False))
    kern.launch((1, 0, 2), *tensors)
    assert rec.calls == [] and kern.packed() == before
