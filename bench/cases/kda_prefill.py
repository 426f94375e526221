"""kda_prefill: one 4096-token prompt through every prefill algorithm vs FLA chunk_kda."""
from __future__ import annotations

from bench.peers import fla_chunk_kda
from bench.harness import case, make_row, time_graph
from k3gen.ir.dims import evaluate


@case
def kda_prefill(ceiling: float, quick: bool = False) -> list:
    """Prefill of one 4096-token prompt (B = 1, FP32 state) at H = 12 and 96, every algo (chunk16:
    chunked WY on tensor cores; chunkpar: its three-kernel form), vs FLA's chunk_kda timed in the same run
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
    chunk_kda = fla_chunk_kda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, same = [], {}
    for H in (12, 96):
      peer, peer_us, peer_extra = "", None, {}
      for algo in (PrefillAlgo.CHUNK16, PrefillAlgo.CHUNKPAR):
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
