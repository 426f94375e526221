"""Benchmark cases of mla_decode (`k3gen bench --op mla_decode`).

Bytes are the KV bytes the kernel must read (MlaDecodeSpec.kv_bytes: codes + scales, NVFP4 also
its HP tail rows); % of copy is on those. The peer is the naive absorbed PyTorch decode over a
dense, already-gathered BF16 KV (bmm, FP32 softmax, bmm; no paging, no causal mask: both favour
the peer). FP8/NVFP4 rows carry `x_bf16`, the speed-up over the fastest BF16-KV kernel at the same shape.
Every KV dtype runs both schedules (column `schedule`): the mma.sync kernel and the sm_90a wgmma one
("wgmma_qm" for BF16: query rows on the wgmma M side; "wgmma" for FP8/NVFP4); wgmma rows carry
`x_mma`, their speed-up over the mma.sync row of the same KV dtype and shape, and NVFP4 rows
`x_fp8`, over the faster FP8 row of the shape.

`k3gen bench --op mla_decode_bars`: the bars' memory-bound H = 12 shapes, B in {32, 128} x L in {8K,
32K}, every KV dtype through mma.sync, BF16 also through wgmma_qm, FP8 and NVFP4 through wgmma.

`k3gen bench --op mla_decode_heads`: BF16 KV through both schedules over H in HEADS_SWEEP (T = 1,
L = 8K, B = 32 and 128): the measurements behind MlaDecodeSpec's schedule="auto" for BF16 KV.
"""
from __future__ import annotations

from bench.harness import case, make_row, sets_for, time_graph
from k3gen.ir.dims import evaluate

HEADS = (12, 96, 128)
BATCHES = (1, 32, 128)
LENGTHS = (1024, 8192, 32768)
TOKENS = (1, 4)
HEADS_SWEEP = (12, 16, 32, 64, 96, 128)
SCHEDULES = ("mma", "wgmma_qm")   # BF16 KV
MAX_SET_BYTES = 12 * 2**30     # skip shapes whose input sets would not fit comfortably


def _kv_formats():
    from k3gen.ir.dtypes import KvDtype
    return ((KvDtype.BF16, {}), (KvDtype.FP8, {}), (KvDtype.NVFP4, {"max_drafts": 3}))


def bench_specs(quick: bool = False) -> list:
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    from k3gen.targets import get_target
    tgt = get_target("sm90")
    heads, tokens = ((12, 128), (1,)) if quick else (HEADS, TOKENS)
    # Explicit schedules: the "bf16" rows are mma.sync, the "bf16-wgmma_qm" rows wgmma_qm, whatever the
    # default ("auto") picks for the shape.
    specs = [MlaDecodeSpec(target=tgt, heads=h, tokens=t, kv=kv, schedule="mma", **kw)
             for kv, kw in _kv_formats() for h in heads for t in tokens]
    # The wgmma schedule right after the BF16 rows; FP8 through wgmma (16 query rows per CTA, more
    # rows as more CTAs) after all mma.sync rows, so its x_mma and x_bf16 find their baselines.
    return specs[:len(heads) * len(tokens)] + [
        MlaDecodeSpec(target=tgt, heads=h, tokens=t, schedule="wgmma_qm") for h in heads for t in tokens
    ] + specs[len(heads) * len(tokens):] + [
        MlaDecodeSpec(target=tgt, heads=h, tokens=t, kv=kv, schedule="wgmma", **kw)
        for kv, kw in _kv_formats()[1:] for h in heads for t in tokens]


