"""kv_cache_write: the paged MLA cache write (BF16, FP8 per-token and per-tensor, NVFP4) vs torch index_copy_."""
from __future__ import annotations

from bench.harness import case, make_row, sets_for, time_graph
from k3gen.ir.dims import evaluate


@case
def kv_cache_write(ceiling: float, quick: bool = False) -> list:
    """Paged cache write of B sequences x T rows (BF16, FP8 per-token-128 and per-tensor, NVFP4);
    the BF16 rows against torch index_copy_ of the same rows."""
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
