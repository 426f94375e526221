"""Per-stage clock64 timeline of one CTA (blockIdx 0, 0, 20) of the sm90 FP8 block GEMM's cluster
mode, from an instrumented copy of the template that this script writes (never the shipped kernel).

    python tools/gemm_timeline.py --make-variant DIR     # DIR/fp8_gemm_wgmma.cuh, instrumented
    # on the H200, JIT with the variant copied over k3gen/include/k3gen/gemm/:
    python tools/gemm_timeline.py 128 1 32               # one JSON line per M

Series (clock64, relative to the first stamp), index = ring position: 0-2 / 3-5 consumer
warpgroup 0 / 1 (stage ready, its wgmmas done, promoted and released), 6 producer past the empty
wait, 7-8 scale warp (past the empty wait, arrived), 9 epilogue (before / after the cluster sync).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HEADER = ROOT / "k3gen" / "include" / "k3gen" / "gemm" / "fp8_wgmma.cuh"

_EDITS = [
    ("namespace k3gen {\nnamespace fp8gemm90 {\n",
     'extern "C" {\n__device__ long long k3g_dbg[12][64];\n}\nnamespace k3gen {\nnamespace fp8gemm90 {\n'
     "__device__ __forceinline__ void stamp(int series, int i) {\n"
     "  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 20 && i < 64) k3g_dbg[series][i] = clock64();\n"
     "}\n"),
    ("      issue_block<C, NT>(ready(i), wg, pa);\n      sm90::wgmma_wait<0>();\n"
     "      promote<NT>(scl + (i % S) * NT, t4, pa, total);\n      release(i);\n",
     "      const unsigned st_ = ready(i);\n      const bool me = (threadIdx.x & 127) == 0;\n"
     "      if (me) stamp(0 + 3 * wg, i);\n      issue_block<C, NT>(st_, wg, pa);\n      sm90::wgmma_wait<0>();\n"
     "      if (me) stamp(1 + 3 * wg, i);\n      promote<NT>(scl + (i % S) * NT, t4, pa, total);\n"
     "      release(i);\n      if (me) stamp(2 + 3 * wg, i);\n"),
    ("          sm90::mbar_wait_or_trap(empty0 + 8 * s, ((i / S) - 1) & 1);\n"
     "          sm90::mbar_arrive_expect_tx(bar, (wrows + xrows) * kBlock);\n",
     "          sm90::mbar_wait_or_trap(empty0 + 8 * s, ((i / S) - 1) & 1);\n          stamp(6, i);\n"
     "          sm90::mbar_arrive_expect_tx(bar, (wrows + xrows) * kBlock);\n"),
    ("        stage_scales<C, NT>(p, scl + s * NT, ws_row, kb0 + i, m0, mrem, lane);\n"
     "        sm90::mbar_arrive(full0 + 8 * s);\n",
     "        if (lane == 0) stamp(7, i);\n        stage_scales<C, NT>(p, scl + s * NT, ws_row, kb0 + i, m0, mrem, lane);\n"
     "        sm90::mbar_arrive(full0 + 8 * s);\n        if (lane == 0) stamp(8, i);\n"),
    ("  if (split == 1) __syncthreads(); else fp8gemm::cluster_sync();\n",
     "  if (threadIdx.x == 0) stamp(9, 0);\n  if (split == 1) __syncthreads(); else fp8gemm::cluster_sync();\n"
     "  if (threadIdx.x == 0) stamp(9, 1);\n"),
]


def make_variant(out: Path) -> None:
    s = HEADER.read_text()
    for old, new in _EDITS:
        if s.count(old) < 1:
            raise SystemExit(f"the template changed; instrumentation point not found:\n{old}")
        s = s.replace(old, new, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / HEADER.name).write_text(s)


def main(argv):
    if argv[:1] == ["--make-variant"]:
        make_variant(Path(argv[1]))
        return
    import torch
    from cuda.bindings import driver

    from k3gen.ir.dtypes import ScaleRecipe
    from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
    from k3gen.ops.fp8_block_gemm.launcher import Fp8BlockGemm
    from k3gen.targets import get_target
    n, k = 7168, 12288
    op = Fp8BlockGemm(Fp8BlockGemmSpec(target=get_target("sm90"), n=n, k=k, recipe=ScaleRecipe.FP32)).load()
    s = op.spec
    for m in map(int, argv):
        sets = [(torch.randint(0, 0x7E, (m, k), device="cuda", dtype=torch.uint8),
                 torch.rand(m, s.k_blocks, device="cuda") * 1e-2,
                 torch.randint(0, 0x7E, (n, k), device="cuda", dtype=torch.uint8),
                 torch.rand(s.n_blocks, s.k_blocks, device="cuda") * 1e-2,
                 torch.empty(m, n, dtype=torch.bfloat16, device="cuda")) for _ in range(8)]
        for _ in range(3):   # back to back over 8 weight sets; the last launch's stamps remain
            for a in sets:
                op(*a)
        torch.cuda.synchronize()
        mod = op._kernel._modules[torch.cuda.current_device()]
        err, dptr, size = driver.cuModuleGetGlobal(mod, b"k3g_dbg")
        if int(err) != 0:
            raise SystemExit("k3g_dbg not found: run with the instrumented variant (--make-variant)")
        dev = torch.empty(12 * 64, dtype=torch.int64, device="cuda")
        (err,) = driver.cuMemcpyDtoD(dev.data_ptr(), dptr, size)
        torch.cuda.synchronize()
        t = dev.cpu().view(12, 64)
        t0 = int(t[t > 0].min())
        rel = torch.where(t > 0, t - t0, torch.full_like(t, -1))
        print(json.dumps({"m": m, "plan": str(op.plan_for(m)), "series": rel.tolist()}))


if __name__ == "__main__":
    main(sys.argv[1:])