def _random_cache(spec, num_pages: int, B: int, gen) -> dict:
    """Finite random contents in every format (E4M3 codes avoid the NaN pattern)."""
    import torch

    from k3gen.ops.kv_cache_write.reference import alloc_cache
    cache = alloc_cache(spec.layout, num_pages, B, "cuda")
    for name, t in cache.items():
        if t.dtype == torch.bfloat16:
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen))
        elif t.dtype == torch.float32:
            t.copy_(torch.rand(t.shape, device="cuda", generator=gen) * 0.02)
        elif name in ("kv_codes",) and spec.kv.value == "fp8":
            t.copy_(torch.randint(0, 0x7E, t.shape, device="cuda", generator=gen, dtype=torch.uint8) |
                    (torch.randint(0, 2, t.shape, device="cuda", generator=gen, dtype=torch.uint8) << 7))
        elif name == "kv_codes":
            t.copy_(torch.randint(0, 256, t.shape, device="cuda", generator=gen, dtype=torch.uint8))
        else:   # NVFP4 E4M3 scales: a finite, moderate range
            t.copy_(torch.randint(0x30, 0x50, t.shape, device="cuda", generator=gen, dtype=torch.uint8))
    return cache


def _naive(q, kv, T: int, H: int):
    """The absorbed decode as plain PyTorch: scores by bmm, FP32 softmax, bmm."""
    import torch
    B = q.shape[0]
    s = torch.bmm(q.view(B, T * H, 576), kv.transpose(1, 2)).float() * 192 ** -0.5
    p = torch.softmax(s, dim=-1).to(torch.bfloat16)
    return torch.bmm(p, kv[:, :, :512])


def heads_sweep_specs(quick: bool = False) -> list:
    """mla_decode_heads: per H, the mma.sync spec then the wgmma_qm one (BF16 KV, T = 1)."""
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    from k3gen.targets import get_target
    tgt = get_target("sm90")
    heads = (12, 32, 128) if quick else HEADS_SWEEP
    return [MlaDecodeSpec(target=tgt, heads=h, schedule=s) for h in heads for s in SCHEDULES]


def bars_specs() -> list:
    """mla_decode_bars: issue 6's memory-bound H = 12 shapes (B * L >= 256K tokens), T = 1, every KV
    dtype through mma.sync, BF16 also through wgmma_qm, FP8 and NVFP4 also through wgmma."""
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    from k3gen.targets import get_target
    tgt = get_target("sm90")
    return [MlaDecodeSpec(target=tgt, heads=12, schedule=s) for s in ("mma", "wgmma_qm")] + [
        MlaDecodeSpec(target=tgt, heads=12, kv=kv, schedule="mma", **kw) for kv, kw in _kv_formats()[1:]] + [
        MlaDecodeSpec(target=tgt, heads=12, kv=kv, schedule="wgmma", **kw) for kv, kw in _kv_formats()[1:]]


@case
def mla_decode_bars(ceiling: float, quick: bool = False) -> list:
    """The memory-bound H = 12 bar shapes, B in {32, 128} x L in {8K, 32K}, every KV dtype."""
    return mla_decode(ceiling, quick, specs=bars_specs(), batches=(32, 128), lengths=(8192, 32768),
                      op_name="mla_decode_bars")


@case
def mla_decode_heads(ceiling: float, quick: bool = False) -> list:
    """BF16 KV through both schedules over H in HEADS_SWEEP (T = 1, L = 8K)."""
    return mla_decode(ceiling, quick, specs=heads_sweep_specs(quick), batches=(128,) if quick else (32, 128),
                      lengths=(8192,), op_name="mla_decode_heads")


