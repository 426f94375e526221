"""Launch-plan sweep of the sm90 wgmma FP8 block GEMM (`k3gen bench --op fp8_block_gemm_sweep`, or
scripts/sweep_gemm.py for a table): on the shapes that carry the performance bars, every candidate
plan of one cubin (the plan is a launch-time choice: cluster split-K `split`, or the streaming mode
with `ctas` persistent CTAs, and the L2 prefetch distance `pf` of the weight stream) timed like the bench (graph replay over rotated weight sets), next to
cuBLASLt block FP8 and a same-size copy from the same run. Rows carry extra.mode/split/ctas and
extra.default (the plan the launcher picks today), so the table shows whether choose_split90
picks the fastest candidate.
"""
from __future__ import annotations

from bench.harness import make_row, sets_for, time_graph

# name -> (N, K): the >= 32 MB bars (o_proj TP1 88 MB, kda_qkvg TP8 44 MB) and two small weights.
SWEEP_SHAPES = {"o_proj TP1": (7168, 12288), "kda_qkvg TP8": (6144, 7168),
                "q_b TP8": (2304, 1536), "o_proj TP8": (7168, 1536)}
SWEEP_MS = (1, 8, 32, 128)
SPLITS = (1, 2, 4, 7, 8)
PF_DISTANCES = (4, 16)   # Plan.pf = ring depth + these: blocks requested from DRAM beyond the ring


def sweep_specs(recipes=None) -> list:
    """The cubins the sweep needs (collected by scripts/prebuild_gpu.py through tests/gpu)."""
    from k3gen.ir.dtypes import ScaleRecipe
    from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
    from k3gen.targets import get_target
    tgt = get_target("sm90")
    return [Fp8BlockGemmSpec(target=tgt, n=n, k=k, recipe=r)
            for n, k in SWEEP_SHAPES.values() for r in (recipes or tuple(ScaleRecipe))]


def candidates(op, m: int) -> list[tuple[str, dict]]:
    """(label, call kwargs) of every plan worth timing for M tokens; the default plan first."""
    from k3gen.ops.fp8_block_gemm.spec import MAX_SPLIT, nt_for, work_items
    s, sms = op.spec, op.sm_count
    out = [("default", {})]
    cap = min(MAX_SPLIT, s.k_blocks)
    out += [(f"cluster split={sp}", {"split": sp}) for sp in SPLITS if sp <= cap]
    # L2 prefetch of the weight stream past the ring (Plan.pf) on the default plan and on split 2.
    ring = s.stages_nt(nt_for(m))
    for pf in PF_DISTANCES:
        out.append((f"default pf={ring + pf}", {"pf": ring + pf}))
        if 2 <= cap:
            out.append((f"cluster split=2 pf={ring + pf}", {"split": 2, "pf": ring + pf}))
    items = work_items(s.n, s.k, m)
    for c in sorted({sms, sms - 4, 128, 120, 112, 96, 66}, reverse=True):
        if 1 <= c <= min(sms, items):
            out.append((f"stream ctas={c}", {"ctas": c}))
    return out


def fp8_block_gemm_sweep(ceiling: float, quick: bool = False, recipe=None) -> list:
    import torch

    from bench.cases import _scaled_mm_block
    from k3gen.ir.dtypes import ScaleRecipe
    from k3gen.ops.fp8_block_gemm.launcher import Fp8BlockGemm

    recipe = recipe or ScaleRecipe.FP32
    rows, same = [], {}
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = list(SWEEP_SHAPES.items())[:2] if quick else list(SWEEP_SHAPES.items())
    specs = {(sp.n, sp.k): sp for sp in sweep_specs((recipe,))}
    for name, (n, k) in shapes:
        op = Fp8BlockGemm(specs[(n, k)]).load()
        spec = op.spec
        nbytes = spec.weight_bytes()
        nsets = sets_for(nbytes)
        sdt = torch.float32 if recipe is ScaleRecipe.FP32 else torch.uint8

        def scales(shape):
            if sdt == torch.float32:
                return torch.rand(*shape, device="cuda", generator=g) * 1e-2
            return torch.randint(110, 125, shape, device="cuda", dtype=torch.uint8, generator=g)
        weights = [(torch.randint(0, 0x7E, (n, k), device="cuda", dtype=torch.uint8, generator=g),
                    scales((spec.n_blocks, spec.k_blocks))) for _ in range(nsets)]
        tiled = [op.tile_weights(w[0]) for w in weights]   # the pre-tiled layout (w_tiled=True)
        for m in SWEEP_MS:
            acts = [(torch.randint(0, 0x7E, (m, k), device="cuda", dtype=torch.uint8, generator=g),
                     scales((m, spec.k_blocks)), torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
                    for _ in range(nsets)]
            peer, peer_us = "", None
            if recipe is ScaleRecipe.FP32:
                calls = [_scaled_mm_block(a[0], a[1], w[0], w[1]) for a, w in zip(acts, weights)]
                if all(c is not None for c in calls):
                    try:
                        peer_us, peer = time_graph(calls), "torch._scaled_mm block FP8"
                    except Exception:  # noqa: BLE001  (no peer for this shape)
                        pass
            default = op.plan_for(m)
            for label, kw in candidates(op, m):
                plan = op.plan_for(m, **kw)
                us = time_graph([lambda a=a, w=w, kw=kw: op(a[0], a[1], w[0], w[1], a[2], **kw)
                                 for a, w in zip(acts, weights)])
                extra = {"n": n, "k": k, "m": m, "recipe": recipe.value, "mode": "stream" if plan.ctas else "cluster",
                         "split": plan.split, "ctas": plan.ctas, "nt": plan.nt, "pf": plan.pf,
                         "default": plan == default,
                         "bar_us": nbytes / (0.8 * ceiling * 1e6) if nbytes >= 32 * 2**20 else None}
                rows.append(make_row("fp8_block_gemm_sweep", f"{name} N{n} K{k} M{m} {label}", us, nbytes, ceiling,
                                     same, peer=peer, peer_us=peer_us, extra=extra))
            # The default plan once more without programmatic dependent launch (what PDL buys).
            us = time_graph([lambda a=a, w=w: op(a[0], a[1], w[0], w[1], a[2], pdl=False)
                             for a, w in zip(acts, weights)])
            rows.append(make_row("fp8_block_gemm_sweep", f"{name} N{n} K{k} M{m} default no-PDL", us, nbytes,
                                 ceiling, same, peer=peer, peer_us=peer_us,
                                 extra={"n": n, "k": k, "m": m, "recipe": recipe.value, "pdl": False,
                                        "default": False, "split": default.split, "ctas": default.ctas}))
            us = time_graph([lambda a=a, w=w, t=t: op(a[0], a[1], t, w[1], a[2], w_tiled=True)
                             for a, w, t in zip(acts, weights, tiled)])
            rows.append(make_row("fp8_block_gemm_sweep", f"{name} N{n} K{k} M{m} default tiled-W", us, nbytes,
                                 ceiling, same, peer=peer, peer_us=peer_us,
                                 extra={"n": n, "k": k, "m": m, "recipe": recipe.value, "w_tiled": True,
                                        "default": False, "split": default.split, "ctas": default.ctas,
                                        "bar_us": nbytes / (0.8 * ceiling * 1e6) if nbytes >= 32 * 2**20 else None}))
            del acts
        del weights, tiled
        torch.cuda.empty_cache()
    return rows
