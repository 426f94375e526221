"""mla_prefill: causal MLA prefill attention (qk 192 / v 128) vs torch SDPA and the BF16 matmul rate."""
from __future__ import annotations

import statistics

from bench.harness import _events_time, case, make_row, time_graph


def matmul_tflops(n: int = 8192) -> float:
    """BF16 torch.mm n^3 of this run, eager back to back (PERF.md's matmul rate)."""
    import torch
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    us = statistics.median(_events_time(lambda: [a @ b for _ in range(10)], 5)) / 10
    return 2 * n ** 3 / us / 1e6


def prefill_inputs(H: int, B: int, T: int, gen, n_sets: int = 2) -> list[dict]:
    """Input sets of the bench shapes (B sequences of T tokens, H heads, BF16): q, k_nope / v as views
    of one [N, H, 256] tensor, the shared rope key as the tail of a 576-wide cached row."""
    import torch
    bf, N = torch.bfloat16, B * T
    sets = []
    for _ in range(n_sets):
        kv = torch.randn(N, H, 256, device="cuda", generator=gen).to(bf)
        crow = torch.randn(N, 576, device="cuda", generator=gen).to(bf)
        sets.append(dict(q=torch.randn(N, H, 192, device="cuda", generator=gen).to(bf), kn=kv[..., :128],
                         kp=crow[:, 512:], v=kv[..., 128:]))
    return sets


def sdpa_inputs(s: dict, H: int, B: int, T: int) -> tuple:
    """The peer's (q, k, v) of one input set: [B, H, T, d], k = [k_nope | k_pe] per head."""
    import torch
    N = B * T
    q = s["q"].view(B, T, H, 192).transpose(1, 2)
    k = torch.cat([s["kn"], s["kp"][:, None, :].expand(N, H, 64)], -1).view(B, T, H, 192).transpose(1, 2)
    v = s["v"].reshape(B, T, H, 128).transpose(1, 2)
    return q.contiguous(), k.contiguous(), v.contiguous()


