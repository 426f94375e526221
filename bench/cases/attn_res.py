"""attn_res: the AttnRes mix + RMSNorm (+ FP8 quantization) of decode rows vs the same-size copy
and the torch mix (`python -m bench --op attn_res`)."""
from __future__ import annotations

from bench.harness import case, make_row, sets_for, time_graph
from k3gen.ir.dims import evaluate

BAR_PCT = 85.0   # PERF.md: >= 85% of the same-size copy at B >= 16


def torch_mix(src, n: int, query, norm_w, eps: float):
    """model/arch.attn_res_mix + model/layers.rms_norm in torch (FP32 math, BF16 out)."""
    import torch
    V = src[:n]
    r = torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    alpha = torch.softmax(((V * r) * query).sum(-1), dim=0)
    x = (alpha[..., None] * V).sum(0)
    return ((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * norm_w.float()).to(torch.bfloat16)


@case
def attn_res(ceiling: float, quick: bool = False) -> list:
    """AttnRes decode mix of N = 9 FP32 sources at hidden 7168 with the RMSNorm after it (BF16 out,
    and FP8 per-token-128 codes in both recipes), B = 1, 16, 64 rows, against the same-size copy
    and the torch mix + norm in the same run."""
    import torch

    from k3gen.ir.dtypes import ScaleRecipe
    from k3gen.ops.attn_res.launcher import AttnRes
    from k3gen.ops.attn_res.spec import AttnResSpec
    from k3gen.targets import get_target

    tgt = get_target("sm90")
    specs = [AttnResSpec(target=tgt, hidden=7168), AttnResSpec(target=tgt, hidden=7168, fp8=False)]
    if not quick:
        specs.append(AttnResSpec(target=tgt, hidden=7168, recipe=ScaleRecipe.UE8M0))
    N, h = 9, 7168
    rows, same = [], {}
    g = torch.Generator(device="cuda").manual_seed(0)
    query = torch.randn(h, device="cuda", generator=g) * 0.02
    norm_w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).to(torch.bfloat16)
    for spec in specs:
        op = AttnRes(spec).load()
        for B in (1, 16, 64):
            nbytes = evaluate(spec.bytes_moved(), M=B, N=N)
            sets = []
            for _ in range(sets_for(nbytes)):
                src = torch.randn(N, B, h, device="cuda", generator=g)
                out = torch.empty(B, h, dtype=torch.bfloat16, device="cuda")
                kw = {}
                if spec.fp8:
                    sdt = torch.float32 if spec.recipe is ScaleRecipe.FP32 else torch.uint8
                    kw = {"codes": torch.empty(B, h, dtype=torch.uint8, device="cuda"),
                          "scales": torch.empty(B, spec.groups, dtype=sdt, device="cuda")}
                sets.append((src, out, kw))
            us = time_graph([lambda s=s: op(s[0], N, query, norm_w, s[1], **s[2]) for s in sets])
            peer_us = time_graph([lambda s=s: torch_mix(s[0], N, query, norm_w, spec.eps) for s in sets])
            r = make_row("attn_res", f"{spec.slug()} B{B}", us, nbytes, ceiling, same, peer="torch mix+norm",
                         peer_us=peer_us)
            if B >= 16:
                r.extra["meets_bar"] = r.pct_same_copy >= BAR_PCT
            rows.append(r)
            del sets
    return rows
