"""fp8_block_gemm benchmarks: `python -m bench --op fp8_block_gemm` (the K3 projections, both
recipes, against cuBLASLt block FP8 and BF16 torch.mm) and `--op fp8_block_gemm_sweep`.

The sweep is the launch-plan sweep of the sm90 wgmma FP8 block GEMM (or tools/sweep_gemm.py for a
table): on the shapes that carry the performance bars, every candidate plan of one cubin (the plan
is a launch-time choice: cluster split-K `split`, or the streaming mode with `ctas` persistent CTAs,
and the L2 prefetch distance `pf` of the weight stream) timed like the bench (graph replay over
rotated weight sets), next to cuBLASLt block FP8 and a same-size copy from the same run. Rows carry
extra.mode/split/ctas and extra.default (the plan the launcher picks today), so the table shows
whether choose_split90 picks the fastest candidate.
"""
from __future__ import annotations

from bench.harness import case, make_row, sets_for, time_graph
from bench.peers import scaled_mm_block


def fp8_block_gemm_specs(quick: bool = False) -> list:
    """The sm90 cubins `k3gen bench --op fp8_block_gemm` loads (tools/prebuild_gpu.py builds them
    through tests/gpu/test_fp8_block_gemm.py), in the bench's order."""
    from k3gen.ir.dtypes import ScaleRecipe
    from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
    from k3gen.targets import FP8_GEMM_TP1, FP8_GEMM_TP8, get_target
    shapes = [(2304, 1536), (7168, 1536), (6144, 7168), (7168, 12288)] if quick else FP8_GEMM_TP8 + FP8_GEMM_TP1
    recipes = (ScaleRecipe.FP32,) if quick else tuple(ScaleRecipe)
    return [Fp8BlockGemmSpec(target=get_target("sm90"), n=n, k=k, recipe=r) for n, k in shapes for r in recipes]


def _scales(shape, sdt, g):
    """Random tile scales of a recipe: small FP32 values, or UE8M0 exponents near 2^-7."""
    import torch
    if sdt == torch.float32:
        return torch.rand(*shape, device="cuda", generator=g) * 1e-2
    return torch.randint(110, 125, shape, device="cuda", dtype=torch.uint8, generator=g)


def _scaled_mm_peer(acts, weights, errors: dict | None = None) -> tuple[str, float | None]:
    """(peer name, us) of torch._scaled_mm block FP8 on the same operands, or ("", None) where it
    cannot run; why is recorded in `errors` (extra) when given."""
    calls = [scaled_mm_block(a[0], a[1], w[0], w[1]) for a, w in zip(acts, weights)]
    if not all(c is not None for c in calls):
        if errors is not None:
            errors["scaled_mm_error"] = "unsupported shape/layout"
        return "", None
    try:
        return "torch._scaled_mm block FP8", time_graph(calls)
    except Exception as e:  # noqa: BLE001  (no peer for this shape)
        if errors is not None:
            errors["scaled_mm_error"] = repr(e)[:200]
        return "", None


def _bar_us(nbytes: int, ceiling: float) -> float | None:
    """The performance bar (80 % of the copy ceiling) of the weights that carry one (>= 32 MB)."""
    return nbytes / (0.8 * ceiling * 1e6) if nbytes >= 32 * 2**20 else None


