"""A/B timing of the sm90 FP8 block GEMM's default plan on the >= 32 MB bar shapes, one JSON line per
(shape, M), timed like `python -m bench` (graph replay over rotated cold weight sets, median).

Run it once per template variant in separate processes (JIT with a separate K3GEN_CACHE_DIR per
variant, or a prebuilt bundle) and compare the lines of one device call:
    python tools/ab_gemm.py --tag new [--ms 1,8,32,128] [--recipe fp32]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"o_proj TP1": (7168, 12288), "kda_qkvg TP8": (6144, 7168)}


def _rel_err(x, w, recipe) -> float:
    """Relative RMS error of the kernel's BF16 output against the FP32 reference product."""
    from k3gen.ops.fp8_block_gemm.reference import fp8_block_gemm
    ref = fp8_block_gemm(x[0], x[1], w[0], w[1], recipe)
    return float((x[2].float() - ref).norm() / ref.norm())


def main(argv: list[str]) -> int:
    import torch

    from bench.harness import sets_for, time_graph
    from k3gen.ir.dtypes import ScaleRecipe
    from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
    from k3gen.ops.fp8_block_gemm.launcher import Fp8BlockGemm
    from k3gen.targets import get_target

    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    ap.add_argument("--ms", default="1,8,32,128")
    ap.add_argument("--recipe", default="fp32", choices=[r.value for r in ScaleRecipe])
    a = ap.parse_args(argv)
    recipe = ScaleRecipe(a.recipe)
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        op = Fp8BlockGemm(Fp8BlockGemmSpec(target=get_target("sm90"), n=n, k=k, recipe=recipe)).load()
        s = op.spec
        nsets = sets_for(s.weight_bytes())

        def scales(shape):
            if recipe is ScaleRecipe.FP32:
                return torch.rand(*shape, device="cuda", generator=g) * 1e-2
            return torch.randint(110, 125, shape, device="cuda", dtype=torch.uint8, generator=g)
        ws = [(torch.randint(0, 0x7E, (n, k), device="cuda", dtype=torch.uint8, generator=g),
               scales((s.n_blocks, s.k_blocks))) for _ in range(nsets)]
        for m in map(int, a.ms.split(",")):
            xs = [(torch.randint(0, 0x7E, (m, k), device="cuda", dtype=torch.uint8, generator=g),
                   scales((m, s.k_blocks)), torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
                  for _ in range(nsets)]
            x, w = xs[0], ws[0]
            op(x[0], x[1], w[0], w[1], x[2])
            err = _rel_err(x, w, recipe)
            us = time_graph([lambda x=x, w=w: op(x[0], x[1], w[0], w[1], x[2]) for x, w in zip(xs, ws)], reps=60)
            print(json.dumps({"tag": a.tag, "case": f"{name} M{m}", "us": round(us, 3), "rel_err": err,
                              "plan": str(op.plan_for(m))}), flush=True)
        del ws
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
