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
    return out