@case
def fp8_block_gemm(ceiling: float, quick: bool = False) -> list:
    """FP8 block GEMM on the K3 projections (TP8 and TP1) at M in {1, 8, 32, 128}, both recipes on
    the H200. Bytes are the weights' (codes + tile scales); peers: torch._scaled_mm block FP8
    (cuBLASLt; no M = 1) and BF16 torch.mm (extra.bf16_mm_us)."""
    import torch

    from k3gen.ir.dtypes import ScaleRecipe
    from k3gen.ops.fp8_block_gemm.launcher import Fp8BlockGemm

    names = {(1536, 7168): "q_a", (2304, 1536): "q_b TP8", (7168, 1536): "o_proj TP8",
             (6144, 7168): "kda_qkvg TP8", (18432, 1536): "q_b TP1", (7168, 12288): "o_proj TP1",
             (49152, 7168): "kda_qkvg TP1"}
    ms = (1, 8, 32, 128)
    rows, same = [], {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for spec in fp8_block_gemm_specs(quick):
        op = Fp8BlockGemm(spec).load()
        n, k, recipe = spec.n, spec.k, spec.recipe
        nbytes = spec.weight_bytes()
        sdt = torch.float32 if recipe is ScaleRecipe.FP32 else torch.uint8
        nsets = sets_for(nbytes)
        weights = []
        for _ in range(nsets):
            wc = torch.randint(0, 0x7E, (n, k), device="cuda", dtype=torch.uint8, generator=g)
            weights.append((wc, _scales((spec.n_blocks, spec.k_blocks), sdt, g)))
        for m in ms:
            print(f"  fp8_block_gemm {names.get((n, k), '')} N{n} K{k} M{m} {recipe.value}", flush=True)
            acts = [(torch.randint(0, 0x7E, (m, k), device="cuda", dtype=torch.uint8, generator=g),
                     _scales((m, spec.k_blocks), sdt, g) if sdt == torch.float32 else torch.full((m, spec.k_blocks), 120, dtype=torch.uint8,
                                                              device="cuda"),
                     torch.empty(m, n, dtype=torch.bfloat16, device="cuda")) for _ in range(nsets)]
            us = time_graph([lambda a=a, w=w: op(a[0], a[1], w[0], w[1], a[2]) for a, w in zip(acts, weights)])
            extra = {"n": n, "k": k, "m": m, "recipe": recipe.value, "split": op.split_for(m), "mma": spec.mma,
                     "proj_8TBps_us": nbytes / 8e12 * 1e6}
            peer, peer_us = "", None
            if recipe is ScaleRecipe.FP32:
                peer, peer_us = _scaled_mm_peer(acts, weights, extra)
                try:
                    xb = [torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16) for _ in range(nsets)]
                    wb = [torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16) for _ in range(nsets)]
                    extra["bf16_mm_us"] = time_graph([lambda x=x, w=w: torch.mm(x, w.t()) for x, w in zip(xb, wb)])
                    del xb, wb
                except Exception as e:  # noqa: BLE001
                    extra["bf16_mm_error"] = repr(e)[:200]
            rows.append(make_row("fp8_block_gemm", f"{names.get((n, k), '')} N{n} K{k} M{m} {recipe.value}", us,
                                 nbytes, ceiling, same, peer=peer, peer_us=peer_us, extra=extra))
            del acts
        del weights
        torch.cuda.empty_cache()
    return rows


# name -> (N, K): the >= 32 MB bars (o_proj TP1 88 MB, kda_qkvg TP8 44 MB) and two small weights.
SWEEP_SHAPES = {"o_proj TP1": (7168, 12288), "kda_qkvg TP8": (6144, 7168),
                "q_b TP8": (2304, 1536), "o_proj TP8": (7168, 1536)}
SWEEP_MS = (1, 8, 32, 128)
SPLITS = (1, 2, 4, 7, 8)
PF_DISTANCES = (4, 16)   # Plan.pf = ring depth + these: blocks requested from DRAM beyond the ring


def sweep_specs(recipes=None) -> list:
    """The cubins the sweep needs (collected by tools/prebuild_gpu.py through tests/gpu)."""
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


@case
def fp8_block_gemm_sweep(ceiling: float, quick: bool = False, recipe=None) -> list:
    """Every candidate launch plan of the sm90 FP8 GEMM on the bar shapes (module doc)."""
    import torch

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
        weights = [(torch.randint(0, 0x7E, (n, k), device="cuda", dtype=torch.uint8, generator=g),
                    _scales((spec.n_blocks, spec.k_blocks), sdt, g)) for _ in range(nsets)]
        tiled = [op.tile_weights(w[0]) for w in weights]   # the pre-tiled layout (w_tiled=True)
        for m in SWEEP_MS:
            acts = [(torch.randint(0, 0x7E, (m, k), device="cuda", dtype=torch.uint8, generator=g),
                     _scales((m, spec.k_blocks), sdt, g), torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
                    for _ in range(nsets)]
            peer, peer_us = _scaled_mm_peer(acts, weights) if recipe is ScaleRecipe.FP32 else ("", None)
            default = op.plan_for(m)
            for label, kw in candidates(op, m):
                plan = op.plan_for(m, **kw)
                us = time_graph([lambda a=a, w=w, kw=kw: op(a[0], a[1], w[0], w[1], a[2], **kw)
                                 for a, w in zip(acts, weights)])
                extra = {"n": n, "k": k, "m": m, "recipe": recipe.value, "mode": "stream" if plan.ctas else "cluster",
                         "split": plan.split, "ctas": plan.ctas, "nt": plan.nt, "pf": plan.pf,
                         "default": plan == default,
                         "bar_us": _bar_us(nbytes, ceiling)}
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
                                        "bar_us": _bar_us(nbytes, ceiling)}))
            del acts
        del weights, tiled
        torch.cuda.empty_cache()
    return rows


