"""model.mla_attention: the vectorized page dequantization equals k3gen's gather_rows (the
kv_cache_write reference's read-back) for every KV format, and the per-query NVFP4 view takes the
incomplete tile from the HP tail ring."""
from __future__ import annotations

import pytest
import torch

from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ir.layouts import KvLayout
from k3gen.ops.kv_cache_write.reference import alloc_cache, gather_rows, kv_cache_write
from model.mla_attention import dequant_pages, paged_mla_attention, query_rows

LAYOUTS = [KvLayout(kv=KvDtype.BF16, page=64),
           KvLayout(kv=KvDtype.FP8, page=64),
           KvLayout(kv=KvDtype.FP8, page=64, fp8_scales=Fp8ScaleGranularity.PER_TENSOR),
           KvLayout(kv=KvDtype.NVFP4, page=128, max_drafts=3),
           KvLayout(kv=KvDtype.NVFP4, page=128, max_drafts=3, scale_layout=ScaleLayout.SWIZZLE_128X4)]


def _filled(layout, lengths, seed, scale):
    g = torch.Generator().manual_seed(seed)
    pages_per = max(-(-n // layout.page) for n in lengths)
    cache = alloc_cache(layout, len(lengths) * pages_per + 1, len(lengths) + 1)
    perm = torch.randperm(len(lengths) * pages_per, generator=g).to(torch.int32)
    bt = perm.view(len(lengths), pages_per)
    rows = (torch.randn(sum(lengths), 576, generator=g) * 2).to(torch.bfloat16)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    kv_cache_write(layout, cache, rows, cu, torch.zeros(len(lengths), dtype=torch.int32), bt,
                   torch.arange(len(lengths), dtype=torch.int32), scale)
    return cache, bt, rows, cu


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: str(l.canonical()))
def test_dequant_pages_equals_gather_rows(layout):
    lengths = [37, 150, 5]
    scale = 0.05 if layout.kv is KvDtype.FP8 else 2688 / 30
    cache, bt, _, _ = _filled(layout, lengths, 1, scale)
    got = dequant_pages(layout, cache, bt, scale)
    for b, n in enumerate(lengths):
        want = gather_rows(layout, cache, bt[b], n, ring_slot=b, scale=scale, use_tail=False)
        torch.testing.assert_close(got[b, :n], want, rtol=0, atol=0)
        if layout.kv is KvDtype.NVFP4:  # the per-query view swaps in the exact ring rows of the live tile
            q = query_rows(layout, cache, bt[b:b + 1], torch.tensor([n - 1]), 1, torch.tensor([b]), scale)
            tail = gather_rows(layout, cache, bt[b], n, ring_slot=b, scale=scale, use_tail=True)
            torch.testing.assert_close(q[0, 0, :n], tail, rtol=0, atol=0)


def test_attention_matches_dense_softmax():
    layout = LAYOUTS[0]
    cache, bt, rows, cu = _filled(layout, [20, 9], 2, 1.0)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 3, 576, generator=g)
    start = torch.tensor([18, 7])
    o = paged_mla_attention(layout, q, cache, bt, start, None, 1.0)
    for b in range(2):
        for t in range(2):
            L = int(start[b]) + t + 1
            r = rows[int(cu[b]):int(cu[b]) + L].float()
            p = torch.softmax(q[b, t] @ r.T / 192 ** 0.5, -1)
            torch.testing.assert_close(o[b, t], p @ r[:, :512], rtol=1e-5, atol=1e-5)


def test_ref_q_absorb_matches_reference_function():
    """RefOps.q_absorb caches Q-B's dequantized weight; it must equal reference.mla_q_absorb."""
    from k3gen.ir.dtypes import ScaleRecipe
    from k3gen.ops.fp8_block_gemm.reference import quantize_weights
    from k3gen.ops.mla_q_absorb.reference import mla_q_absorb
    from model.ops import RefOps
    from model.weights import Fp8Linear
    g = torch.Generator().manual_seed(4)
    H = 2
    for recipe in ScaleRecipe:
        codes, scales = quantize_weights(torch.randn(H * 192, 1536, generator=g) * 0.03, recipe)
        q_a = torch.randn(3, 1536, generator=g).to(torch.bfloat16)
        norm_w = (1 + 0.1 * torch.randn(1536, generator=g)).to(torch.bfloat16)
        w_uk = (torch.randn(H, 128, 512, generator=g) * 0.05).to(torch.bfloat16)
        got = RefOps(recipe).q_absorb(q_a, norm_w, Fp8Linear(codes, scales, recipe), w_uk)
        want = mla_q_absorb(q_a, norm_w, codes, scales, w_uk, recipe)
        torch.testing.assert_close(got.float(), want, rtol=0, atol=0)
