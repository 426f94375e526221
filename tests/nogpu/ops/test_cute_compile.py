"""CuTe DSL path without a GPU: act_quant_fp8 cubins for all four targets, their launch ABI, the
reference's rounding, and the param packer. Never touches the CUDA driver: compiles run in
subprocesses that load no libcuda (checked), and nothing here creates CUDA tensors."""
from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from k3gen.pipeline import cute as cc
from k3gen.pipeline.toolchain import tool
from k3gen.errors import CompileError, SpecError
from k3gen.ir import evaluate
from k3gen.ops import registry, spec_from_canonical
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec
from k3gen.ir.target import Target
from k3gen.targets import TARGETS

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

ARCHS = {"sm90": "sm_90a", "sm100-mxfp4": "sm_100a", "sm103-nvfp4": "sm_103a", "sm107-nvfp4": "sm_107a"}
K = 1536


def _cuobjdump(*args) -> str:
    exe = tool("cuobjdump")
    if exe is None:
        pytest.skip("cuobjdump not found")
    return subprocess.run([exe, *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One compile per target (default recipe of the target), in parallel subprocesses."""
    root = tmp_path_factory.mktemp("cute")

    def one(name):
        spec = ActQuantFp8Spec(target=TARGETS[name], k=K)
        t0 = time.perf_counter()
        art = cc.compile_cute(spec, workdir=root / name)
        return name, spec, art, time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=len(ARCHS)) as ex:
        out = {name: (spec, art, secs) for name, spec, art, secs in ex.map(one, ARCHS)}
    for name, (_, art, secs) in out.items():
        print(f"compile act_quant_fp8 k={K} {ARCHS[name]}: {secs:.2f}s (worker {art.compile_seconds:.2f}s)")
    return out, root


@pytest.mark.parametrize("name", list(ARCHS))
def test_cubin_is_for_the_target_arch(built, name):
    out, root = built
    spec, art, secs = out[name]
    assert art.arch == ARCHS[name]
    path = root / name / "kernel.cubin"
    assert path.read_bytes() == art.cubin
    header = _cuobjdump("-elf", str(path))
    m = re.search(r"64-bit ELF: type=ET_EXEC, ABI=\d+, sm=(\w+),", header)
    assert m and f"sm_{m.group(1)}" == ARCHS[name], header[:300]
    assert f"-arch {ARCHS[name]}" in header  # ptxas' command line in .note.nv.tkinfo


@pytest.mark.parametrize("name", list(ARCHS))
def test_no_spills_and_expected_sass(built, name):
    out, root = built
    path = str(root / name / "kernel.cubin")
    res = _cuobjdump("-res-usage", path)
    m = re.search(r"Function k3gen_act_quant_fp8_0:\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    assert m, res
    regs, stack, shared, local = map(int, m.groups())
    assert local == 0 and stack == 0 and shared == 0, res
    assert regs <= 64
    sass = _cuobjdump("-sass", path)
    assert "F2FP.SATFINITE.E4M3.F32.PACK_AB" in sass        # cvt.rn.satfinite.e4m3x2.f32
    assert "LDG.E.128" in sass and "STG.E.64" in sass        # one 16 B load, one 8 B store per thread
    assert sass.count("SHFL.BFLY") == 4                      # 16-lane amax
    assert "BAR.SYNC" not in sass                            # no shared memory, no barrier


def test_no_driver_and_no_dsl_cache(built):
    out, root = built
    for name in ARCHS:
        result = json.loads((root / name / "result.json").read_text())
        assert result["driver_loaded"] is False
        assert result["kernels"] == ["k3gen_act_quant_fp8_0"]
        assert (root / name / "repro.sh").read_text().startswith("mkdir -p ")


def test_launch_abi(built):
    out, _ = built
    for name in ARCHS:
        spec, art, _ = out[name]
        abi = art.params_json()
        assert abi["entry"] == art.entry == "k3gen_act_quant_fp8_0"
        assert abi["block"] == [128, 1, 1] and abi["dynamic_smem"] == 0
        assert abi["param_bytes"] == 48
        scale_dtype = "fp32" if spec.recipe is ScaleRecipe.FP32 else "u8"
        want = [("x", "bf16", 16, [None, K], [K, 1]), ("codes", "e4m3", 16, [None, K], [K, 1]),
                ("scales", scale_dtype, 4 if scale_dtype == "fp32" else 1, [None, K // 128], [K // 128, 1])]
        for i, (p, (tensor, dtype, align, shape, stride)) in enumerate(zip(abi["params"], want)):
            assert (p["ordinal"], p["offset"], p["size"], p["tensor"], p["dtype"], p["align"]) == \
                (i, 16 * i, 16, tensor, dtype, align)
            assert p["shape"] == ["M", shape[1]] and p["stride"] == stride
            assert [(f["offset"], f["size"], f["kind"], f["symbol"]) for f in p["fields"]] == \
                [(16 * i, 8, "ptr", None), (16 * i + 8, 4, "shape", "M")]
        # What the compile checked, done again here: cubin KPARAM_INFO and PTX loads agree.
        info = cc.parse_cubin(art.cubin).kernels[art.entry]
        assert info.kparams == {0: (0, 16), 1: (16, 16), 2: (32, 16)}
        assert info.param_bytes == 48 and info.reqntid == (128, 1, 1)
        assert cc.check_ptx_params(art.ptx, art.entry, list(art.params)) == []


def test_ptx_check_catches_a_wrong_layout(built):
    out, _ = built
    _, art, _ = out["sm90"]
    tensors = [{"name": n, "dtype": "BFloat16", "align": 16, "shape": ["M", K], "stride": [K, 1],
                "dyn_shape": [{"mode": 0, "width": 64, "symbol": "M"}], "dyn_stride": []}
               for n in ("x", "codes", "scales")]
    wrong = cc.layout_params(tensors)  # a 64-bit M: M would sit at +8 as 8 bytes
    assert cc.check_ptx_params(art.ptx, art.entry, wrong)


def test_launch_abi_comes_only_from_meta_params(built):
    """The build metadata (cache entry or `k3gen build --out` bundle) carries the ABI under
    "params"; nothing else is read as an ABI."""
    from k3gen.runtime.cute_launch import load_cute_kernel
    _, art, _ = built[0]["sm90"]
    with pytest.raises(SpecError, match="meta.params"):
        load_cute_kernel(art.cubin, art.params_json())
    kern = load_cute_kernel(art.cubin, {"params": art.params_json()})   # lazy: no driver call yet
    assert kern.entry == art.entry and kern.names == ["x", "codes", "scales"]


def test_compile_error_carries_a_repro(tmp_path):
    bogus = Target(name="bogus", arch="sm_90a", sm=90, mma="wgmma", fp4_cvt=False, kv_dtypes=(),
                   ssm_dtypes=(), nvfp4_scale_layout=TARGETS["sm90"].nvfp4_scale_layout,
                   scale_recipe=ScaleRecipe.FP32)
    spec = ActQuantFp8Spec(target=bogus, k=128)
    with pytest.raises(CompileError) as e:
        cc.compile_cute(spec, workdir=tmp_path)
    assert "repro: mkdir -p" in str(e.value) and "CUTE_DSL_ARCH=sm_90a" in e.value.repro
    assert "bogus" in e.value.log


# -- the ABI derivation on a kernel with dynamic strides and 64-bit dims -------------------------
PROBE = '''
import cuda.bindings.driver as cuda_drv
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor


@cute.kernel
def probe(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, d: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    # Read every dynamic field, so the PTX has a load for each.
    if tidx < a.shape[0] * a.shape[1]:
        a[0, 0] = cutlass.Float32(a.stride[0] + a.shape[1])
    if tidx < b.shape[0]:
        b[0, 0] = cutlass.Float16(b.stride[1] + b.stride[0])
    if tidx < c.shape[2]:
        c[0, 0, 0] = cutlass.Int8(c.shape[0])
    if tidx < d.shape[0]:
        d[0, 0] = cutlass.Int32(d.stride[0])


@cute.jit
def host(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, d: cute.Tensor, stream: cuda_drv.CUstream):
    probe(a, b, c, d).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


def args():
    m, n = cute.sym_int32(symbol="M"), cute.sym_int32(symbol="N")
    a = make_fake_tensor(cutlass.Float32, (m, n), (cute.sym_int64(symbol="LD"), 1), assumed_align=16)
    b = make_fake_tensor(cutlass.Float16, (cute.sym_int64(symbol="P"), 8),
                         (cute.sym_int64(symbol="S0"), cute.sym_int64(symbol="S1")))
    c = make_fake_tensor(cutlass.Int8, (cute.sym_int32(symbol="Q"), 5, cute.sym_int32(symbol="R")), (1, 7, 64))
    d = make_fake_tensor(cutlass.Int32, (cute.sym_int32(symbol="W"), 3), (cute.sym_int32(symbol="LD32"), 1))
    return host, [("a", a), ("b", b), ("c", c), ("d", d)]
'''

RUN = '''
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import cutlass.cute as cute
from cutlass.runtime import make_fake_stream
import probe_kernel
from k3gen.pipeline.cute import describe_tensors
fn, args = probe_kernel.args()
c = cute.compile(fn, *[a for _, a in args], make_fake_stream())
out = Path(sys.argv[1])
out.joinpath("probe.cubin").write_bytes(c.artifacts.CUBIN)
out.joinpath("probe.ptx").write_text(c.artifacts.PTX)
out.joinpath("tensors.json").write_text(json.dumps(describe_tensors(args)))
'''


def test_struct_layout_of_dynamic_strides_and_wide_dims(tmp_path):
    (tmp_path / "probe_kernel.py").write_text(PROBE)
    (tmp_path / "run.py").write_text(RUN)
    dump = tmp_path / "dump"
    dump.mkdir()
    proc = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path)],
                          env=cc.worker_env("sm_90a", dump), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cubin = (tmp_path / "probe.cubin").read_bytes()
    ptx = (tmp_path / "probe.ptx").read_text()
    params = cc.layout_params(json.loads((tmp_path / "tensors.json").read_text()))
    # a: ptr, M i32, N i32, LD i64 | b: ptr, P i64, S0 i64, S1 i64 | c: ptr, Q, R | d: ptr, W, LD32 (i32)
    assert [(p.offset, p.size) for p in params] == [(0, 24), (24, 32), (56, 16), (72, 16)]
    assert [(f.offset, f.size, f.kind, f.symbol) for f in params[0].fields] == \
        [(0, 8, "ptr", None), (8, 4, "shape", "M"), (12, 4, "shape", "N"), (16, 8, "stride", "LD")]
    assert [(f.offset, f.size) for f in params[3].fields] == [(72, 8), (80, 4), (84, 4)]
    info = cc.parse_cubin(cubin)
    (entry, k), = info.kernels.items()
    assert k.kparams == {p.ordinal: (p.offset, p.size) for p in params}
    assert k.param_bytes == 88
    assert cc.check_ptx_params(ptx, entry, params) == []
    # The PTX check is only as strong as the loads it saw: the probe reads every field.
    read = set()
    for vec, bits, i, off in re.findall(r"ld\.param(?:\.v(\d))?\.[bsuf](\d+)[^\[]*\[\w+?_param_(\d+)(?:\+(\d+))?\]", ptx):
        start = params[int(i)].offset + int(off or 0)
        read.update(range(start, start + int(vec or 1) * int(bits) // 8))
    for p in params:
        for f in p.fields:
            assert set(range(f.offset, f.offset + f.size)) <= read, (p.tensor, f)


# -- spec -----------------------------------------------------------------------------------------
def test_spec_validation_and_identity():
    t = TARGETS["sm90"]
    for bad in (0, 100, 129, -128, 1.5, True):
        with pytest.raises(SpecError, match="k="):
            ActQuantFp8Spec(target=t, k=bad)
    with pytest.raises(SpecError, match="threads=96"):
        ActQuantFp8Spec(target=t, k=128, threads=96)
    with pytest.raises(SpecError, match="recipe="):
        ActQuantFp8Spec(target=t, k=128, recipe="fp32")
    assert ActQuantFp8Spec(target=t, k=128).recipe is ScaleRecipe.FP32          # Hopper: FP32
    s103 = ActQuantFp8Spec(target=TARGETS["sm103-nvfp4"], k=7168)
    assert s103.recipe is ScaleRecipe.UE8M0                                        # SM100 family
    assert s103.slug() == "k7168-ue8m0" and s103.lowering == "cute"
    assert spec_from_canonical(s103.canonical(), s103.target) == s103
    assert registry()["act_quant_fp8"] is ActQuantFp8Spec
    s = ActQuantFp8Spec(target=t, k=7168, threads=256)
    assert s.slug() == "k7168-fp32-t256" and s.grid(1) == (4, 1, 1) and s.grid(0) == (0, 1, 1)
    assert ActQuantFp8Spec(target=t, k=128).grid(33) == (5, 1, 1)
    assert evaluate(s.bytes_moved(), M=2) == 2 * 7168 * 3 + 2 * 56 * 4
    assert evaluate(s103.bytes_moved(), M=2) == 2 * 7168 * 3 + 2 * 56


def test_cute_source_names_the_spec():
    s = ActQuantFp8Spec(target=TARGETS["sm107-nvfp4"], k=128)
    src = cc.cute_source(s)
    assert s.canonical() in src and "class ActQuantFp8Kernel" in src
    assert cc.cute_flags(s) == ["CUTE_DSL_ARCH=sm_107a"]
    assert src != cc.cute_source(ActQuantFp8Spec(target=TARGETS["sm90"], k=128))


# -- reference --------------------------------------------------------------------------------------
def _e4m3_probe_values() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    fin = codes[torch.isfinite(codes)].unique()
    mids = ((fin[:-1].double() + fin[1:].double()) / 2).float()   # exact ties
    up = torch.nextafter(mids, torch.full_like(mids, 1e9))
    down = torch.nextafter(mids, torch.full_like(mids, -1e9))
    g = torch.Generator().manual_seed(1)
    extra = torch.tensor([448.0, 449.0, 463.99, 464.0, 464.01, 480.0, 1e30, -1e30, 0.0, -0.0,
                          2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -10, 2.0 ** -11, 1e-40])
    return torch.cat([fin, mids, up, down, torch.randn(200_000, generator=g) * 50,
                      torch.randn(20_000, generator=g) * 1e-3, extra])


def test_reference_e4m3_is_rne_satfinite():
    import ml_dtypes
    import numpy as np

    from k3gen import numerics as quant
    from k3gen.ops.act_quant_fp8.reference import e4m3_rn_satfinite
    q = _e4m3_probe_values()
    ours = e4m3_rn_satfinite(q)
    ml = torch.from_numpy(np.clip(q.numpy(), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert torch.equal(ours, ml)                    # torch's conversion rounds to nearest even
    assert torch.equal(ours, quant.e4m3_encode(q))  # and matches k3gen's bit-level encoder


@pytest.mark.parametrize("recipe", list(ScaleRecipe))
def test_reference_matches_the_shared_quantizer(recipe):
    from k3gen import numerics as quant
    from k3gen.ops.act_quant_fp8.reference import act_quant_fp8, dequantize
    g = torch.Generator().manual_seed(2)
    mag = torch.logspace(-38, 37, 40).unsqueeze(1)
    x = (torch.randn(40, 1024, generator=g) * mag).bfloat16()
    x[3] = 0.0
    x[4, :128] = -0.0
    x[5, 128:256] = 0.0
    x[5, 130] = 1e-40                     # a subnormal-only group
    x[6, :128] = torch.tensor(3.0e38).bfloat16()
    codes, scales = act_quant_fp8(x, recipe)
    want_c, want_s = quant.fp8_group_quantize(x, recipe=recipe)
    assert torch.equal(codes, want_c)
    assert torch.equal(scales.view(torch.uint8), want_s.view(torch.uint8))
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scales.dtype == (torch.float32 if recipe is ScaleRecipe.FP32 else torch.uint8)
    assert torch.all(codes[3] == 0)
    if recipe is ScaleRecipe.FP32:
        assert scales[3, 0] == 0 and scales[4, 0] == 0 and torch.all(codes[4, :128] == 0)
    else:
        assert torch.all(scales[3] == 0)                     # 2^-127: finite
        assert torch.all(codes[4, :128] == 0x80)             # -0 / s keeps its sign: E4M3 -0
    rel = (dequantize(codes, scales, recipe) - x.float()).abs() / x.float().abs().amax(-1, keepdim=True).clamp_min(1e-38)
    assert rel[torch.isfinite(rel)].max() < 2 ** -3


# -- the packer, on CPU tensors (data_ptr/shape/stride only; no CUDA) ---------------------------------
def test_param_packer_layout(built):
    from k3gen.runtime.cute_launch import CuteKernel
    out, _ = built
    _, art, _ = out["sm90"]
    kern = CuteKernel(art.cubin, art.params_json())
    x = torch.zeros(7, K, dtype=torch.bfloat16)
    q = torch.zeros(7, K, dtype=torch.uint8)
    s = torch.zeros(7, K // 128, dtype=torch.float32)
    kern.pack((x, q, s))
    buf = kern.packed()
    assert len(buf) == 48
    assert struct.unpack_from("<QiI", buf, 0) == (x.data_ptr(), 7, 0)
    assert struct.unpack_from("<QiI", buf, 16) == (q.data_ptr(), 7, 0)
    assert struct.unpack_from("<QiI", buf, 32) == (s.data_ptr(), 7, 0)
    with pytest.raises(SpecError, match="CUDA"):
        kern.check((x, q, s))
