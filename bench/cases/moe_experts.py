"""moe_experts: grouped FP4 expert GEMMs + SiTU + combine at K3 TP8 / EP8 shapes vs torch._grouped_mm
BF16 (`python -m bench --op moe_experts`)."""
from __future__ import annotations

from bench.harness import case, make_row, sets_for, time_graph

# Public vLLM Marlin W4A16 MXFP4 K3 MoE layer on an H200 at TP8 (PERF.md): quoted, never measured here.
MARLIN_TP8_US = {1: 71.5, 8: 177.0, 64: 844.0}
SHAPES = {
    "tp8": dict(hidden=3584, inter=384, experts=896, top_k=16),
    "ep8": dict(hidden=3584, inter=3072, experts=112, route_experts=896, top_k=16),
}
EP_BASE = 112 * 3   # rank 3 of 8


def _route(spec, T: int, g, base: int) -> dict:
    """k distinct random experts of the router's R per token, in moe_route's layout (CUDA), plus the
    host-side counts the peer needs to slice its local rows (taken before any timing)."""
    import torch

    from k3gen.ops.moe_route.reference import grouped_order
    R, k = spec.route_experts, spec.top_k
    ids = torch.rand(T, R, generator=g).topk(k, dim=1).indices.int()
    _, offsets, perm, _ = grouped_order(ids, R)
    lo, hi = int(offsets[base]), int(offsets[base + spec.experts])
    touched = len(set(int(e) for e in ids.reshape(-1).tolist() if base <= e < base + spec.experts))
    r = {"ids": ids, "weights": torch.rand(T, k, generator=g) / k, "offsets": offsets, "perm": perm}
    return {"dev": {n: v.cuda() for n, v in r.items()}, "lo": lo, "hi": hi, "touched": touched,
            "local_offs": (offsets[base + 1: base + spec.experts + 1] - lo).int().cuda()}


