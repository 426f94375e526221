"""kda_decode: the fused KDA decode step vs FLA (`python -m bench --op kda_decode`)."""
from __future__ import annotations

from bench.peers import fla_kda, fla_kda_sets
from bench.harness import case, make_row, sets_for, time_graph
from k3gen.ir.dims import evaluate


@case
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
    fla = fla_kda()
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
                    fsets = fla_kda_sets(B, H, sdt, n, chain=True, gen=gen)

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