@case
def mla_prefill(ceiling: float, quick: bool = False) -> list:
    """H12 / H96, one 4096-token sequence and an 8 x 1024 varlen batch, every kernel (wgmma_cp: K/V
    by cp.async, the default; wgmma / _ov / _pp: by TMA), BF16 output (the peer's) and the model's
    FP32 output, vs torch SDPA (causal, q/k 192, v 128, the shared rope key expanded per
    head) timed in the same run; TFLOP/s count the useful causal pairs, T (T + 1) / 2 per sequence,
    and are also given as a fraction of the same-run BF16 matmul rate."""
    import torch
    import torch.nn.functional as F

    from k3gen.ops.mla_prefill.launcher import MlaPrefill
    from k3gen.ops.mla_prefill.spec import MlaPrefillSpec, OutDtype, PrefillKernel
    from k3gen.targets import get_target

    tgt = get_target("sm90")
    mm = matmul_tflops()
    print(f"  bf16 matmul 8192^3: {mm:.0f} TFLOP/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, same = [], {}
    for H in (12, 96):
        for B, T in ((1, 4096), (8, 1024)):
            N = B * T
            cu = torch.arange(0, N + 1, T, device="cuda", dtype=torch.int32)
            flops = B * 2 * H * 320 * T * (T + 1) / 2
            sets = prefill_inputs(H, B, T, gen)
            peer_sets = [sdpa_inputs(s, H, B, T) for s in sets]
            peer_us, peer_err = None, ""
            try:
                peer_us = time_graph([lambda p=p: F.scaled_dot_product_attention(p[0], p[1], p[2], is_causal=True,
                                                                                   scale=192 ** -0.5)
                                      for p in peer_sets], reps=10)
            except Exception as e:  # noqa: BLE001  (keep our rows whatever the peer does)
                peer_err = repr(e)[:200]
            del peer_sets
            K = PrefillKernel
            auto = MlaPrefillSpec(target=tgt, heads=H).heads_fast(N)
            ob, of = OutDtype.BF16, OutDtype.FP32
            plan = [(K.WGMMA_CP, ob, auto), (K.WGMMA, ob, auto), (K.WGMMA_OV, ob, auto), (K.WGMMA_PP, ob, auto),
                    (K.WGMMA_PS, ob, auto), (K.WGMMA_PF, ob, auto)]
            if B == 1:   # the other grid order, and the model's FP32 output
                plan += [(K.WGMMA_PP, ob, not auto), (K.WGMMA_CP, of, auto), (K.WGMMA_PP, of, auto)]
            for kern, od, fast in plan:
                order = "heads-fast" if fast else "qblocks-fast"
                print(f"  mla_prefill H{H} B{B} T{T} {kern.value} {od.value} {order}", flush=True)
                op = MlaPrefill(MlaPrefillSpec(target=tgt, heads=H, out_dtype=od, kernel=kern)).load()
                dt = torch.bfloat16 if od is OutDtype.BF16 else torch.float32
                for s in sets:
                    s["out"] = torch.empty(N, H, 128, device="cuda", dtype=dt)
                us = time_graph([lambda s=s: op(s["q"], s["kn"], s["kp"], s["v"], cu, cu, s["out"], T,
                                                heads_fast=fast) for s in sets], reps=10)
                tf = flops / us / 1e6
                nbytes = N * H * (192 + 256) * 2 + N * 64 * 2 + N * H * 128 * (2 if od is OutDtype.BF16 else 4)
                extra = {"heads": H, "batch": B, "tokens": T, "out": od.value, "kernel": kern.value, "order": order,
                         "tflops": tf, "matmul_tflops": mm, "pct_matmul": 100 * tf / mm}
                if peer_us:
                    extra["peer_tflops"] = flops / peer_us / 1e6
                if peer_err:
                    extra["peer_error"] = peer_err
                print(f"    {us:.1f} us, {tf:.0f} TFLOP/s ({100 * tf / mm:.0f}% of matmul)"
                      + (f"; SDPA {peer_us:.1f} us, x{peer_us / us:.2f}" if peer_us else f"; SDPA: {peer_err}"),
                      flush=True)
                rows.append(make_row("mla_prefill", f"H{H} B{B} T{T} {kern.value} {od.value} {order}", us, nbytes,
                                     ceiling, same, peer="torch sdpa" if peer_us else "", peer_us=peer_us,
                                     extra=extra))
            del sets
            torch.cuda.empty_cache()
    return rows


# -- Blackwell (B300) projection: no Blackwell GPU exists here, so these are computed, never measured ----
B300_SHAPES = ((12, 1, 4096), (12, 8, 1024), (96, 1, 4096), (96, 8, 1024))   # (H, B, T) the H200 case measures


def b300_prefill_projection(spec, batch: int, tokens: int) -> dict:
    """Projected B300 time of the sm103 tcgen05 mla_prefill on `batch` sequences of `tokens` (no
    prefix): the larger of its bytes (MlaPrefillSpec.bytes_moved: q, k_nope, v, k_pe once, the output)
    at 8 TB/s and the MMA work it issues at the assumed 2.25 PFLOP/s dense BF16 (B300_F16_FLOPS,
    kind::f16): every CTA's key tiles as whole 128 x 128 tiles (QK over 192 dims, PV over 128), so the
    causal diagonal tiles count in full. No softmax (MUFU exp), latency or wave-quantization term:
    a floor, not a forecast."""
    from bench.cases.mla_decode import B300_F16_FLOPS, B300_TBPS
    from k3gen.ir.dims import evaluate
    from k3gen.ops.mla_prefill.spec import BLOCK_M, BLOCK_N, QK_HEAD, V_HEAD
    nbytes = int(evaluate(spec.bytes_moved(), N=batch * tokens))
    # q-block qb (rows 128 qb ..) of a sequence without prefix sees keys < min(T, 128 (qb + 1)).
    tiles = sum(-(-min(tokens, BLOCK_M * (qb + 1)) // BLOCK_N) for qb in range(-(-tokens // BLOCK_M)))
    flops = batch * spec.heads * tiles * 2 * BLOCK_M * BLOCK_N * (QK_HEAD + V_HEAD)
    useful = batch * evaluate(spec.flops(), N=tokens)
    mem_us, mma_us = nbytes / B300_TBPS * 1e6, flops / B300_F16_FLOPS * 1e6
    return {"bytes": nbytes, "tiles": batch * spec.heads * tiles, "mma_flops": flops, "useful_flops": float(useful),
            "mem_us": mem_us, "mma_us": mma_us, "proj_us": max(mem_us, mma_us),
            "bound": "memory" if mem_us >= mma_us else "MMA"}


@case(device="cpu")
def mla_prefill_b300(quick: bool = False) -> list:
    """Projected B300 times of the sm103 tcgen05 MLA prefill on the H200 case's shapes (BF16 and
    FP32 out; computed, not measured)."""
    from k3gen.ops.mla_prefill.spec import MlaPrefillSpec, OutDtype
    from k3gen.targets import get_target
    tgt = get_target("sm103")
    rows = []
    print(f"{'case':<34} {'MB':>8} {'mem us':>8} {'MMA us':>8} {'proj us':>8}  bound  (B300 projection, not measured)")
    for H, B, T in B300_SHAPES[:2] if quick else B300_SHAPES:
        for od in (OutDtype.BF16, OutDtype.FP32):
            spec = MlaPrefillSpec(target=tgt, heads=H, out_dtype=od)
            p = b300_prefill_projection(spec, B, T)
            name = f"{spec.kernel.value} H{H} B{B} T{T} {od.value}"
            print(f"{name:<34} {p['bytes'] / 1e6:8.1f} {p['mem_us']:8.1f} {p['mma_us']:8.1f} {p['proj_us']:8.1f}"
                  f"  {p['bound']}")
            rows.append({"case": name, "seconds": p["proj_us"] * 1e-6,
                         "detail": f"projected {p['proj_us']:.1f} us ({p['bound']}-bound; not measured)", **p})
    return rows
