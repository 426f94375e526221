"""B300 projection of the tcgen05 mla_decode schedules (`k3gen bench --op mla_decode_b300`): computed
from counts, never measured (no Blackwell GPU exists in this project).

A schedule is priced by three floors; its projected time is the largest (no launch, latency, wave or
L2 term, so these are floors, not forecasts):

- memory: the KV bytes (MlaDecodeSpec.kv_bytes) at B300_TBPS. A tile comes from HBM once; the other
  CTAs that read it (the twin half, other row groups) are assumed to hit L2 at no cost.
- MMA: the tcgen05 instructions every CTA issues per 64-token tile, counted as the hardware executes
  them, at B300_F16_FLOPS (kind::f16, dense): rows padded to the CTA's row tile, N padded to the
  instruction's step (8 at M = 64, 16 at M = 128), and an M = 64 instruction taking the time of an
  M = 128 one (ASSUMED: cta_group::1 M = 64 accumulates in layout F, half of TMEM's 128 lanes, so
  half the data path idles; no public measurement). `m64_full_rate=True` prices M = 64 at its own
  size instead (the model the README's table used before 2026-12).
- decode (FP8 / NVFP4 KV): every CTA that reads a tile decodes it into an f16 operand tile:
  DECODE_SLOTS issue slots per value over B300_SMS SMs at B300_ISSUE (moe_experts_b300's rate; an
  ideal issue rate, so also a floor).

Schedules (SCHEDULES): the built ones read their geometry from the variant's plan; the others are
candidates priced for the design choice (docs/mla_decode_tcgen05.md says why they are not built).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from bench.cases.mla_decode import B300_F16_FLOPS, B300_TBPS
from bench.harness import case
from k3gen.ir.dims import evaluate

B300_SMS = 148                 # SMs assumed (moe_experts_b300, kda_prefill_b300 use the same)
B300_ISSUE = 4 * 32 * 1.9e9    # lane-instructions per second per SM: 4 schedulers x 32 lanes at 1.9 GHz
# Issue slots per decoded value of decode_tc.cuh's decode_tile, counted in its sm103 SASS (the loop
# body a valid row executes, per 16-value group): NVFP4 ~64 (LDS.64 codes, LDS.U8 scale, 8
# F2FP.F16.E2M1 + 1 F2FP.F16.E4M3, 8 HMUL2, 2 STS.128, the position / page / swizzle arithmetic);
# FP8 ~96 (8 F2FP.F16.E4M3, 16 f16 -> f32, 16 FMUL, 8 F2FP.F16.F32 packs, 2 STS.128, ...).
DECODE_SLOTS = {"fp8": 96 / 16, "nvfp4": 64 / 16, "bf16": 0.0}
TILE = 64
ROW = 576


def tm_rows(ht: int) -> int:
    """Query rows per CTA of the tokens-on-M schedules: H * T split into the fewest groups of <= 64
    rows, balanced, each padded to 16 (the M = 128 PV's N step)."""
    groups = -(-ht // 64)
    return 16 * -(-(-(-ht // groups)) // 16)


@dataclass(frozen=True)
class Sched:
    """A schedule's work per 64-token tile and query-row group. mmas(rows): (count, M, N, K) of
    every tcgen05 MMA the group's CTAs issue per tile; decoders: CTAs that decode the tile per group."""
    name: str
    built: bool
    rows: Callable[[int], int]
    mmas: Callable[[int], tuple]
    decoders: float
    note: str


SCHEDULES = (
    Sched("tcgen05", True, lambda ht: 64,
          lambda r: ((2 * 36, 64, 64, 16), (2 * 4, 64, 256, 16)), 2.0,
          "queries on M (64), a CTA pair per row group, S computed by both, O split 256 + 256"),
    Sched("tcgen05_tm", True, tm_rows,
          lambda r: ((36, 64, r, 16), (4 * 4, 128, r, 16)), 1.0,
          "tokens on M: S^T = K Q^T (M = 64 tokens, N = rows), O^T = V^T P^T (4 x M = 128 dims)"),
    Sched("tm_pairs", False, tm_rows,
          lambda r: ((36 / 2, 128, r, 16), (4 * 8 / 2, 128, r, 16)), 1.0,
          "tokens on M over 128-token tile pairs (M = 128 QK): a 147 KB operand, no room for Q and a ring"),
    Sched("qm_shared_s", False, lambda ht: 64,
          lambda r: ((36, 64, 64, 16), (2 * 4, 64, 256, 16)), 1.0 + 4 / 9,
          "queries on M with S computed once per pair and shared (DSMEM): the README's 2-CTA remedy"),
)


def schedule(name: str) -> Sched:
    return next(s for s in SCHEDULES if s.name == name)


def mma_flops(mmas, *, m64_full_rate: bool = False) -> float:
    """FLOPs the tensor core spends on (count, M, N, K) instructions as it executes them."""
    total = 0.0
    for count, m, n, k in mmas:
        step = 8 if m == 64 else 16
        m_exec = m if m64_full_rate else max(m, 128)
        total += count * 2 * m_exec * (-(-n // step) * step) * k
    return total


def b300_projection(spec, B: int, L: int, sched: str | None = None, *, m64_full_rate: bool = False) -> dict:
    """Projected B300 time of schedule `sched` (default: the spec's) at B sequences of L tokens."""
    s = schedule(sched or spec.schedule)
    ht = spec.heads * spec.tokens
    if s.built and spec.schedule == s.name:
        plan = spec.impl.plan(spec)
        rows = plan.rows
    else:
        rows = s.rows(ht)
    groups, tiles = -(-ht // rows), -(-L // TILE)
    nbytes = evaluate(spec.kv_bytes(), B=B, L=L)
    flops = B * groups * tiles * mma_flops(s.mmas(rows), m64_full_rate=m64_full_rate)
    values = B * groups * tiles * s.decoders * TILE * ROW
    terms = {"memory": nbytes / B300_TBPS * 1e6, "MMA": flops / B300_F16_FLOPS * 1e6,
             "decode": values * DECODE_SLOTS[spec.kv.value] / (B300_SMS * B300_ISSUE) * 1e6}
    bound = max(terms, key=terms.get)
    return {"schedule": s.name, "rows": rows, "groups": groups, "bytes": nbytes, "mem_us": terms["memory"],
            "mma_us": terms["MMA"], "decode_us": terms["decode"], "proj_us": terms[bound], "bound": bound,
            "x_floor": terms[bound] / terms["memory"]}


HEADS = (12, 96, 128)   # K3 per rank: TP8 (12), TP1 (96 / 128 as the checkpoint's H)
TOKENS = (1, 4, 8)      # decode, decode + 3 / 7 drafts


def b300_specs(heads=HEADS, tokens=TOKENS) -> list:
    from bench.cases.mla_decode import _kv_formats
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    from k3gen.targets import get_target
    tgt = get_target("sm103")
    return [MlaDecodeSpec(target=tgt, heads=h, tokens=t, kv=kv, **kw)
            for kv, kw in _kv_formats() for h in heads for t in tokens]


@case(device="cpu")
def mla_decode_b300(quick: bool = False) -> list:
    """Projected B300 times of the sm103 tcgen05 MLA decode schedules (every KV dtype; computed, not measured)."""
    rows = []
    print(f"{'case':<40} {'MB':>8} {'mem us':>8} {'MMA us':>8} {'dec us':>8} {'proj us':>8}  bound   x_prev"
          "   (B300 projection, not measured)")
    specs = b300_specs((12,), (1,)) if quick else b300_specs()
    for spec in specs:
        for B in ((32,) if quick else (1, 32, 128)):
            for L in ((8192,) if quick else (8192, 32768)):
                prev = b300_projection(spec, B, L, "tcgen05")
                for s in (s.name for s in SCHEDULES):
                    p = b300_projection(spec, B, L, s)
                    p["x_prev"] = prev["proj_us"] / p["proj_us"]
                    name = f"{spec.kv.value}-{s} H{spec.heads} T{spec.tokens} B{B} L{L}"
                    print(f"{name:<40} {p['bytes'] / 1e6:8.1f} {p['mem_us']:8.1f} {p['mma_us']:8.1f} "
                          f"{p['decode_us']:8.1f} {p['proj_us']:8.1f}  {p['bound']:<7} {p['x_prev']:5.2f}"
                          f"{'' if schedule(s).built else '  (not built)'}")
                    rows.append({"case": name, "seconds": p["proj_us"] * 1e-6, "built": schedule(s).built,
                                 "detail": f"projected {p['proj_us']:.1f} us ({p['bound']}-bound; not measured)", **p})
    return rows
