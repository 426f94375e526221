"""One leg of an A/B of mla_prefill trees: times the TMA kernels (wgmma_pp, the persistent wgmma_ps and
wgmma_pf; BF16 out, the auto grid order) and torch SDPA (the peer of bench.cases.mla_prefill, same inputs) at H12 /
H96 x one 4096-token sequence / 8 x 1024, graph-timed, and prints one `AB {json}` line per case
(tag, case, median us, useful TFLOP/s, x SDPA of the same leg).

Run from the root of the tree under test (its k3gen is imported from the current directory), with
that tree's bundle first on K3GEN_PREBUILT; legs alternate in one device call, each in its own
process:

    (cd run/xO && PYTHONPATH=$PWD K3GEN_PREBUILT=../bO:../../build-out python3 ../../tools/ab_prefill.py old)
    python3 tools/ab_prefill.py new

CASES=H96xB1xT4096,... limits the shapes; KERNELS=wgmma,wgmma_ov the kernels (a tree without the persistent variants needs KERNELS).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

SHAPES = ((12, 1, 4096), (12, 8, 1024), (96, 1, 4096), (96, 8, 1024))


def main(argv: list[str]) -> int:
    import torch
    import torch.nn.functional as F

    from bench.cases.mla_prefill import prefill_inputs, sdpa_inputs
    from bench.harness import time_graph
    from k3gen.ops.mla_prefill.launcher import MlaPrefill
    from k3gen.ops.mla_prefill.spec import MlaPrefillSpec, OutDtype, PrefillKernel
    from k3gen.targets import get_target

    tag = argv[0] if argv else Path.cwd().name
    want = {c for c in os.environ.get("CASES", "").split(",") if c}
    kernels = [PrefillKernel(k) for k in os.environ.get("KERNELS", "wgmma_pp,wgmma_ps,wgmma_pf").split(",")]
    tgt, bf = get_target("sm90"), torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    for H, B, T in SHAPES:
        case = f"H{H}xB{B}xT{T}"
        if want and case not in want:
            continue
        N = B * T
        cu = torch.arange(0, N + 1, T, device="cuda", dtype=torch.int32)
        flops = B * 2 * H * 320 * T * (T + 1) / 2
        sets = prefill_inputs(H, B, T, gen)
        for st in sets:
            st["out"] = torch.empty(N, H, 128, device="cuda", dtype=bf)
        peer = [sdpa_inputs(st, H, B, T) for st in sets]
        sdpa = time_graph([lambda p=p: F.scaled_dot_product_attention(p[0], p[1], p[2], is_causal=True,
                                                                        scale=192 ** -0.5) for p in peer], reps=10)
        del peer
        print("AB " + json.dumps({"tag": tag, "case": f"{case} sdpa", "us": round(sdpa, 1),
                                  "tflops": round(flops / sdpa / 1e6)}), flush=True)
        fast = MlaPrefillSpec(target=tgt, heads=H).heads_fast(N)
        for kern in kernels:
            op = MlaPrefill(MlaPrefillSpec(target=tgt, heads=H, out_dtype=OutDtype.BF16, kernel=kern)).load()
            us = time_graph([lambda s=s: op(s["q"], s["kn"], s["kp"], s["v"], cu, cu, s["out"], T, heads_fast=fast)
                             for s in sets], reps=10)
            print("AB " + json.dumps({"tag": tag, "case": f"{case} {kern.value}", "us": round(us, 1),
                                      "tflops": round(flops / us / 1e6), "x_sdpa": round(sdpa / us, 3)}), flush=True)
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
