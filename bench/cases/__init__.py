"""Benchmark cases, one function per op: each returns bench.Row objects measured in this run."""
from __future__ import annotations

from bench.harness import make_row, sets_for, time_graph
from k3gen.ir.dims import evaluate


def kv_cache_write(ceiling: float, quick: bool = False) -> list:
    import torch

    from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype
    from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
    from k3gen.ops.kv_cache_write.reference import alloc_cache
    from k3gen.ops.kv_cache_write.launcher import KvCacheWrite
    from k3gen.targets import get_target

    tgt = get_target("sm90")
    variants = [KvCacheWriteSpec(target=tgt, kv=KvDtype.BF16),
                KvCacheWriteSpec(target=tgt, kv=KvDtype.FP8, fp8_scales=Fp8ScaleGranularity.PER_TOKEN_128),
                KvCacheWriteSpec(target=tgt, kv=KvDtype.FP8, fp8_scales=Fp8ScaleGranularity.PER_TENSOR),
                KvCacheWriteSpec(target=tgt, kv=KvDtype.NVFP4, max_drafts=3)]
    shapes = [(1, 1), (128, 1), (512, 1), (128, 4), (8, 1024)] if not quick else [(128, 1), (8, 1024)]
    rows_out, same = [], {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for spec in variants:
        op = KvCacheWrite(spec).load()
        lay = spec.layout
        for B, T in shapes:
            width = (4 * spec.page + T) // spec.page + 2
            num_pages = B * width
            touched = evaluate(spec.bytes_moved(), B=B, T=T)
            sets = []
            for _ in range(sets_for(touched)):
                cache = alloc_cache(lay, num_pages, B, "cuda")
                start = torch.randint(0, 4 * spec.page, (B,), device="cuda", dtype=torch.int32, generator=g)
                bt = torch.randperm(num_pages, device="cuda", generator=g).to(torch.int32).view(B, width)
                rows = torch.randn(B * T, 576, device="cuda", generator=g).to(torch.bfloat16)
                cu = torch.arange(0, B * T + 1, T, device="cuda", dtype=torch.int32)
                ring = torch.arange(B, device="cuda", dtype=torch.int32)
                sets.append((rows, cu, start, bt, cache, ring))
            launches = [lambda s=s: op(s[0], s[1], s[2], s[3], s[4], ring_slot=s[5], scale=1.0,
                                       max_rows_per_seq=T) for s in sets]
            us = time_graph(launches)
            peer, peer_us = "", None
            if spec.kv is KvDtype.BF16:
                peer = "torch index_copy_"
                plaunch = []
                for rows, cu, start, bt, cache, _ in sets:
                    pos = start[:, None].long() + torch.arange(T, device="cuda")[None, :]
                    flat = (bt.long().gather(1, pos // spec.page) * spec.page + pos % spec.page).reshape(-1)
                    kv = cache["kv"].view(-1, 576)
                    plaunch.append(lambda kv=kv, flat=flat, rows=rows: kv.index_copy_(0, flat, rows))
                peer_us = time_graph(plaunch)
            rows_out.append(make_row("kv_cache_write", f"{spec.slug()} B{B} T{T}", us, touched, ceiling, same,
                                     peer=peer, peer_us=peer_us))
            del sets
            torch.cuda.empty_cache()
    return rows_out


def _fla_kda():
    """FLA's recurrent KDA op and the unfused chain's pieces, or None when fla is not installed."""
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception:  # noqa: BLE001  (any import failure: the peer columns are left out)
        return None
    return fused_recurrent_kda_fwd, causal_conv1d_update, rms_norm_gated


def _fla_kda_sets(B: int, H: int, state_dtype, n: int, chain: bool, gen):
    """Inputs of FLA's decode call with Kimi settings (as /work/shared/anchors/decode_anchors.py)."""
    import torch
    K = 128
    bf, dev = torch.bfloat16, "cuda"
    a_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(H * K, device=dev, generator=gen) * 0.5
    sets = []
    for _ in range(n):
        s = {name: torch.randn(B, 1, H, K, device=dev, dtype=bf, generator=gen) for name in ("q", "k", "v", "g")}
        s["beta"] = torch.randn(B, 1, H, device=dev, dtype=bf, generator=gen)
        s["pool"] = (torch.randn(B, H, K, K, device=dev, generator=gen) * 0.05).to(state_dtype)
        s["idx"] = torch.randperm(B, device=dev, generator=gen).to(torch.int32)
        s["out"] = torch.empty(B, 1, H, K, device=dev, dtype=bf)
        s["kw"] = dict(A_log=a_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                       use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
        if chain:
            D = H * K
            s["x"] = [torch.randn(B, D, device=dev, dtype=bf, generator=gen) for _ in range(3)]
            s["cache"] = [torch.randn(B, D, 4, device=dev, dtype=bf, generator=gen) * 0.5 for _ in range(3)]
            s["cw"] = [torch.randn(D, 4, device=dev, dtype=bf, generator=gen) * 0.5 for _ in range(3)]
            s["gate"] = torch.randn(B, 1, H, K, device=dev, dtype=bf, generator=gen)
            s["nw"] = torch.ones(K, device=dev, dtype=bf)
        sets.append(s)
    return sets


def kda_decode(ceiling: float, quick: bool = False) -> list:
    """Fused KDA decode vs FLA's fused_recurrent_kda (op alone) and the unfused FLA chain (3 conv
    updates + KDA + gated RMSNorm), H in {12, 24, 96} x B in {1, 8, 32, 128, 512}, FP32 and BF16
    state. Bytes are the fused op's (spec.bytes_moved) for every column. Small grids also time
    each cluster split (extra.split_us) so the launcher's heuristic can be checked."""
    import torch

    from k3gen.ir.dtypes import SsmDtype
    from k3gen.ops.kda_decode.spec import SPLITS, KdaDecodeSpec
    from k3gen.ops.kda_decode.reference import random_weights
    from k3gen.ops.kda_decode.launcher import KdaDecode
    from k3gen.targets import get_target

    tgt = get_target("sm90")
    heads = (12,) if quick else (12, 24, 96)
    batches = (1, 128) if quick else (1, 8, 32, 128, 512)
    fla = _fla_kda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, same = [], {}
    K = 128
    for ssm in (SsmDtype.FP32, SsmDtype.BF16):
        sdt = torch.float32 if ssm is SsmDtype.FP32 else torch.bfloat16
        for H in heads:
            op = KdaDecode(KdaDecodeSpec(target=tgt, heads=H, ssm=ssm)).load()
            w = random_weights(H, generator=torch.Generator().manual_seed(H)).to("cuda")
            D = H * K
            for B in batches:
                print(f"  kda_decode H{H} B{B} {ssm.value}", flush=True)
                nbytes = evaluate(op.spec.bytes_moved(), B=B)
                n = sets_for(nbytes)
                sets = []
                for _ in range(n):
                    fab = torch.randn(B, K + H, device="cuda", generator=gen).to(torch.bfloat16)
                    sets.append(dict(
                        qkvg=torch.randn(B, 4 * D, device="cuda", generator=gen).to(torch.bfloat16),
                        fa=fab[:, :K], beta_logit=fab[:, K:],
                        ssm=(torch.randn(B, H, K, K, device="cuda", generator=gen) * 0.05).to(sdt),
                        conv=torch.randn(B, 3 * D, 3, device="cuda", generator=gen).to(torch.bfloat16),
                        slots=torch.randperm(B, device="cuda", generator=gen).to(torch.int32),
                        out=torch.empty(B, H, K, device="cuda", dtype=torch.bfloat16)))

                def launches(split=None, schedule=None, pdl=None):
                    return [lambda s=s: op(s["qkvg"], s["fa"], s["beta_logit"], s["ssm"], s["conv"], s["slots"],
                                           w.conv_w, w.fb_w, w.dt_bias, w.a_log, w.norm_w, s["out"], split=split,
                                           schedule=schedule, pdl=pdl)
                            for s in sets]
                us = time_graph(launches())
                extra = {"split": op.split_for(B), "schedule": op.schedule_for(B, sets[0]["qkvg"], sets[0]["conv"]),
                         "heads": H, "batch": B, "ssm": ssm.value, "proj_8TBps_us": nbytes / 8e12 * 1e6}
                if not quick and B * H < 4 * op.sm_count:
                    extra["split_us"] = {s: time_graph(launches(s)) for s in SPLITS}
                if B <= 8:  # the row schedule's PDL prologue overlap, measured against plain launches
                    extra["pdl_off_us"] = time_graph(launches(pdl=False))
                if B >= 4 and B * H >= op.sm_count:  # both schedules, to check choose_schedule
                    extra["schedule_us"] = {sc: time_graph(launches(1 if sc == "rows" else None, sc))
                                            for sc in ("rows", "stream")}
                del sets
                torch.cuda.empty_cache()
                peer, peer_us = "", None
                if fla is not None:
                    kda_fwd, conv_update, rms_gated = fla
                    fsets = _fla_kda_sets(B, H, sdt, n, chain=True, gen=gen)

                    def fla_call(s):
                        return kda_fwd(q=s["q"], k=s["k"], v=s["v"], g=s["g"], beta=s["beta"],
                                       initial_state=s["pool"], scale=K ** -0.5, output_final_state=False,
                                       inplace_final_state=True, ssm_state_indices=s["idx"],
                                       num_accepted_tokens=None, out=s["out"], **s["kw"])

                    def chain_call(s):
                        ys = []
                        for i in range(3):
                            y, _ = conv_update(s["x"][i], s["cache"][i], None, s["cw"][i], None, "silu")
                            ys.append(y.view(B, 1, H, K))
                        o, _ = kda_fwd(q=ys[0], k=ys[1], v=ys[2], g=s["g"], beta=s["beta"], initial_state=s["pool"],
                                       scale=K ** -0.5, output_final_state=False, inplace_final_state=True,
                                       ssm_state_indices=s["idx"], num_accepted_tokens=None, out=s["out"], **s["kw"])
                        return rms_gated(o.view(B * H, K), s["gate"].view(B * H, K), s["nw"], None,
                                         activation="sigmoid", eps=1e-5)

                    try:
                        peer_us = time_graph([lambda s=s: fla_call(s) for s in fsets])
                        peer = "fla fused_recurrent_kda"
                        extra["fla_chain_us"] = time_graph([lambda s=s: chain_call(s) for s in fsets])
                        extra["x_fla_chain"] = extra["fla_chain_us"] / us
                    except Exception as e:  # noqa: BLE001  (a peer failure must not lose our rows)
                        extra["fla_error"] = repr(e)[:300]
                    del fsets
                    torch.cuda.empty_cache()
                rows.append(make_row("kda_decode", f"H{H} B{B} {ssm.value}", us, nbytes, ceiling, same,
                                     peer=peer, peer_us=peer_us, extra=extra))
    return rows


def act_quant_fp8(ceiling: float, quick: bool = False) -> list:
    """Per-token per-128 FP8 activation quantization (CuTe DSL kernel), K = 7168 and 1536."""
    import torch

    from k3gen.ir.dtypes import ScaleRecipe
    from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec
    from k3gen.ops.act_quant_fp8.launcher import ActQuantFp8
    from k3gen.targets import get_target

    rows, same = [], {}
    for k in (7168,) if quick else (7168, 1536):
        for recipe in ScaleRecipe:
            op = ActQuantFp8(ActQuantFp8Spec(target=get_target("sm90"), k=k, recipe=recipe)).load()
            sdt = torch.float32 if recipe is ScaleRecipe.FP32 else torch.uint8
            for m in (1, 128, 4096) if quick else (1, 16, 128, 1024, 4096, 16384):
                nbytes = evaluate(op.spec.bytes_moved(), M=m)
                sets = [(torch.randn(m, k, device="cuda").to(torch.bfloat16),
                         torch.empty(m, k, dtype=torch.uint8, device="cuda"),
                         torch.empty(m, k // 128, dtype=sdt, device="cuda")) for _ in range(sets_for(nbytes))]
                us = time_graph([lambda s=s: op(*s) for s in sets])
                rows.append(make_row("act_quant_fp8", f"K{k} M{m} {recipe.value}", us, nbytes, ceiling, same))
                del sets
    return rows


def _scaled_mm_block(xc, xs, wc, ws):
    """cuBLASLt block-scaled FP8 through torch._scaled_mm (1x128 activation, 128x128 weight
    scales), or None when this torch/cuBLASLt rejects the shapes (M = 1 among them)."""
    import torch
    a = xc.view(torch.float8_e4m3fn)
    b = wc.view(torch.float8_e4m3fn).t()
    for sa, sb in ((xs.t().contiguous().t(), ws.t()), (xs, ws), (xs.t().contiguous().t(), ws.t().contiguous())):
        try:
            torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
            return lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
        except Exception:  # noqa: BLE001  (unsupported layout or shape: try the next, else no peer)
            continue
    return None


def fp8_block_gemm_specs(quick: bool = False) -> list:
    """The sm90 cubins `k3gen bench --op fp8_block_gemm` loads (scripts/prebuild_gpu.py builds them
    through tests/gpu/test_fp8_block_gemm.py), in the bench's order."""
    from k3gen.ir.dtypes import ScaleRecipe
    from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
    from k3gen.targets import FP8_GEMM_TP1, FP8_GEMM_TP8, get_target
    shapes = [(2304, 1536), (7168, 1536), (6144, 7168), (7168, 12288)] if quick else FP8_GEMM_TP8 + FP8_GEMM_TP1
    recipes = (ScaleRecipe.FP32,) if quick else tuple(ScaleRecipe)
    return [Fp8BlockGemmSpec(target=get_target("sm90"), n=n, k=k, recipe=r) for n, k in shapes for r in recipes]


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
            ws = (torch.rand(spec.n_blocks, spec.k_blocks, device="cuda", generator=g) * 1e-2) if sdt == torch.float32 \
                else torch.randint(110, 125, (spec.n_blocks, spec.k_blocks), device="cuda", dtype=torch.uint8,
                                   generator=g)
            weights.append((wc, ws))
        for m in ms:
            print(f"  fp8_block_gemm {names.get((n, k), '')} N{n} K{k} M{m} {recipe.value}", flush=True)
            acts = [(torch.randint(0, 0x7E, (m, k), device="cuda", dtype=torch.uint8, generator=g),
                     (torch.rand(m, spec.k_blocks, device="cuda", generator=g) * 1e-2).to(sdt)
                     if sdt == torch.float32 else torch.full((m, spec.k_blocks), 120, dtype=torch.uint8,
                                                              device="cuda"),
                     torch.empty(m, n, dtype=torch.bfloat16, device="cuda")) for _ in range(nsets)]
            us = time_graph([lambda a=a, w=w: op(a[0], a[1], w[0], w[1], a[2]) for a, w in zip(acts, weights)])
            extra = {"n": n, "k": k, "m": m, "recipe": recipe.value, "split": op.split_for(m), "mma": spec.mma,
                     "proj_8TBps_us": nbytes / 8e12 * 1e6}
            peer, peer_us = "", None
            if recipe is ScaleRecipe.FP32:
                calls = [_scaled_mm_block(a[0], a[1], w[0], w[1]) for a, w in zip(acts, weights)]
                if all(c is not None for c in calls):
                    try:
                        peer_us, peer = time_graph(calls), "torch._scaled_mm block FP8"
                    except Exception as e:  # noqa: BLE001
                        extra["scaled_mm_error"] = repr(e)[:200]
                else:
                    extra["scaled_mm_error"] = "unsupported shape/layout"
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


def _fill_tbps(nbytes: int = 2**30) -> float:
    """Pure-write bandwidth of the same run (eager fill_ of a 1 GiB FP32 buffer, median of 5 x 8):
    verify moves 4-5x more bytes out than in, so its reachable fraction of the copy ceiling sits
    between the copy (1:1) and this figure."""
    import statistics

    import torch

    from bench.harness import _events_time
    b = torch.empty(nbytes // 4, device="cuda")
    for _ in range(3):
        b.fill_(1.0)
    torch.cuda.synchronize()
    us = statistics.median(_events_time(lambda: [b.fill_(1.0) for _ in range(8)], 5)) / 8
    del b
    return nbytes / us / 1e6


def kda_verify(ceiling: float, quick: bool = False) -> list:
    """Verify at T = 1 + M = 4 (FP32 records, pending random in 0..M so most starts are records)
    vs FLA's fused_recurrent_kda writing a state per token (the verify mode of
    /work/shared/anchors/decode_anchors.py: pool [B*T, H, K, V], indices [B, T], accepted counts).
    Bytes are the fused op's (spec.bytes_moved, record start) for both columns.

    Bar (PERF.md): H = 12, B in {32, 128, 512}: >= 80% of copy and >= 1.35x FLA (extra.meets_bar,
    on the default schedule's time; extra.bar_us is the time that would meet both halves).
    extra.schedule_us times the row, prefetch and split kernels on the same inputs (bench/NOTES.md
    has the model of each), extra.split_per_sm_us the split kernel at 2 and 3 CTAs per SM (its
    default is 4); extra.write_fill_tbps is the same-run pure-write bandwidth.
    Prediction from the byte count: per (sequence, head) one 64 KB FP32 start read and four 64 KB
    writes (ssm + 3 records) = 320 KB of the ~350 KB per CTA, so B = 128 moves ~532 MB (125 us at
    4.27 TB/s; the bar is ~156 us, and FLA at its 56-60% ~215 us). The kernel keeps one CTA per
    (sequence, head) with the state in registers at 2 CTAs/SM, like kda_decode (which reached ~80%
    latency-bound on 128 KB per CTA, half of it the exposed load); here the one exposed 64 KB load
    is a fifth of the CTA's bytes and the 256 KB of stores are fire-and-forget, so the same
    structure should clear 80% (unverified until the H200 run)."""
    import torch

    from k3gen.ir.dtypes import SsmDtype
    from k3gen.ops.kda_verify.spec import KdaVerifySpec
    from k3gen.ops.kda_decode.reference import random_weights
    from k3gen.ops.kda_verify.launcher import SCHEDULES, SPLIT_PER_SM, KdaVerify, has_prefetch
    from k3gen.targets import get_target

    tgt = get_target("sm90")
    M, K = 3, 128
    T = 1 + M
    fla = _fla_kda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, same = [], {}
    fill = _fill_tbps()
    for ssm in (SsmDtype.FP32,) if quick else (SsmDtype.FP32, SsmDtype.BF16):
        sdt = torch.float32 if ssm is SsmDtype.FP32 else torch.bfloat16
        for H in (12,) if quick else (12, 96):
            op = KdaVerify(KdaVerifySpec(target=tgt, heads=H, drafts=M, ssm=ssm)).load()
            w = random_weights(H, generator=torch.Generator().manual_seed(H)).to("cuda")
            D = H * K
            for B in (32, 128) if quick else (1, 8, 32, 128, 512):
                if H * B > 12 * 512:
                    continue
                print(f"  kda_verify H{H} B{B} M{M} {ssm.value}", flush=True)
                nbytes = evaluate(op.spec.bytes_moved(), B=B)
                n = sets_for(nbytes)
                sets = []
                for _ in range(n):
                    fab = torch.randn(B * T, K + H, device="cuda", generator=gen).to(torch.bfloat16)
                    sets.append(dict(
                        qkvg=torch.randn(B * T, 4 * D, device="cuda", generator=gen).to(torch.bfloat16),
                        fa=fab[:, :K], beta_logit=fab[:, K:],
                        ssm=(torch.randn(B, H, K, K, device="cuda", generator=gen) * 0.05).to(sdt),
                        rec=torch.randn(B, M, H, K, K, device="cuda", generator=gen) * 0.05,
                        ce=torch.randn(B, 3 * D, 3 + M, device="cuda", generator=gen),
                        pending=torch.randint(0, M + 1, (B,), device="cuda", generator=gen, dtype=torch.int32),
                        slots=torch.randperm(B, device="cuda", generator=gen).to(torch.int32),
                        out=torch.empty(B, T, H, K, device="cuda", dtype=torch.bfloat16)))
                def timed(schedule, sets=sets, **kw):
                    return time_graph([lambda s=s: op(s["qkvg"], s["fa"], s["beta_logit"], s["ssm"], s["rec"],
                                                      s["ce"], s["pending"], s["slots"], w.conv_w, w.fb_w,
                                                      w.dt_bias, w.a_log, w.norm_w, s["out"], schedule=schedule,
                                                      **kw)
                                       for s in sets])
                extra = {"heads": H, "batch": B, "drafts": M, "ssm": ssm.value, "proj_8TBps_us": nbytes / 8e12 * 1e6,
                         "schedule": op.schedule_for(B), "write_fill_tbps": fill}
                if has_prefetch(op.spec):  # both schedules on the same inputs, same run; us: the default's
                    extra["schedule_us"] = {sch: timed(sch) for sch in SCHEDULES}
                    us = extra["schedule_us"][extra["schedule"]]
                    if H == 12 and ssm is SsmDtype.FP32 and B >= 32:  # split: CTAs per SM (default 4)
                        extra["split_per_sm_us"] = {n: timed("split", per_sm=n) for n in SPLIT_PER_SM[:-1]}
                    if extra["schedule"] == "prefetch" and H == 12 and ssm is SsmDtype.FP32:
                        # What PDL and the L2 warming before its wait buy, same inputs, same run.
                        extra["pdl_off_us"] = timed("prefetch", pdl=False)
                        extra["warm_off_us"] = timed("prefetch", warm=False)
                else:
                    us = timed(None)
                del sets
                torch.cuda.empty_cache()
                peer, peer_us = "", None
                if fla is not None:
                    kda_fwd = fla[0]
                    try:
                        fsets = _fla_kda_sets(B, H, sdt, n, chain=False, gen=gen)
                        for s in fsets:  # verify mode: T tokens, one state row per token
                            for name in ("q", "k", "v", "g"):
                                s[name] = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, generator=gen)
                            s["beta"] = torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
                            s["pool"] = (torch.randn(B * T, H, K, K, device="cuda", generator=gen) * 0.05).to(sdt)
                            s["idx"] = torch.randperm(B * T, device="cuda", generator=gen).to(torch.int32).view(B, T)
                            s["nat"] = torch.randint(1, T + 1, (B,), device="cuda", generator=gen, dtype=torch.int32)
                            s["out"] = torch.empty(B, T, H, K, device="cuda", dtype=torch.bfloat16)
                        peer_us = time_graph([lambda s=s: kda_fwd(
                            q=s["q"], k=s["k"], v=s["v"], g=s["g"], beta=s["beta"], initial_state=s["pool"],
                            scale=K ** -0.5, output_final_state=False, inplace_final_state=True,
                            ssm_state_indices=s["idx"], num_accepted_tokens=s["nat"], out=s["out"], **s["kw"])
                            for s in fsets])
                        peer = "fla fused_recurrent_kda T=4 per-token state"
                        del fsets
                    except Exception as e:  # noqa: BLE001  (a peer failure must not lose our rows)
                        extra["fla_error"] = repr(e)[:300]
                    torch.cuda.empty_cache()
                row = make_row("kda_verify", f"H{H} B{B} M{M} {ssm.value}", us, nbytes, ceiling, same,
                               peer=peer, peer_us=peer_us, extra=extra)
                if H == 12 and B >= 32 and ssm is SsmDtype.FP32:  # the default schedule's time
                    row.extra["meets_bar"] = bool(row.pct_copy >= 80 and (row.speedup or 0) >= 1.35)
                    bar = float(nbytes) / (0.8 * ceiling * 1e12) * 1e6
                    row.extra["bar_us"] = min(bar, peer_us / 1.35) if peer_us else bar
                rows.append(row)
    return rows


def _fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # noqa: BLE001
        return None
    return chunk_kda


def kda_prefill(ceiling: float, quick: bool = False) -> list:
    """Prefill of one 4096-token prompt (B = 1, FP32 state) at H = 12 and 96, every algo (chunk16:
    chunked WY on tensor cores; chunkpar: its three-kernel form; token: token-sequential; quick
    skips token at H = 96), vs FLA's chunk_kda timed in the same run
    (in-kernel Kimi gate when this FLA accepts those keywords, else a precomputed log-decay). One
    CTA per (sequence, head): at B = 1 the grid is H CTAs, so H = 12 uses 12 of 132 SMs, while FLA
    spreads chunks over the GPU; the row reports the ratio as measured."""
    import torch

    from k3gen.ops.kda_prefill.spec import KdaPrefillSpec, PrefillAlgo
    from k3gen.ops.kda_decode.reference import random_weights
    from k3gen.ops.kda_prefill.launcher import KdaPrefill
    from k3gen.targets import get_target

    tgt = get_target("sm90")
    K, L = 128, 4096
    chunk_kda = _fla_chunk_kda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, same = [], {}
    for H in (12, 96):
      peer, peer_us, peer_extra = "", None, {}
      for algo in PrefillAlgo:
        if quick and H > 12 and algo is PrefillAlgo.TOKEN:  # ~10 ms a call and no contender at H = 96
            continue
        print(f"  kda_prefill H{H} T{L} {algo.value}", flush=True)
        op = KdaPrefill(KdaPrefillSpec(target=tgt, heads=H, algo=algo)).load()
        w = random_weights(H, generator=torch.Generator().manual_seed(H)).to("cuda")
        D = H * K
        nbytes = evaluate(op.spec.bytes_moved(), B=1, N=L)
        sets = []
        for _ in range(2):
            fab = torch.randn(L, K + H, device="cuda", generator=gen).to(torch.bfloat16)
            sets.append(dict(qkvg=torch.randn(L, 4 * D, device="cuda", generator=gen).to(torch.bfloat16),
                             fa=fab[:, :K], beta_logit=fab[:, K:],
                             cu=torch.tensor([0, L], device="cuda", dtype=torch.int32),
                             slots=torch.zeros(1, device="cuda", dtype=torch.int32),
                             resume=torch.ones(1, device="cuda", dtype=torch.int32),
                             ssm=torch.randn(1, H, K, K, device="cuda", generator=gen) * 0.05,
                             conv=torch.zeros(1, 3 * D, 3, device="cuda", dtype=torch.bfloat16),
                             out=torch.empty(L, H, K, device="cuda", dtype=torch.bfloat16)))
        us = time_graph([lambda s=s: op(s["qkvg"], s["fa"], s["beta_logit"], s["cu"], s["slots"], s["resume"],
                                        s["ssm"], s["conv"], w.conv_w, w.fb_w, w.dt_bias, w.a_log, w.norm_w, s["out"])
                         for s in sets], reps=5, warmup=1)
        extra = {"heads": H, "tokens": L, "algo": algo.value, "proj_8TBps_us": nbytes / 8e12 * 1e6}
        del sets
        if chunk_kda is not None and peer_us is None:
            bf = torch.bfloat16
            q, k, v, g = (torch.randn(1, L, H, K, device="cuda", dtype=bf, generator=gen) for _ in range(4))
            beta = torch.randn(1, L, H, device="cuda", dtype=bf, generator=gen)
            h0 = torch.randn(1, H, K, K, device="cuda", generator=gen) * 0.05
            a_log = torch.log(torch.empty(H, device="cuda").uniform_(1, 16, generator=gen))
            dt_bias = torch.randn(H * K, device="cuda", generator=gen) * 0.5
            cu = torch.tensor([0, L], device="cuda", dtype=torch.long)
            kimi = dict(use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
                        use_beta_sigmoid_in_kernel=True)
            logdecay = -torch.nn.functional.softplus(g.float())
            plain = dict(g=logdecay, beta=torch.sigmoid(beta.float()).to(bf))

            def call(kw):
                return chunk_kda(q=q, k=k, v=v, scale=K ** -0.5, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, cu_seqlens=cu, **kw)
            for mode, kw in (("kimi gate in kernel", dict(g=g, beta=beta, **kimi)), ("precomputed gate", plain)):
                try:
                    call(kw)
                    torch.cuda.synchronize()
                    peer_us = time_graph([lambda kw=kw: call(kw)], reps=10)
                    peer, peer_extra["fla_mode"] = "fla chunk_kda", mode
                    break
                except Exception as e:  # noqa: BLE001  (keep our row whatever the peer's API)
                    peer_extra[f"fla_error_{mode}"] = repr(e)[:200]
        torch.cuda.empty_cache()
        rows.append(make_row("kda_prefill", f"H{H} T{L} fp32 {algo.value}", us, nbytes, ceiling, same, peer=peer,
                             peer_us=peer_us, extra={**extra, **peer_extra}))
    return rows


from bench.cases.mla_decode import mla_decode  # noqa: E402,F401  (k3gen bench --op mla_decode)
from bench.cases.mla_decode import mla_decode_heads  # noqa: E402,F401  (k3gen bench --op mla_decode_heads)
from bench.cases.mla_decode import mla_decode_bars  # noqa: E402,F401  (k3gen bench --op mla_decode_bars)
from bench.cases.fp8_block_gemm import fp8_block_gemm_sweep  # noqa: E402,F401  (k3gen bench --op fp8_block_gemm_sweep)