# -- Blackwell (B300) projection: no Blackwell GPU exists here, so these are computed, never measured ----
B300_FP8_FLOPS = 4.5e15   # dense FP8 tcgen05 peak assumed for the MMA floor (kind::mxf8f6f4 / f8f6f4)
B300_MS = (1, 8, 32, 128)


def b300_gemm_projection(spec, m: int) -> dict:
    """Projected B300 time of the sm103 tcgen05_tma GEMM at M tokens: the larger of its bytes
    (Fp8BlockGemmSpec.bytes_moved: weights + tile scales once, activations, BF16 out) at 8 TB/s and
    the MMA work it issues at the assumed FP8 peak (tiles padded: 128 weight rows x bm tokens x 128 K
    per block). No per-SM issue model: the sm90 kernel reached 58-83% of the H200's copy rate."""
    from bench.cases.mla_decode import B300_TBPS
    from k3gen.ir.dims import evaluate
    from k3gen.ops.fp8_block_gemm.spec import BLOCK, TC_TILE_N, cdiv
    nbytes = int(evaluate(spec.bytes_moved(), M=m))
    flops = 2 * cdiv(m, spec.bm) * spec.bm * cdiv(spec.n, TC_TILE_N) * TC_TILE_N * spec.k_blocks * BLOCK
    mem_us, mma_us = nbytes / B300_TBPS * 1e6, flops / B300_FP8_FLOPS * 1e6
    return {"bytes": nbytes, "mem_us": mem_us, "mma_us": mma_us, "proj_us": max(mem_us, mma_us),
            "bound": "memory" if mem_us >= mma_us else "MMA", "split": spec.plan(m, 148).split}


def b300_gemm_specs(quick: bool = False) -> list:
    """The sm103 builds of the shapes `fp8_block_gemm` measures on the H200 (the target's UE8M0 recipe)."""
    from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
    from k3gen.targets import get_target
    tgt = get_target("sm103")
    return [Fp8BlockGemmSpec(target=tgt, n=s.n, k=s.k) for s in fp8_block_gemm_specs(quick)
            if s.recipe is tgt.scale_recipe or quick]


@case(device="cpu")
def fp8_block_gemm_b300(quick: bool = False) -> list:
    """Projected B300 times of the sm103 tcgen05_tma FP8 block GEMM (computed, not measured)."""
    rows, seen = [], set()
    print(f"{'case':<36} {'MB':>8} {'mem us':>8} {'MMA us':>8} {'proj us':>8}  split bound  (B300 projection, not measured)")
    for spec in b300_gemm_specs(quick):
        if (spec.n, spec.k) in seen:
            continue
        seen.add((spec.n, spec.k))
        for m in B300_MS:
            p = b300_gemm_projection(spec, m)
            name = f"{spec.mma} N{spec.n} K{spec.k} M{m} {spec.recipe.value}"
            print(f"{name:<36} {p['bytes'] / 1e6:8.2f} {p['mem_us']:8.2f} {p['mma_us']:8.2f} {p['proj_us']:8.2f}"
                  f"  {p['split']:5d} {p['bound']}")
            rows.append({"case": name, "seconds": p["proj_us"] * 1e-6,
                         "detail": f"projected {p['proj_us']:.2f} us ({p['bound']}-bound; not measured)", **p})
    return rows
