"""act_quant_fp8 on the GPU: the sm_90a CuTe DSL cubin, loaded with cuModuleLoadData and launched
with cuLaunchKernel (k3gen.runtime.cute_launch), against the FP32 reference, bit for bit.

The H200 machine has no CuTe DSL, so the cubins come prebuilt: `k3gen build --arch sm90 --out
build-out` on the CPU machine, then K3GEN_PREBUILT=build-out there (tools/h200.sh does this).
"""
from __future__ import annotations

import functools
import struct

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec
from k3gen.ops.act_quant_fp8.reference import act_quant_fp8
from k3gen.runtime.cute_launch import CuteKernel
from k3gen.ops.act_quant_fp8.launcher import ActQuantFp8
from k3gen.targets import TARGETS

pytestmark = pytest.mark.gpu

MS = (1, 2, 7, 33, 128)
KS = (128, 1536, 7168)  # 128 is listed in tests/gpu/specs.py; the others are K3 shapes
RECIPES = (ScaleRecipe.FP32, ScaleRecipe.UE8M0)
POISON = 0xA5


@functools.lru_cache(maxsize=None)
def _kernel(k: int, recipe: ScaleRecipe) -> tuple[ActQuantFp8Spec, CuteKernel]:
    """Through the runtime: the prebuilt bundle of `k3gen build --arch sm90 --out DIR`
    (K3GEN_PREBUILT), the cache, or a compile where CuTe DSL is installed."""
    spec = ActQuantFp8Spec(target=TARGETS["sm90"], k=k, recipe=recipe)
    op = ActQuantFp8(spec).load()
    assert op.meta["arch"] == "sm_90a"
    return spec, op.kernel


def _inputs(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Rows of very different magnitude, plus groups that exercise the edge cases.
    mag = torch.logspace(-6, 6, m, device="cuda").unsqueeze(1)
    x = (torch.randn(m, k, device="cuda", generator=g) * mag).to(torch.bfloat16)
    x[0, :128] = 0.0                                          # all-zero group
    if m > 1:
        x[1, -128:] = -0.0                                    # all-negative-zero group
    if m > 2:
        x[2, 5] = torch.tensor(3.0e38, dtype=torch.bfloat16)  # one huge value
    if m > 3:
        x[3, :128] = 1e-39                                    # BF16 subnormals only
    return x


def _run(kern: CuteKernel, spec: ActQuantFp8Spec, x: torch.Tensor):
    m = x.shape[0]
    codes = torch.full((m, spec.k), POISON, dtype=torch.uint8, device="cuda")
    if spec.recipe is ScaleRecipe.FP32:
        scales = torch.full((m, spec.groups), float("nan"), dtype=torch.float32, device="cuda")
    else:
        scales = torch.full((m, spec.groups), POISON, dtype=torch.uint8, device="cuda")
    kern.launch(spec.grid(m), x, codes, scales)
    return codes, scales


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    g = got.cpu().contiguous().view(torch.uint8)
    w = want.cpu().contiguous().view(torch.uint8)
    return torch.equal(g, w)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("m", MS)
def test_matches_reference_bitwise(m, k, recipe):
    spec, kern = _kernel(k, recipe)
    x = _inputs(m, k, seed=1000 * m + k)
    codes, scales = _run(kern, spec, x)
    torch.cuda.synchronize()
    want_c, want_s = act_quant_fp8(x.cpu(), recipe)
    assert _same(scales, want_s), f"scales differ at {(scales.cpu().view(torch.uint8) != want_s.view(torch.uint8)).nonzero()[:8].tolist()}"
    diff = (codes.cpu() != want_c).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} codes differ, first at {diff[:8].tolist()}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_graph_replay_equals_eager(recipe):
    spec, kern = _kernel(1536, recipe)
    m = 33
    x = _inputs(m, spec.k, seed=7)
    codes, scales = _run(kern, spec, x)
    eager = (codes.clone(), scales.clone())
    codes.fill_(POISON)
    scales.view(torch.uint8).fill_(POISON)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        kern.launch(spec.grid(m), x, codes, scales)  # warm-up outside capture
        torch.cuda.synchronize()
        codes.fill_(POISON)
        scales.view(torch.uint8).fill_(POISON)
        with torch.cuda.graph(graph, stream=stream):
            kern.launch(spec.grid(m), x, codes, scales)
    torch.cuda.current_stream().wait_stream(stream)
    codes.fill_(POISON)
    scales.view(torch.uint8).fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    assert _same(codes, eager[0]) and _same(scales, eager[1])
    # New inputs in the same buffers: the replay follows them.
    x.copy_(_inputs(m, spec.k, seed=8))
    graph.replay()
    torch.cuda.synchronize()
    want_c, want_s = act_quant_fp8(x.cpu(), recipe)
    assert _same(codes, want_c) and _same(scales, want_s)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_nan_reaches_the_scale(recipe):
    spec, kern = _kernel(128, recipe)
    x = _inputs(4, 128, seed=3)
    x[2, 77] = float("nan")
    codes, scales = _run(kern, spec, x)
    torch.cuda.synchronize()
    s = scales.cpu()
    if recipe is ScaleRecipe.FP32:
        assert torch.isnan(s[2, 0]) and not torch.isnan(s[[0, 1, 3], 0]).any()
    else:
        assert s[2, 0] == 255 and (s[[0, 1, 3], 0] != 255).all()
    assert ((codes[2].cpu() & 0x7F) == 0x7F).all()  # every code of the group is an E4M3 NaN


def test_param_buffer_and_input_checks():
    spec, kern = _kernel(1536, ScaleRecipe.FP32)
    x = torch.randn(7, 1536, device="cuda").to(torch.bfloat16)
    codes, scales = _run(kern, spec, x)
    buf = kern.packed()
    assert struct.unpack_from("<Qi", buf, 0) == (x.data_ptr(), 7)
    assert struct.unpack_from("<Qi", buf, 16) == (codes.data_ptr(), 7)
    assert struct.unpack_from("<Qi", buf, 32) == (scales.data_ptr(), 7)
    with pytest.raises(SpecError, match="x.dtype"):
        kern.launch(spec.grid(7), x.float(), codes, scales)
    with pytest.raises(SpecError, match="shape"):
        kern.launch(spec.grid(7), x[:, :1408], codes, scales)
    with pytest.raises(SpecError, match="dim M"):
        kern.launch(spec.grid(7), x, codes[:6], scales)
    wide = torch.zeros(7, 1536 + 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(SpecError, match="x.stride"):
        kern.launch(spec.grid(7), wide[:, :1536], codes, scales)
    misaligned = wide.view(-1)[4:4 + 7 * 1536].view(7, 1536)   # 8 bytes past a 16-byte boundary
    with pytest.raises(SpecError, match="alignment"):
        kern.launch(spec.grid(7), misaligned, codes, scales)


def test_empty_batch_launches_nothing():
    spec, kern = _kernel(128, ScaleRecipe.FP32)
    x = torch.empty(0, 128, device="cuda", dtype=torch.bfloat16)
    codes = torch.empty(0, 128, device="cuda", dtype=torch.uint8)
    scales = torch.empty(0, 1, device="cuda", dtype=torch.float32)
    kern.launch(spec.grid(0), x, codes, scales)
    torch.cuda.synchronize()
