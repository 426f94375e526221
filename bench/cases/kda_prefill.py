"""kda_prefill: chunk64 (the default) at H = 12 and 96 over one 4096- or 8192-token prompt and an 8 x 1024
varlen batch, each vs FLA chunk_kda on the same lengths in the same run."""
from __future__ import annotations

from bench.peers import fla_chunk_kda
from bench.harness import case, make_row, time_graph
from k3gen.ir.dims import evaluate

# (heads, lengths) of every case; the algos timed at each.
SHAPES = ((12, (4096,)), (12, (8192,)), (12, (1024,) * 8), (96, (4096,)), (96, (8192,)), (96, (1024,) * 8))


def _fla_us(chunk_kda, H, lengths, gen, extra) -> float | None:
    """FLA chunk_kda on the same lengths (in-kernel Kimi gate when this FLA accepts those keywords,
    else a precomputed log-decay), FP32 initial and final state."""
    import torch
    K, L, B = 128, sum(lengths), len(lengths)
    bf = torch.bfloat16
    q, k, v, g = (torch.randn(1, L, H, K, device="cuda", dtype=bf, generator=gen) for _ in range(4))
    beta = torch.randn(1, L, H, device="cuda", dtype=bf, generator=gen)
    h0 = torch.randn(B, H, K, K, device="cuda", generator=gen) * 0.05
    a_log = torch.log(torch.empty(H, device="cuda").uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(H * K, device="cuda", generator=gen) * 0.5
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda", dtype=torch.long)
    kimi = dict(use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
                use_beta_sigmoid_in_kernel=True)
    plain = dict(g=-torch.nn.functional.softplus(g.float()), beta=torch.sigmoid(beta.float()).to(bf))

    def call(kw):
        return chunk_kda(q=q, k=k, v=v, scale=K ** -0.5, initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu, **kw)
    for mode, kw in (("kimi gate in kernel", dict(g=g, beta=beta, **kimi)), ("precomputed gate", plain)):
        try:
            call(kw)
            torch.cuda.synchronize()
            us = time_graph([lambda kw=kw: call(kw)], reps=10)
            extra["fla_mode"] = mode
            return us
        except Exception as e:  # noqa: BLE001  (keep our row whatever the peer's API)
            extra[f"fla_error_{mode}"] = repr(e)[:200]
    return None


@case
def kda_prefill(ceiling: float, quick: bool = False) -> list:
    """Prefill at H = 12 and 96 (FP32 state, every sequence resuming): one 4096- or 8192-token prompt
    and an 8 x 1024 varlen batch, chunk64, vs FLA's chunk_kda timed in the
    same run on the same lengths."""
    import torch

    from k3gen.ops.kda_prefill.spec import KdaPrefillSpec, PrefillAlgo
    from k3gen.ops.kda_decode.reference import random_weights
    from k3gen.ops.kda_prefill.launcher import KdaPrefill
    from k3gen.targets import get_target

    tgt = get_target("sm90")
    K = 128
    chunk_kda = fla_chunk_kda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ours = []  # every k3gen case first (printed as measured): the peer's first calls autotune for minutes
    for H, lengths in SHAPES:
        L, B = sum(lengths), len(lengths)
        shape = f"H{H} T{L}" + (f" B{B}x{lengths[0]}" if B > 1 else "")
        algos = (PrefillAlgo.CHUNK64,)
        for algo in algos:
            op = KdaPrefill(KdaPrefillSpec(target=tgt, heads=H, algo=algo)).load()
            w = random_weights(H, generator=torch.Generator().manual_seed(H)).to("cuda")
            D = H * K
            nbytes = evaluate(op.spec.bytes_moved(), B=B, N=L)
            cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
            sets = []
            for _ in range(2):
                fab = torch.randn(L, K + H, device="cuda", generator=gen).to(torch.bfloat16)
                sets.append(dict(qkvg=torch.randn(L, 4 * D, device="cuda", generator=gen).to(torch.bfloat16),
                                 fa=fab[:, :K], beta_logit=fab[:, K:], cu=cu,
                                 slots=torch.arange(B, device="cuda", dtype=torch.int32),
                                 resume=torch.ones(B, device="cuda", dtype=torch.int32),
                                 ssm=torch.randn(B, H, K, K, device="cuda", generator=gen) * 0.05,
                                 conv=torch.zeros(B, 3 * D, 3, device="cuda", dtype=torch.bfloat16),
                                 out=torch.empty(L, H, K, device="cuda", dtype=torch.bfloat16)))
            us = time_graph([lambda s=s: op(s["qkvg"], s["fa"], s["beta_logit"], s["cu"], s["slots"], s["resume"],
                                            s["ssm"], s["conv"], w.conv_w, w.fb_w, w.dt_bias, w.a_log, w.norm_w,
                                            s["out"]) for s in sets], reps=5, warmup=1)
            print(f"  kda_prefill {shape} {algo.value}: {us:.1f} us", flush=True)
            del sets
            torch.cuda.empty_cache()
            ours.append((H, lengths, shape, algo, us, nbytes))
    rows, same, peers = [], {}, {}
    for H, lengths, shape, algo, us, nbytes in ours:
        L, B = sum(lengths), len(lengths)
        if (H, lengths) not in peers:
            peer_extra: dict = {}
            peer_us = _fla_us(chunk_kda, H, lengths, gen, peer_extra) if chunk_kda is not None else None
            peers[(H, lengths)] = (peer_us, peer_extra)
            print(f"  fla chunk_kda {shape}: {peer_us} us", flush=True)
        peer_us, peer_extra = peers[(H, lengths)]
        extra = {"heads": H, "tokens": L, "batch": B, "algo": algo.value, "proj_8TBps_us": nbytes / 8e12 * 1e6,
                 **peer_extra}
        rows.append(make_row("kda_prefill", f"{shape} fp32 {algo.value}", us, nbytes, ceiling, same,
                             peer="fla chunk_kda" if peer_us else "", peer_us=peer_us, extra=extra))
    return rows


# -- Blackwell (B300) projection: no Blackwell GPU exists here, so these are computed, never measured ----
B300_SMS = 148   # SMs assumed (one state-pass CTA per SM); bandwidth and kind::f16 peak: bench/cases/mla_decode.py
# Per (64-token chunk, head), padded chunks: the tcgen05 state pass's 24 MMAs at M = 128 (V_new and O over
# K = 128 at N = 64, O's Aqk part and the state update over K = 64 at N = 64 and 128), and prep's
# mma.sync work (the f_b gate GEMM, 24 off-diagonal and 16 bounded-gate diagonal m16n8k128 units).
STATE_FLOPS = 2 * 128 * (2 * 64 * 128 + 64 * 64 + 128 * 64)
PREP_FLOPS = 2 * 64 * 128 * 128 + (24 + 16) * 2 * 16 * 8 * 128


def b300_projection(spec, lengths) -> dict:
    """Projected B300 time of chunk64_tc on one varlen batch: the largest of
    - memory: KdaPrefillSpec.bytes_moved (the op's fewest bytes) plus the workspace traffic (each
      record written by prep and read by the state pass, the raw FP32 O written by it and read by
      emit) at 8 TB/s;
    - MMA: all state-pass and prep MMA work at the assumed kind::f16 peak (optimistic for prep, whose
      mma.sync rate on Blackwell is not known here);
    - chain: the state pass is sequential per (sequence, head), one CTA on one SM: the longest
      sequence's chunks one after another at one SM's share of the peak, times the waves of H x B
      CTAs over the SMs (exact for equal lengths, an upper bound of this term otherwise).
    Not modelled: the warps' TMEM and shared-memory traffic per chunk, barrier latency, launch gaps."""
    from bench.cases.mla_decode import B300_F16_FLOPS, B300_TBPS
    H, B, N = spec.heads, len(lengths), sum(lengths)
    chunks = [-(-L // 64) for L in lengths]
    nbytes = int(evaluate(spec.bytes_moved(), B=B, N=N))
    ws = 2 * sum(chunks) * H * spec.rec_bytes + 2 * N * H * 128 * 4
    terms = {"memory": (nbytes + ws) / B300_TBPS * 1e6,
             "MMA": sum(chunks) * H * (STATE_FLOPS + PREP_FLOPS) / B300_F16_FLOPS * 1e6,
             "chain": -(-H * B // B300_SMS) * max(chunks) * STATE_FLOPS / (B300_F16_FLOPS / B300_SMS) * 1e6}
    bound = max(terms, key=terms.get)
    return {"bytes": nbytes, "ws_bytes": ws, "mem_us": terms["memory"], "mma_us": terms["MMA"],
            "chain_us": terms["chain"], "proj_us": terms[bound], "bound": bound}


@case(device="cpu")
def kda_prefill_b300(quick: bool = False) -> list:
    """Projected B300 times of the sm103 chunk64_tc prefill at `kda_prefill`'s shapes (FP32 state;
    computed, not measured)."""
    from k3gen.ops.kda_prefill.spec import KdaPrefillSpec
    from k3gen.targets import get_target
    rows = []
    print(f"{'case':<28} {'MB':>8} {'ws MB':>8} {'mem us':>8} {'MMA us':>8} {'chain us':>9} {'proj us':>8}  bound"
          "  (B300 projection, not measured)")
    for H, lengths in (SHAPES[:1] if quick else SHAPES):
        spec = KdaPrefillSpec(target=get_target("sm103"), heads=H)
        p = b300_projection(spec, lengths)
        name = f"{spec.algo.value} H{H} T{sum(lengths)}" + (f" B{len(lengths)}x{lengths[0]}" if len(lengths) > 1 else "")
        print(f"{name:<28} {p['bytes'] / 1e6:8.1f} {p['ws_bytes'] / 1e6:8.1f} {p['mem_us']:8.1f} {p['mma_us']:8.1f}"
              f" {p['chain_us']:9.1f} {p['proj_us']:8.1f}  {p['bound']}")
        rows.append({"case": name, "seconds": p["proj_us"] * 1e-6,
                     "detail": f"projected {p['proj_us']:.1f} us ({p['bound']}-bound; not measured)", **p})
    return rows