@case
def mla_decode(ceiling: float, quick: bool = False, *, specs=None, batches=None, lengths=None,
               op_name: str = "mla_decode") -> list:
    """Every KV dtype and schedule over H x T x B x L against the naive PyTorch decode (module doc)."""
    import torch

    from k3gen.ops.mla_decode.launcher import MlaDecode

    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = batches or ((1, 128) if quick else BATCHES)
    lengths = lengths or ((8192,) if quick else LENGTHS)
    rows, same, us_by, peer_cache = [], {}, {}, {}
    for spec in specs or bench_specs(quick):
        H, T = spec.heads, spec.tokens
        op = MlaDecode(spec).load()
        for B in batches:
            for L in lengths:
                nbytes = evaluate(spec.kv_bytes(), B=B, L=L)
                n = sets_for(nbytes)
                if n * nbytes > MAX_SET_BYTES:
                    n = max(1, MAX_SET_BYTES // nbytes)
                print(f"  {op_name} {spec.slug()} B{B} L{L} ({n} sets)", flush=True)
                pages_per = -(-L // spec.page)
                plan = op.plan(B, L)
                sets = []
                for _ in range(n):
                    num_pages = B * pages_per
                    sets.append(dict(
                        cache=_random_cache(spec, num_pages, B, gen),
                        bt=torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32).view(B, pages_per),
                        lengths=torch.full((B,), L, dtype=torch.int32, device="cuda"),
                        ring=torch.arange(B, dtype=torch.int32, device="cuda"),
                        q=(torch.randn(B, T, H, 576, device="cuda", generator=gen) * 0.5).to(torch.bfloat16),
                        out=torch.empty(B, T, H, 512, dtype=torch.bfloat16, device="cuda")))
                scale = 2688 / 30 if spec.kv.value == "nvfp4" else 1.0
                us = time_graph([lambda s=s: op(s["q"], s["cache"], s["bt"], s["lengths"], s["out"],
                                                ring_slot=s["ring"], scale=scale, plan=plan) for s in sets])
                extra = {"heads": H, "batch": B, "len": L, "tokens": T, "kv": spec.kv.value,
                         "schedule": spec.schedule, "splits": plan.splits, "rows_per_cta": spec.impl.plan(spec).rows,
                         "proj_8TBps_us": nbytes / 8e12 * 1e6,
                         "tflops": evaluate(spec.flops(), B=B, L=L) / us / 1e6}
                del sets
                torch.cuda.empty_cache()
                key = (H, T, B, L)
                us_by[(spec.kv.value, spec.schedule) + key] = us
                peer, peer_us = "", None
                bf16 = [us_by[("bf16", s) + key] for s in SCHEDULES if ("bf16", s) + key in us_by]
                if spec.kv.value != "bf16" and bf16:   # vs the fastest BF16 schedule measured at this shape
                    extra["x_bf16"] = min(bf16) / us
                if spec.kv.value == "nvfp4":   # vs the faster FP8 schedule measured at this shape
                    fp8 = [us_by[k] for k in (("fp8", "wgmma") + key, ("fp8", "mma") + key) if k in us_by]
                    if fp8:
                        extra["x_fp8"] = min(fp8) / us
                if spec.schedule != "mma":
                    if (spec.kv.value, "mma") + key in us_by:
                        extra["x_mma"] = us_by[(spec.kv.value, "mma") + key] / us
                    if spec.kv.value == "bf16":
                        peer, peer_us = peer_cache.get(key, ("", None))
                elif spec.kv.value == "bf16":
                    try:
                        psets = [(torch.randn(B, T, H, 576, device="cuda", generator=gen).to(torch.bfloat16),
                                  torch.randn(B, L, 576, device="cuda", generator=gen).to(torch.bfloat16))
                                 for _ in range(n)]
                        peer_us = time_graph([lambda p=p: _naive(p[0], p[1], T, H) for p in psets], reps=10)
                        peer = "naive torch bmm/softmax/bmm"
                        peer_cache[key] = (peer, peer_us)
                        del psets
                    except Exception as e:  # noqa: BLE001  (an OOM of the peer must not lose our row)
                        extra["peer_error"] = repr(e)[:200]
                    torch.cuda.empty_cache()
                name = f"{spec.kv.value}{'' if spec.schedule == 'mma' else '-' + spec.schedule} H{H} T{T} B{B} L{L}"
                rows.append(make_row(op_name, name, us, nbytes, ceiling,
                                     same, peer=peer, peer_us=peer_us, extra=extra))
    return rows


# -- Blackwell (B300) projection: bench/cases/mla_decode_b300.py (these constants are shared) ---------
B300_TBPS = 8e12          # HBM3e bandwidth the projection assumes
B300_F16_FLOPS = 2.25e15  # dense f16/bf16 tcgen05 peak assumed for the MMA floor (kind::f16)
