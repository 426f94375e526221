"""Representative inputs for every `k3gen::` op (tests/nogpu/library on the CPU, where the ops run
the FP32 references, and tests/gpu/test_library.py on the H200, where they launch kernels).

`cases(device, ...)` builds, per op, the handle's spec and one argument tuple with fresh random
values that satisfy the op's contract (distinct live slots and a padded row, valid cu_seqlens and
block tables, a cache already holding rows), plus the shapes and dtypes the FP32 reference gives.
GPU specs must be in the prebuilt bundle: the defaults are the small model's (tests/gpu/specs.py
model_small: 12 heads, NVFP4 KV with 3 drafts and BF16 SSM, or BF16 KV and FP32 SSM).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3gen.ir.dtypes import KvDtype, ScaleRecipe, SsmDtype
from k3gen.targets import get_target

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32


@dataclass
class Case:
    op: str              # the k3gen:: op name
    spec: object
    args: tuple          # handle first
    outs: list           # (shape, dtype) of each output (functional ops) or of `out=` (the _out ops)
    mutated: tuple = ()  # argument names the op declares mutated

    @property
    def overload(self):
        import k3gen.library  # noqa: F401
        return getattr(torch.ops.k3gen, self.op).default


def _g(seed):
    return torch.Generator().manual_seed(seed)


def kda_pools(spec, S, g, drafts=0):
    from k3gen.ir.layouts import KDA_DK, KDA_DV
    H, D = spec.heads, spec.d
    sdt = F32 if spec.ssm is SsmDtype.FP32 else BF16
    pools = {"ssm": (torch.randn(S, H, KDA_DV, KDA_DK, generator=g) * 0.1).to(sdt),
             "conv": torch.randn(S, 3 * D, 3, generator=g).to(BF16)}
    if drafts:
        pools["draft_rec"] = torch.randn(S, drafts, H, KDA_DV, KDA_DK, generator=g) * 0.1
        pools["conv_ext"] = torch.randn(S, 3 * D, 3 + drafts, generator=g)
        pools["pending"] = torch.randint(0, drafts + 1, (S,), generator=g, dtype=I32)
    return pools


def kda_rows(spec, n, g):
    H, D = spec.heads, spec.d
    wide = torch.randn(n, 4 * D + 64, generator=g).to(BF16)          # a row stride wider than 4D
    fab = torch.randn(n, 128 + H + 8, generator=g).to(BF16)          # [f_a | b | pad]: views
    return wide, fab[:, :128], fab[:, 128:128 + H]


def kda_weights(heads, g):
    from k3gen.ops.kda_decode.reference import random_weights
    w = random_weights(heads, generator=g)
    return (w.conv_w, w.fb_w, w.dt_bias, w.a_log, w.norm_w)


def kv_setup(spec, B, g, T=1, lens=None):
    """A cache holding `lens` rows per sequence (written by the reference), its block table, ring slots."""
    from k3gen.ops.kv_cache_write.reference import alloc_cache, kv_cache_write as ref_write
    layout = spec.layout
    lens = lens or [40 + 37 * b for b in range(B)]
    per = max(-(-(n + 8) // layout.page) for n in lens) + 1
    num_pages = B * per + 2
    perm = torch.randperm(num_pages, generator=g)[:B * per].to(I32)
    bt = perm.view(B, per).contiguous()
    ring = torch.randperm(B + 2, generator=g)[:B].to(I32)
    cache = alloc_cache(layout, num_pages, B + 2)
    rows = (torch.randn(sum(lens), 576, generator=g) * 2).to(BF16)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32)
    scale = 2688.0 / 30.0 if layout.kv is KvDtype.NVFP4 else 1.0
    ref_write(layout, cache, rows, cu, torch.zeros(B, dtype=I32), bt, ring if layout.kv is KvDtype.NVFP4 else None,
              scale)
    return cache, bt, ring, scale, lens


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x


def cases(device="cpu", heads=12, kv=KvDtype.BF16, ssm=SsmDtype.FP32, drafts=3, recipe=ScaleRecipe.FP32,
          seed=0, hidden=1024) -> list[Case]:
    """One Case per k3gen:: op (functional and _out forms)."""
    from k3gen.library.table import handle_of
    from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec
    from k3gen.ops.fp8_block_gemm.reference import quantize_activations, quantize_weights
    from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
    from k3gen.ops.kda_decode.spec import KdaDecodeSpec
    from k3gen.ops.kda_prefill.spec import KdaPrefillSpec
    from k3gen.ops.kda_verify.spec import KdaVerifySpec
    from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    from k3gen.ops.mla_q_absorb.spec import MlaQAbsorbSpec
    from k3gen.ops.mla_vb_gate.spec import MlaVbGateSpec
    from k3gen.targets import mla_decode_spec, serving_kv_layout, ServingOptions
    tgt = get_target("sm90")
    g = _g(seed)
    H, B = heads, 3
    out: list[Case] = []

    def add(op, spec, args, outs, mutated=()):
        out.append(Case(op, spec, (handle_of(spec),) + _to(tuple(args), device), outs, mutated))

    sdt = F32 if recipe is ScaleRecipe.FP32 else torch.uint8
    # act_quant_fp8 / fp8_block_gemm: K = the hidden width, N = the fused q|k|v|g projection of 12 heads
    aq = ActQuantFp8Spec(target=tgt, k=hidden, recipe=recipe)
    x = torch.randn(5, hidden, generator=g).to(BF16)
    add("act_quant_fp8", aq, (x,), [((5, hidden), torch.uint8), ((5, hidden // 128), sdt)])
    add("act_quant_fp8_out", aq, (x, torch.empty(5, hidden, dtype=torch.uint8), torch.empty(5, hidden // 128, dtype=sdt)),
        [], ("codes", "scales"))
    n = 6144 if hidden == 1024 and heads == 12 else 4 * heads * 128
    gm = Fp8BlockGemmSpec(target=tgt, n=n, k=hidden, recipe=recipe)
    xc, xs = quantize_activations(x, recipe)
    wc, ws = quantize_weights(torch.randn(n, hidden, generator=g) * 0.05, recipe)
    add("fp8_block_gemm", gm, (xc, xs, wc, ws), [((5, n), BF16)])
    add("fp8_block_gemm_out", gm, (xc, xs, wc, ws, torch.empty(5, n, dtype=BF16)), [], ("out",))

    # KDA: S = B + 2 slots, one padded row (slot -1)
    S = B + 2
    w = kda_weights(H, g)
    dec = KdaDecodeSpec(target=tgt, heads=H, ssm=ssm)
    qkvg, fa, beta = kda_rows(dec, B, g)
    slots = torch.tensor([3, -1, 0], dtype=I32)
    p = kda_pools(dec, S, g)
    dargs = (qkvg, fa, beta, p["ssm"], p["conv"], slots, *w)
    add("kda_decode", dec, dargs, [((B, H, 128), BF16)], ("ssm", "conv"))
    add("kda_decode_out", dec, dargs + (torch.empty(B, H, 128, dtype=BF16),), [], ("ssm", "conv", "out"))
    pre = KdaPrefillSpec(target=tgt, heads=H, ssm=ssm)
    lens = [5, 0, 18]
    N = sum(lens)
    qkvg, fa, beta = kda_rows(pre, N, g)
    cu = torch.tensor([0, 5, 5, 23], dtype=I32)
    resume = torch.tensor([1, 0, 0], dtype=I32)
    p = kda_pools(pre, S, g)
    pargs = (qkvg, fa, beta, cu, torch.tensor([2, 4, 0], dtype=I32), resume, p["ssm"], p["conv"], *w)
    add("kda_prefill", pre, pargs, [((N, H, 128), BF16)], ("ssm", "conv"))
    add("kda_prefill_out", pre, pargs + (torch.empty(N, H, 128, dtype=BF16),), [], ("ssm", "conv", "out"))
    ver = KdaVerifySpec(target=tgt, heads=H, drafts=drafts, ssm=ssm)
    T = 1 + drafts
    qkvg, fa, beta = kda_rows(ver, B * T, g)
    p = kda_pools(ver, S, g, drafts)
    vargs = (qkvg, fa, beta, p["ssm"], p["draft_rec"], p["conv_ext"], p["pending"], slots, *w)
    add("kda_verify", ver, vargs, [((B, T, H, 128), BF16)], ("ssm", "draft_rec", "conv_ext"))
    add("kda_verify_out", ver, vargs + (torch.empty(B, T, H, 128, dtype=BF16),), [],
        ("ssm", "draft_rec", "conv_ext", "out"))

    # MLA over the serving KV layout of (kv, drafts)
    layout = serving_kv_layout(tgt, ServingOptions(kv=kv, ssm=ssm, max_drafts=drafts if kv is KvDtype.NVFP4 else 0))
    kw = KvCacheWriteSpec(target=tgt, kv=layout.kv, fp8_scales=layout.fp8_scales, max_drafts=layout.max_drafts)
    cache, bt, ring, scale, ctx = kv_setup(kw, B, g)
    names = list(layout.tensors())
    rows = (torch.randn(B, 576, generator=g) * 2).to(BF16)
    nv = layout.kv is KvDtype.NVFP4
    add("kv_cache_write", kw, (rows, torch.arange(B + 1, dtype=I32), torch.tensor(ctx, dtype=I32), bt,
                               [cache[k] for k in names], ring if nv else None, scale, 1), [], ("cache",))
    md = mla_decode_spec(tgt, H, layout, 1)
    q = (torch.randn(B, 1, H, 576, generator=g) * 0.5).to(BF16)
    lengths = torch.tensor(ctx, dtype=I32)
    splits = 2
    part_o = torch.empty(B, splits, H, 512, dtype=F32)
    part_lse = torch.empty(B, splits, H, dtype=F32)
    margs = (q, [cache[k] for k in names], bt, lengths, ring if nv else None, scale, splits, part_o, part_lse)
    add("mla_decode", md, margs, [((B, 1, H, 512), BF16)], ("part_o", "part_lse"))
    add("mla_decode_out", md, margs + (torch.empty(B, 1, H, 512, dtype=BF16),), [], ("part_o", "part_lse", "out"))
    qa = MlaQAbsorbSpec(target=tgt, heads=H, recipe=recipe)
    g_ = qa.gemm_spec
    q_a = torch.randn(B, 1536 + 640, generator=g).to(BF16)
    qwc, qws = quantize_weights(torch.randn(g_.n, g_.k, generator=g) * 0.03, recipe)
    kv_b = (torch.randn(H, 256, 512, generator=g) * 0.05).to(BF16)
    qargs = (q_a, (1 + 0.1 * torch.randn(1536, generator=g)).to(BF16), qwc, qws, kv_b[:, :128])
    add("mla_q_absorb", qa, qargs, [((B, H, 576), BF16)])
    add("mla_q_absorb_out", qa, qargs + (torch.empty(B, H, 576, dtype=BF16),), [], ("out",))
    vb = MlaVbGateSpec(target=tgt, heads=H)
    o_lat = (torch.randn(B, H, 512, generator=g) * 0.5).to(BF16)
    gate = torch.randn(B, H * 128 + 64, generator=g).to(BF16)
    add("mla_vb_gate", vb, (o_lat, kv_b[:, 128:], gate), [((B, H, 128), BF16)])
    add("mla_vb_gate_out", vb, (o_lat, kv_b[:, 128:], gate, torch.empty(B, H, 128, dtype=BF16)), [], ("out",))
    # mla_prefill: a varlen batch with a cached prefix (3 + 5 keys for 5 queries), an empty
    # sequence and a plain prompt; strided q rows (the q projection's view) and the model's FP32 out
    from k3gen.ops.mla_prefill.spec import MlaPrefillSpec
    mp = MlaPrefillSpec(target=tgt, heads=H if H in (6, 12, 96) else 12)
    Hp = mp.heads
    cq, ck = torch.tensor([0, 5, 5, 12], dtype=I32), torch.tensor([0, 8, 8, 15], dtype=I32)
    qp = (torch.randn(12, Hp, 192 + 8, generator=g) * 0.5).to(BF16)[..., :192]
    kn = (torch.randn(15, Hp, 128, generator=g) * 0.5).to(BF16)
    kp = (torch.randn(15, 64, generator=g) * 0.5).to(BF16)
    vv = torch.randn(15, Hp, 128, generator=g).to(BF16)
    add("mla_prefill", mp, (qp, kn, kp, vv, cq, ck, 7), [((12, Hp, 128), F32)])
    add("mla_prefill_out", mp, (qp, kn, kp, vv, cq, ck, 7, _nan(12, Hp, 128)), [], ("out",))
    # glu_act at a width of tests/gpu/specs.py's glu_act() list
    from k3gen.ops.glu_act.spec import GluActSpec
    ga = GluActSpec(target=tgt, inter=256, recipe=recipe)
    gu = (torch.randn(4, 512, generator=g) * 2).to(BF16)
    add("glu_act", ga, (gu,), [((4, 256), torch.uint8), ((4, 2), sdt)])
    add("glu_act_out", ga, (gu, torch.empty(4, 256, dtype=torch.uint8), torch.empty(4, 2, dtype=sdt)), [],
        ("codes", "scales"))
    # router_logits at tests/gpu/specs.py's ragged shape (256 x 5)
    from k3gen.ops.router_logits.spec import RouterLogitsSpec
    rl = RouterLogitsSpec(target=tgt, hidden=256, experts=5)
    rx = (torch.randn(3, 256, generator=g) * 2).to(BF16)
    rw = torch.randn(5, 256, generator=g).to(BF16)
    add("router_logits", rl, (rx, rw), [((3, 5), F32)])
    add("router_logits_out", rl, (rx, rw, _nan(3, 5)), [], ("out",))
    ffn_cases(add, tgt, g, kv)
    return out


def _nan(*shape, dtype=F32):
    return torch.full(shape, float("nan"), dtype=dtype)


def ffn_cases(add, tgt, g, kv) -> None:
    """moe_route, attn_res, moe_experts at specs of tests/gpu/specs.py's moe_route(), attn_res() and
    moe_experts() lists (the prebuilt bundle), chosen by the KV dtype so the three CPU combos of
    tests/nogpu/library cover grouped / plain / unnormalized routing, FP8 / BF16 mixes with FP32 /
    BF16 / no delta, and MXFP4 / NVFP4 experts with BF16 / FP8 activations and EP."""
    from k3gen.ops.act_quant_fp8.reference import act_quant_fp8
    from k3gen.ops.attn_res.spec import AttnResSpec, ResDelta
    from k3gen.ops.moe_experts.spec import ActFormat, MoeExpertsSpec, WeightFormat
    from k3gen.ops.moe_route.reference import grouped_order
    from k3gen.ops.moe_route.spec import MoeRouteSpec
    nv, fp8 = kv is KvDtype.NVFP4, kv is KvDtype.FP8

    # moe_route: strided logits rows (a row stride wider than E, a multiple of 4); the _out form
    # into a workspace sized for more tokens than this call routes (zeros: rows past T stay)
    if nv:
        rs = MoeRouteSpec(target=tgt, experts=256, top_k=8, n_group=8, topk_group=4, routed_scale=2.5)
    elif fp8:
        rs = MoeRouteSpec(target=tgt, experts=64, top_k=6, renormalize=False, routed_scale=1.5)
    else:
        rs = MoeRouteSpec(target=tgt, experts=32, top_k=4)
    E, k, T, T_max = rs.experts, rs.top_k, 5, 7
    logits = (torch.randn(T, E + 8, generator=g) * 2)[:, :E]
    bias = torch.randn(E, generator=g) * 0.1
    outs = [((T, k), I32), ((T, k), F32), ((E,), I32), ((E + 1,), I32), ((T * k,), I32), ((T * k,), I32)]
    add("moe_route", rs, (logits, bias), outs)
    ws = (torch.zeros(T_max, k, dtype=I32), torch.zeros(T_max, k), torch.zeros(E, dtype=I32),
          torch.zeros(E + 1, dtype=I32), torch.zeros(T_max * k, dtype=I32), torch.zeros(T_max * k, dtype=I32))
    add("moe_route_out", rs, (logits, bias) + ws, [], ("ids", "weights", "counts", "offsets", "perm", "inv"))

    # attn_res: a source buffer of more rows than M (the functional form mixes a row slice), n
    # valid sources of max_sources; functional without seal, _out with it (a spec with delta)
    if nv:
        ar, n = AttnResSpec(target=tgt, hidden=7168, fp8=False, delta=ResDelta.BF16), 5
    elif fp8:
        ar, n = AttnResSpec(target=tgt, hidden=2304, max_sources=3, recipe=ScaleRecipe.UE8M0), 3
    else:
        ar, n = AttnResSpec(target=tgt, hidden=1024, max_sources=4, delta=ResDelta.FP32), 3
    h, M = ar.hidden, 3
    src = torch.randn(ar.max_sources, M + 2, h, generator=g) * (1 + torch.rand(ar.max_sources, 1, 1, generator=g))
    query = torch.randn(h, generator=g) * 0.05
    norm_w = (1 + 0.1 * torch.randn(h, generator=g)).to(BF16)
    delta = None if ar.delta is ResDelta.NONE else \
        (torch.randn(M, h, generator=g) * 0.5).to(BF16 if ar.delta is ResDelta.BF16 else F32)
    rows = M if ar.fp8 else 0
    sdt = F32 if not ar.fp8 or ar.recipe is ScaleRecipe.FP32 else torch.uint8
    mixed = not nv
    add("attn_res", ar, (src.clone()[:, :M], n, query, norm_w, delta, False, mixed),
        [((M, h), BF16), ((rows, h), torch.uint8), ((rows, h // 128), sdt), ((M if mixed else 0, h), F32)], ("src",))
    codes = torch.full((M, h), 0xFF, dtype=torch.uint8) if ar.fp8 else None
    scales = (_nan(M, h // 128) if sdt is F32 else torch.full((M, h // 128), 0xFF, dtype=torch.uint8)) \
        if ar.fp8 else None
    add("attn_res_out", ar, (src, n, query, norm_w, delta, delta is not None, codes, scales,
                             _nan(M, h) if mixed else None, _nan(M, h, dtype=BF16)), [],
        ("src", "codes", "scales", "mixed", "out"))

    # moe_experts: packed experts as loaded (random codes, scales keeping |w| ~ 0.01 .. 0.1), routing
    # as moe_route writes it (k distinct experts per token)
    small = dict(hidden=512, inter=128, experts=32, top_k=4)
    if nv:
        me = MoeExpertsSpec(target=tgt, weights=WeightFormat.NVFP4, act=ActFormat.FP8, recipe=ScaleRecipe.UE8M0,
                            **small)
        base = 0
    elif fp8:   # EP: this rank's 8 experts of a 32-expert router
        me = MoeExpertsSpec(target=tgt, weights=WeightFormat.MXFP4, hidden=512, inter=128, experts=8,
                            route_experts=32, top_k=4)
        base = 16
    else:
        me = MoeExpertsSpec(target=tgt, weights=WeightFormat.MXFP4, **small)
        base = 0
    E, W, I, k, R, gs, T = me.experts, me.hidden, me.inter, me.top_k, me.route_experts, me.group, 3
    w13 = torch.randint(0, 256, (E, 2 * I, W // 2), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, W, I // 2), generator=g, dtype=torch.uint8)
    lo, hi = (119, 123) if me.weights is WeightFormat.MXFP4 else (0x30, 0x60)
    s13 = torch.randint(lo, hi, (E, 2 * I, W // gs), generator=g, dtype=torch.uint8)
    s2 = torch.randint(lo, hi, (E, W, I // gs), generator=g, dtype=torch.uint8)
    gs13 = gs2 = None
    if me.weights is WeightFormat.NVFP4:
        # E4M3 scale bytes stay uint8: opcheck's schema check compares inputs with allclose, which
        # float8_e4m3fn lacks (tests/nogpu/library/test_ffn_ops.py runs the float8 view)
        gs13 = torch.rand(E, 2, generator=g) * 2e-3 + 5e-4
        gs2 = torch.rand(E, 1, generator=g) * 2e-3 + 5e-4
    x = (torch.randn(T, W, generator=g) * 2).to(BF16)
    xs = None
    if me.act is ActFormat.FP8:
        x, xs = act_quant_fp8(x, me.recipe)
    scores = torch.rand(T, R, generator=g)
    scores[0, base] = 2.0                                  # token 0 picks this rank's first expert
    ids = scores.topk(k, dim=1).indices.int()
    _, offsets, perm, _ = grouped_order(ids, R)
    weights = torch.rand(T, k, generator=g) / k
    ws = (_nan(T * k + 4, I, dtype=BF16), _nan(T * k + 4, W))
    margs = (x, w13, s13, w2, s2, ids, weights, offsets, perm, gs13, gs2, xs, base) + ws
    f32 = not fp8
    add("moe_experts", me, margs + (f32,), [((T, W), BF16), ((T if f32 else 0, W), F32)], ("ws_h", "ws_y"))
    add("moe_experts_out", me, margs + (_nan(T, W) if nv else None, _nan(T, W, dtype=BF16)), [],
        ("ws_h", "ws_y", "out_f32", "out"))
