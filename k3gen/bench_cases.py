"""Benchmark cases, one function per op: each returns bench.Row objects measured in this run."""
from __future__ import annotations

from .bench import make_row, sets_for, time_graph
from .ir.dims import evaluate


def kv_cache_write(ceiling: float, quick: bool = False) -> list:
    import torch

    from .ir.dtypes import Fp8ScaleGranularity, KvDtype
    from .ir.ops.kv_cache_write import KvCacheWriteSpec
    from .reference.kv_cache_write import alloc_cache
    from .runtime.ops.kv_cache_write import KvCacheWrite
    from .targets import get_target

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

    from .ir.dtypes import SsmDtype
    from .ir.ops.kda_decode import SPLITS, KdaDecodeSpec
    from .reference.kda_decode import random_weights
    from .runtime.ops.kda_decode import KdaDecode
    from .targets import get_target

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

                def launches(split=None):
                    return [lambda s=s: op(s["qkvg"], s["fa"], s["beta_logit"], s["ssm"], s["conv"], s["slots"],
                                           w.conv_w, w.fb_w, w.dt_bias, w.a_log, w.norm_w, s["out"], split=split)
                            for s in sets]
                us = time_graph(launches())
                extra = {"split": op.split_for(B), "heads": H, "batch": B, "ssm": ssm.value,
                         "proj_8TBps_us": nbytes / 8e12 * 1e6}
                if not quick and B * H < 4 * op.sm_count:
                    extra["split_us"] = {s: time_graph(launches(s)) for s in SPLITS}
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

    from .ir.dtypes import ScaleRecipe
    from .ir.ops.act_quant_fp8 import ActQuantFp8Spec
    from .runtime.ops.act_quant_fp8 import ActQuantFp8
    from .targets import get_target

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