def _weights(spec, g) -> dict:
    import torch
    E, W, I, G = spec.experts, spec.hidden, spec.inter, spec.group
    u8 = dict(dtype=torch.uint8, device="cuda", generator=g)
    w = {"w13": torch.randint(0, 256, (E, 2 * I, W // 2), **u8), "w2": torch.randint(0, 256, (E, W, I // 2), **u8)}
    lo, hi = (119, 123) if spec.group == 32 else (0x30, 0x60)
    w["s13"] = torch.randint(lo, hi, (E, 2 * I, W // G), **u8)
    w["s2"] = torch.randint(lo, hi, (E, W, I // G), **u8)
    if spec.group == 16:
        w["gs13"] = torch.full((E, 2), 1e-3, device="cuda")
        w["gs2"] = torch.full((E, 1), 1e-3, device="cuda")
    else:
        w["gs13"] = w["gs2"] = None
    return w


def _torch_moe(x, w13t, w2t, r, spec, out):
    """The same layer in torch: gather the local slots in grouped order, two BF16 grouped GEMMs
    (torch._grouped_mm), SiTU, weighted index_add back per token (capturable, no host sync)."""
    import torch
    I, k = spec.inter, spec.top_k
    perm = r["dev"]["perm"][r["lo"]:r["hi"]].long()
    tok = perm // k
    gu = torch._grouped_mm(x[tok], w13t, offs=r["local_offs"])
    g, u = gu[:, :I].float(), gu[:, I:].float()
    h = (4 * torch.tanh(g / 4) * torch.sigmoid(g) * (25 * torch.tanh(u / 25))).to(torch.bfloat16)
    y = torch._grouped_mm(h, w2t, offs=r["local_offs"])
    wts = r["dev"]["weights"].reshape(-1)[perm][:, None]
    out.zero_().index_add_(0, tok, y.float() * wts)
    return out


@case
def moe_experts(ceiling: float, quick: bool = False) -> list:
    """Routed experts (gate_up + SiTU + down + ordered combine) on packed MXFP4 / NVFP4 at K3 TP8
    (896 experts, 384 per rank) and EP8 (112 local of 896, 3072) shapes, T = 1, 8, 64: TB/s on the
    touched expert bytes, % of the same-size copy, ratio to torch._grouped_mm BF16 in the same run
    and to the public Marlin figures (71.5 / 177 / 844 us at TP8)."""
    import torch

    from k3gen.ops.moe_experts.launcher import MoeExperts
    from k3gen.ops.moe_experts.spec import ActFormat, MoeExpertsSpec, WeightFormat
    from k3gen.targets import get_target

    sm90 = get_target("sm90")
    rows, same = [], {}
    g = torch.Generator().manual_seed(0)
    gd = torch.Generator(device="cuda").manual_seed(0)
    combos = [(WeightFormat.MXFP4, ActFormat.BF16)] if quick else \
        [(WeightFormat.MXFP4, ActFormat.BF16), (WeightFormat.NVFP4, ActFormat.BF16), (WeightFormat.MXFP4, ActFormat.FP8)]
    for shape, kw in SHAPES.items():
        base = EP_BASE if shape == "ep8" else 0
        peer_w = None
        for fmt, act in combos:
            spec = MoeExpertsSpec(target=sm90, weights=fmt, act=act, **kw)
            op = MoeExperts(spec).load()
            w = _weights(spec, gd)
            if peer_w is None:   # BF16 experts for the peer, [E, K, N] views of [E, N, K] rows
                E, W, I = spec.experts, spec.hidden, spec.inter
                peer_w = (torch.randn(E, 2 * I, W, device="cuda", generator=gd).to(torch.bfloat16) * 0.02,
                          torch.randn(E, W, I, device="cuda", generator=gd).to(torch.bfloat16) * 0.02)
            for T in (1, 8, 64):
                probe = [_route(spec, T, g, base) for _ in range(4)]
                per_set = max(1, sum(p["touched"] for p in probe) // 4) * spec.weight_bytes_per_expert()
                sets = probe + [_route(spec, T, g, base) for _ in range(max(0, sets_for(per_set) - 4))]
                ws = op.workspace(T)
                xs = []
                for _ in sets:
                    x = torch.randn(T, spec.hidden, device="cuda", generator=gd).to(torch.bfloat16)
                    if act is ActFormat.FP8:
                        from k3gen.numerics import fp8_group_quantize
                        xs.append(fp8_group_quantize(x.float(), 128, spec.recipe))
                    else:
                        xs.append((x, None))
                out = torch.empty(T, spec.hidden, dtype=torch.bfloat16, device="cuda")
                launches = [lambda r=r, xx=xx: op(xx[0], w["w13"], w["s13"], w["w2"], w["s2"], r["dev"], out,
                                                  gs13=w["gs13"], gs2=w["gs2"], x_scales=xx[1], ws=ws,
                                                  expert_base=base)
                            for r, xx in zip(sets, xs)]
                us = time_graph(launches)
                nbytes = sum(r["touched"] for r in sets) * spec.weight_bytes_per_expert() // len(sets)
                peer_us = None
                if act is ActFormat.BF16 and fmt is WeightFormat.MXFP4:
                    o32 = torch.empty(T, spec.hidden, device="cuda")
                    w13t, w2t = peer_w[0].transpose(-2, -1), peer_w[1].transpose(-2, -1)
                    xb = [torch.randn(T, spec.hidden, device="cuda", generator=gd).to(torch.bfloat16) for _ in sets]
                    try:
                        peer_us = time_graph([lambda r=r, x=x: _torch_moe(x, w13t, w2t, r, spec, o32)
                                              for r, x in zip(sets, xb)])
                    except (RuntimeError, NotImplementedError) as e:   # reported, not fatal
                        print(f"moe_experts: torch._grouped_mm peer failed at {shape} T{T}: {e}")
                row = make_row("moe_experts", f"{shape} {fmt.value}-{act.value} T{T}", us, nbytes, ceiling, same,
                               peer="torch._grouped_mm bf16" if peer_us else "", peer_us=peer_us)
                row.extra["touched_experts"] = nbytes // spec.weight_bytes_per_expert()
                if shape == "tp8" and T in MARLIN_TP8_US:
                    row.extra["marlin_public_us"] = MARLIN_TP8_US[T]
                    row.extra["x_marlin_public"] = MARLIN_TP8_US[T] / us
                rows.append(row)
                del sets, xs, launches, ws
            del w, op
        del peer_w
        torch.cuda.empty_cache()
    return rows


# -- Blackwell (B300) projection: no Blackwell GPU exists here, so these are computed, never measured ----
B300_SMS = 148             # SMs the projection assumes (the fp8_block_gemm_b300 plans use the same)
B300_ISSUE = 4 * 32 * 1.9e9   # lane-instructions per second per SM: 4 schedulers x 32 lanes at 1.9 GHz
# Issue slots per decoded weight value in the tcgen05 kernel's decode loop, from its SASS per 32-value
# segment: 16 F2FP.BF16.E2M1 + 16 HMUL2/HFMA2 + 4 STS.128 + LDS.128, the scale byte and ~10 address /
# loop instructions = ~48. Assumes F2FP issues at full rate (not known for Blackwell: none here).
B300_DECODE_SLOTS = 48 / 32


def touched_experts(spec, T: int) -> float:
    """Expected distinct local experts T tokens touch with top_k of route_experts picked uniformly
    (PERF.md's touched bytes at TP8: 16 / 120 / 614 experts at T1 / T8 / T64)."""
    k, R = spec.top_k, spec.route_experts
    return spec.experts * (1 - (1 - k / R) ** T)


def b300_moe_projection(spec, T: int) -> dict:
    """Projected B300 time of the sm103 tcgen05 kernel at T tokens: the largest of (a) its bytes at
    8 TB/s: the touched experts' packed weights and scales, x, h written and read (BF16), the FP32
    partials written and read, the BF16 out; (b) the MMA work it issues (kind::f16, 64 weight rows x
    N = 8 n_tiles tokens per item, padded) at the assumed dense BF16 rate; (c) the decode's issue
    slots (B300_DECODE_SLOTS per weight value) over B300_SMS SMs. Items: each touched expert's local
    slots in items of N. No wave or per-SM model: at T1 the TP8 gate_up has 16 x 12 tiles for 148 SMs
    with one CTA each, so some SMs stream two tiles while others idle."""
    from bench.cases.mla_decode import B300_F16_FLOPS, B300_TBPS
    from math import ceil
    W, I, k = spec.hidden, spec.inter, spec.top_k
    touched = touched_experts(spec, T)
    slots = T * k * spec.experts / spec.route_experts          # expected local slots
    nb = spec.tokens_per_item
    items = touched * ceil(slots / max(touched, 1e-9) / nb) if touched else 0.0
    wbytes = touched * spec.weight_bytes_per_expert()
    xbytes = T * W * (2 if spec.act.value == "bf16" else 1 + 4 / 128)
    nbytes = wbytes + xbytes + slots * (2 * I * 2 + 2 * W * 4) + T * W * 2
    flops = items * 2 * nb * (2 * I * W + W * I)
    values = touched * 3 * W * I
    mem_us, mma_us = nbytes / B300_TBPS * 1e6, flops / B300_F16_FLOPS * 1e6
    dec_us = values * B300_DECODE_SLOTS / (B300_SMS * B300_ISSUE) * 1e6
    bound = max((mem_us, "memory"), (mma_us, "MMA"), (dec_us, "decode"))
    return {"bytes": nbytes, "weight_bytes": wbytes, "touched": touched, "items": items, "mem_us": mem_us,
            "mma_us": mma_us, "decode_us": dec_us, "proj_us": bound[0], "bound": bound[1]}


@case(device="cpu")
def moe_experts_b300(quick: bool = False) -> list:
    """Projected B300 times of the sm103 tcgen05 moe_experts at K3 TP8 / EP8, T = 1, 8, 64 (computed,
    not measured)."""
    from k3gen.ops.moe_experts.spec import MoeExpertsSpec, WeightFormat
    from k3gen.targets import get_target
    tgt = get_target("sm103")
    rows = []
    print(f"{'case':<24} {'experts':>7} {'MB':>8} {'mem us':>8} {'MMA us':>8} {'dec us':>8} {'proj us':>8}  bound"
          "  (B300 projection, not measured)")
    for shape, kw in SHAPES.items():
        for fmt in ((WeightFormat.MXFP4,) if quick else tuple(WeightFormat)):
            spec = MoeExpertsSpec(target=tgt, weights=fmt, **kw)
            for T in (1, 8, 64):
                p = b300_moe_projection(spec, T)
                name = f"{shape} {fmt.value}-bf16 T{T}"
                print(f"{name:<24} {p['touched']:7.1f} {p['bytes'] / 1e6:8.1f} {p['mem_us']:8.2f} {p['mma_us']:8.2f}"
                      f" {p['decode_us']:8.2f} {p['proj_us']:8.2f}  {p['bound']}")
                rows.append({"case": name, "seconds": p["proj_us"] * 1e-6,
                             "detail": f"projected {p['proj_us']:.2f} us ({p['bound']}-bound; not measured)", **p})
    return rows
