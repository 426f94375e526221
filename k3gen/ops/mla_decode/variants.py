"""The kernels that implement mla_decode, in the order `auto` tries them, and each one's geometry.

Declared order = what `auto` picks: on a tcgen05 target `tcgen05_tm` (NVFP4 with the 128x4 scale
swizzle); on a wgmma target BF16 KV gets `wgmma_qm`, FP8 KV and NVFP4 KV
with linear tile scales get `wgmma`, everything else (NVFP4 with the other target's scale layout)
gets `mma`. The H200 measured each of its choices fastest at every H * T it was tried on
(bench/NOTES.md, "mla_decode variant choice"); on the tcgen05 targets, where nothing can be
measured here, the B300 projection (bench/cases/mla_decode_b300.py) prices `tcgen05_tm` ahead of
`tcgen05` by 1.3-3x at every K3 H * T (12 .. 1024 rows) and KV dtype, so no choice depends on the
shape and there is no band table here (`tcgen05` stays selectable by name).

- `wgmma_qm` (sm_90a, BF16 KV; include/k3gen/mla/decode_wg_qm.cuh) puts 64 query rows on the wgmma
  M side: S = Q K^T as m64n64k16 and O += P V as m64n128k16, both operands from shared memory, V read
  N-major straight from the tile. One consumer warpgroup runs QK, the softmax (a row's scores in the
  4 lanes of a quad) and PV over latent dims 0..255, the other PV over 256..511 once P is published;
  a TMA producer thread streams each tile as 9 boxes of [64 tok][128 B] (one page, SW128-swizzled by
  the map: the wgmma layout), so one thread keeps a whole 72 KB tile in flight (cp.async from a
  warpgroup streamed about two thirds of that per SM). Rows past the sequence end are not
  zero-filled by the box: each consumer zeroes the V rows it multiplies, and the scores there are
  masked by a select. The launcher passes the map of the `kv` tensor by value.
- `wgmma` (sm_90a, FP8 KV: decode_wg_fp8.cuh; NVFP4 KV with linear scales: decode_wg_nvfp4.cuh): a
  cp.async producer warpgroup and two consumer warpgroups that take alternate tiles (each its own
  online-softmax state, merged at the end, so one's softmax runs under the other's MMAs), 16 query
  rows per CTA (`m_tiles` 1; more rows are more CTAs). FP8: E4M3 wgmma on the codes themselves, the
  query and the probabilities as E4M3 hi + lo pairs (a BF16 value's 8 significant bits), QK with both
  operands from shared memory (m64n32k32), PV from V^T register fragments built by byte transposes
  (register-A m64n16k32), the per-token group scales on the QK partials and folded into the
  probabilities with a per-tile power of two. NVFP4: Hopper has no FP4 MMA and the tile scales
  change every 16 dims and 16 tokens, so each consumer decodes a tile once (e2m1 x E4M3 x 2^-8 is
  exact in f16) into QK's register-A operand and its own f16 V tile; the live 16-token tile's BF16
  ring rows are folded into one consumer's softmax state in FP32 on CUDA cores.
- `tcgen05_tm` (the SM100 family: sm103/sm107; decode_tm.cuh): the KV tokens on the MMA M side.
  One CTA owns R = 16 m_tiles query rows (H * T in the fewest balanced groups of <= 64, padded to
  16) and all 512 output dims: S^T = K Q^T as kind::f16 M = 64 (tokens) x N = R, O^T += V^T P^T as
  4 blocks of M = 128 dims x N = R (V read MN-major from the same tile), S^T ping-pong, O^T and
  the softmax denominators in TMEM; the softmax reduces along M across TMEM lanes (a butterfly
  over 16 lanes, then 4 warps). Copies, decoders, Q staging and the tcgen05 layer are
  `tcgen05`'s. Proven by compile, SASS and CPU replay / emulation only (no Blackwell GPU here).
- `tcgen05` (the SM100 family: sm103/sm107; decode_tc.cuh): tcgen05 kind::f16 MMAs with S and O in
  TMEM, 64 query rows on M, each CTA of a pair writing 256 of the 512 output dims; BF16 tiles by TMA
  (the wgmma_qm boxes), FP8/NVFP4 by bulk copies decoded to f16 in shared memory (NVFP4 by the
  hardware E2M1 conversion, exact with its E4M3 scale; the HP tail rows times G in the same tile).
  Proven by compile, SASS and CPU replay only (no Blackwell GPU here).
- `mma` (every target; decode.cuh): 8 warps of mma.sync m16n8k16 (QK over 576, PV over 512), KV
  tiles through a cp.async ring, online softmax in FP32. One 16-row query tile keeps its A fragments
  in registers; NVFP4 tiles are dequantized in shared memory to BF16 (rounded once, RNE); FP8 codes
  go from the stage straight into f16 fragments (exact), the scales applied to the FP32 QK partials
  or folded into the probabilities. The SM100 family compiles this kernel (its tcgen05 FP4 path is
  not written yet).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from k3gen.arch.sm100 import idesc_f16, umma_desc
from k3gen.arch.sm90 import SW128_KMAJOR, encode_desc, sw128_mnmajor
from k3gen.ir.dtypes import KvDtype, ScaleLayout
from k3gen.ir.layouts import MLA_LATENT, MLA_ROW
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.mla_decode.spec import TILE_TOKENS, MlaDecodeSpec

SMEM_LIMIT = 227 * 1024       # opt-in shared memory per block on SM90 / SM100
SMEM_PER_SM = 228 * 1024      # shared memory per SM, shared by its resident CTAs
COMBINE_THREADS = 512         # split combine: 4 groups of 128 threads x 4 columns
THREADS = 256                 # mma: 8 warps
WG_THREADS = 384              # wgmma: producer + 2 consumer warpgroups
WG_REGISTERS = 168            # at launch; setmaxnreg then moves producer/consumers to 56/224
ALIGN = 1024                  # SW128 operand tiles are 1024-byte aligned; the kernel aligns the base up
PAD = 8                       # mma: BF16 elements of padding per shared probability row
BF16_TILE_BYTES = TILE_TOKENS * MLA_ROW * 2   # 9 SW128 blocks of [64 tok][64 dims]
QM_STAGES = 2                 # one 72 KB tile per consumer warpgroup (a third does not fit with Q)
WG_ROWS = 16                  # wgmma: query rows per CTA
# FP8 wgmma stage: the tile's codes as 5 SW128 blocks plus its [64][5] FP32 scales.
FP8_CODE_BYTES = 5 * TILE_TOKENS * 128
FP8_SCALE_BYTES = TILE_TOKENS * 5 * 4
# NVFP4 wgmma stage: codes (latent [64][256], rope [64][32]) and scale bytes; each consumer decodes
# into its own [64][512] f16 V tile; the live rows (<= 16, BF16) are staged once per CTA.
NVFP4_STAGE_BYTES = TILE_TOKENS * (MLA_ROW // 2) + 4 * 32 + TILE_TOKENS * 4
NVFP4_RING_BYTES = 16 * MLA_ROW * 2
NVFP4_V_BYTES = TILE_TOKENS * MLA_LATENT * 2


@dataclass(frozen=True)
class Plan:
    """The geometry a kernel is compiled and launched with; the template's static_asserts check it
    against the header's geometry struct."""
    rows: int                 # query rows per CTA
    groups: int               # CTAs per (sequence, split): H * T rows in tiles of `rows`
    threads: int
    max_registers: int        # per thread at launch
    ctas_per_sm: int          # resident CTAs the launch bounds and shared memory are built for
    stages: int               # KV ring depth
    stage_bytes: int          # one ring stage (codes + scales of 64 tokens, before any decode)
    smem_bytes: int           # dynamic shared memory
    smem_limit: int           # what one CTA may use: the per-block cap or its share of the SM
    smem: dict                # wgmma: byte offsets of the regions from the 1024-aligned base
    q_in_registers: bool = False
    kv_map: bool = False      # the kernel takes the TMA map of the KV pages by value
    desc_probe: tuple = ()    # (shared address, descriptor) the device encoder must reproduce
    combine_threads: int = COMBINE_THREADS


def _stacked(parts) -> dict:
    """Byte offsets of (name, size) regions laid one after another, plus "end" and "total" (end + the
    slack the kernel uses to align the dynamic window up to 1024 bytes)."""
    plan, off = {}, 0
    for name, size in parts:
        plan[name] = off
        off += size
    plan["end"] = off
    plan["total"] = off + ALIGN
    return plan


def _aligned(off: int) -> int:
    return -(-off // ALIGN) * ALIGN


@functools.lru_cache(maxsize=4096)
def _plan(variant: "MlaKernel", spec: MlaDecodeSpec) -> Plan:
    return variant.geometry(spec)


@dataclass(frozen=True)
class MlaKernel(Variant):
    """A mla_decode kernel: what its template includes and calls, its row tiles and its geometry."""
    header: str = ""          # the algorithm, under include/
    geo: str = ""             # the header's geometry struct (checked against the plan)
    call: str = ""            # the body of k3gen_mla_decode
    params: str = ""          # kernel parameters after `splits`
    note: str = ""            # extra lines of the source's entry comment
    m_tiles_why: str = "registers: 32 FP32 accumulators per tile"

    def m_tiles_allowed(self, spec) -> tuple[int, ...]:
        raise NotImplementedError

    def default_m_tiles(self, spec) -> int:
        raise NotImplementedError

    def geometry(self, spec) -> Plan:
        raise NotImplementedError

    def checks_of(self, spec, plan: Plan) -> list[tuple[str, str]]:
        """(condition, message) of the template's static_asserts that tie the header to the plan."""
        raise NotImplementedError

    def plan(self, spec) -> Plan:
        return _plan(self, spec)

    def template_inputs(self, spec) -> dict:
        plan = self.plan(spec)
        return {"plan": plan, "header": self.header, "geo": self.geo, "call": self.call, "params": self.params,
                "note": self.note, "doc": self.doc, "asserts": self.checks_of(spec, plan), "config": ""}


def _offsets(plan: Plan, names: dict[str, str]) -> str:
    return " &&\n              ".join(f"Geo::k{n}Off == {plan.smem[k]}" for n, k in names.items())


def _groups(spec, rows: int) -> int:
    return -(-spec.heads * spec.tokens // rows)


class MmaKernel(MlaKernel):
    def m_tiles_allowed(self, spec):
        return (1, 2)

    def default_m_tiles(self, spec):
        return 1 if spec.heads * spec.tokens <= 16 else 2

    def geometry(self, spec):
        rows = 16 * spec.m_tiles
        if spec.kv is KvDtype.BF16:
            raw = TILE_TOKENS * MLA_ROW * 2                       # XOR-swizzled rows, no padding
        elif spec.kv is KvDtype.FP8:   # 608-byte code rows (conflict-free fragment loads), 5 scales padded to 8
            raw = TILE_TOKENS * (MLA_ROW + 32) + TILE_TOKENS * 8 * 4
        else:   # 304-byte code rows (288 + 16: conflict-free fragment loads) + scale bytes (swizzled half page)
            raw = TILE_TOKENS * (MLA_ROW // 2 + 16) + 9 * 32 * 8
        # FP8/NVFP4 with one query tile: two CTAs per SM. Their fragment decode makes them issue- and
        # latency-bound at 8 warps per SM (ncu: low DRAM throughput, stalls on fixed-latency
        # dependencies), so Q moves from registers (144 per thread) to shared memory for a second
        # CTA; BF16 keeps Q in registers and a 3-deep ring of 72 KB tiles at one CTA per SM.
        ctas = 2 if spec.kv is not KvDtype.BF16 and spec.m_tiles == 1 else 1
        q_reg = spec.m_tiles == 1 and ctas == 1
        limit = min(SMEM_LIMIT, SMEM_PER_SM // ctas - 1024)   # each resident CTA also reserves 1 KB
        # Register Q is staged once through the last ring stage; otherwise the query rows are re-read
        # from shared memory per KV tile.
        q = 0 if q_reg else rows * (MLA_ROW * 2 + (0 if spec.kv is KvDtype.BF16 else 64))
        # FP32 scores, BF16 probabilities, m / l / alpha / causal limit per row
        fixed = q + rows * (TILE_TOKENS + 4) * 4 + rows * (TILE_TOKENS + PAD) * 2 + rows * 4 * 4
        stages = next((s for s in (4, 3, 2) if fixed + s * raw <= limit), 2)
        # One CTA per SM (the pipeline takes most of the shared memory): 255 registers cost no occupancy.
        return Plan(rows=rows, groups=_groups(spec, rows), threads=THREADS, max_registers=255, ctas_per_sm=ctas,
                    stages=stages, stage_bytes=raw, smem_bytes=fixed + stages * raw, smem_limit=limit, smem={},
                    q_in_registers=q_reg)

    def checks_of(self, spec, plan):
        return [
            (f"Geo::kSmem == {plan.smem_bytes}", "shared memory plan differs from the mma variant's plan"),
            (f"Geo::kRaw == {plan.stage_bytes}", "stage size differs from the mma variant's plan"),
            ("Config::kStages >= 2 && Config::kStages <= 4", "cp.async ring depth"),
            ("Config::kMT == 1 || Config::kMT == 2", "query rows per CTA: 16 or 32"),
            ("Config::kPage % k3gen::mla::kTok == 0", "tiles never straddle pages"),
            ("k3gen::mla::kWarps * 64 == k3gen::mla::kLat && k3gen::mla::kWarps * 8 == k3gen::mla::kTok",
             "PV: 64 output columns per warp; QK: 8 tokens per warp"),
            ("Config::kKv != k3gen::mla::Kv::kNvfp4 ||\n              "
             "(Config::kPage == 128 && Config::kNumTensors == (Config::kSwizzle ? 3 : 4))",
             "NVFP4: 128-token pages; codes, scales (1 swizzled or 2 linear), hp_tail"),
        ]


class QmKernel(MlaKernel):
    def m_tiles_allowed(self, spec):
        return (4,)

    def default_m_tiles(self, spec):
        return 4

    def geometry(self, spec):
        # QmGeo: the two 72 KB stages, Q (9 SW128 blocks of [64 rows][64 dims]), P ([64 rows][64 tok]
        # SW128), the tile's per-row rescale factors, the final m and l per row, full/empty mbarriers
        # per stage and the P / end handoffs. The final [64][516] FP32 output buffer reuses the stages.
        smem = _stacked((("stages", QM_STAGES * BF16_TILE_BYTES), ("q", 64 * MLA_ROW * 2),
                         ("p", 64 * TILE_TOKENS * 2), ("alpha", 64 * 4), ("stats", 2 * 64 * 4), ("bars", 7 * 8)))
        # The probe: V as N-major B over two 64-dim blocks, dims 384..511 of the second stage, last k16.
        addr = BF16_TILE_BYTES + 6 * TILE_TOKENS * 128 + 3 * 2048
        return Plan(rows=64, groups=_groups(spec, 64), threads=WG_THREADS, max_registers=WG_REGISTERS,
                    ctas_per_sm=1, stages=QM_STAGES, stage_bytes=BF16_TILE_BYTES, smem_bytes=smem["total"],
                    smem_limit=SMEM_LIMIT, smem=smem, kv_map=True,
                    desc_probe=(addr, encode_desc(addr, sw128_mnmajor(TILE_TOKENS * 128))))

    def checks_of(self, spec, plan):
        addr, desc = plan.desc_probe
        return [
            (f"Geo::kSmem == {plan.smem_bytes}", "shared memory plan differs from the wgmma_qm variant's plan"),
            (_offsets(plan, {"Q": "q", "P": "p", "Alpha": "alpha", "Stats": "stats", "Bar": "bars"}),
             "shared memory offsets differ from the wgmma_qm variant's plan"),
            (f"k3gen::mla::wgq::kTileBytes == {plan.stage_bytes} && k3gen::mla::wgq::kStages == {plan.stages}",
             "stage plan differs from the wgmma_qm variant's plan"),
            (f"Config::kKv == k3gen::mla::Kv::kBf16 && Config::kMT == 4 && k3gen::mla::wgq::kThreads == {plan.threads}",
             "the wgmma_qm schedule: BF16 KV, 64 query rows, 3 warpgroups"),
            ("Config::kPage % k3gen::mla::kTok == 0", "tiles never straddle pages"),
            (f"k3gen::sm90::wgmma_desc<k3gen::mla::wg::kBlk, 1024, 1>({addr}u) == {desc}ull",
             "descriptor encoder differs from k3gen.arch.sm90.encode_desc"),
        ]


class WgKernel(MlaKernel):
    """FP8 and NVFP4 KV: one header per KV dtype, the same frame and row plan."""

    def m_tiles_allowed(self, spec):
        return (1,)

    def default_m_tiles(self, spec):
        return 1

    def geometry(self, spec):
        layout = _fp8_smem if spec.kv is KvDtype.FP8 else _nvfp4_smem
        stages = next((st for st in (4, 3, 2) if layout(st)["total"] <= SMEM_LIMIT), 2)
        smem = layout(stages)
        return Plan(rows=WG_ROWS, groups=_groups(spec, WG_ROWS), threads=WG_THREADS, max_registers=WG_REGISTERS,
                    ctas_per_sm=1, stages=stages,
                    stage_bytes=FP8_CODE_BYTES + FP8_SCALE_BYTES if spec.kv is KvDtype.FP8 else NVFP4_STAGE_BYTES,
                    smem_bytes=smem["total"], smem_limit=SMEM_LIMIT, smem=smem)

    def template_inputs(self, spec) -> dict:
        d = super().template_inputs(spec)
        fp8 = spec.kv is KvDtype.FP8
        ns = "wg8" if fp8 else "wg4"
        d.update(header=f"k3gen/mla/decode_wg_{'fp8' if fp8 else 'nvfp4'}.cuh",
                 geo=f"k3gen::mla::{ns}::Geo{'8' if fp8 else '4'}<Config>", call=f"k3gen::mla::{ns}::decode<Config>(p)")
        return d

    def checks_of(self, spec, plan):
        fp8 = spec.kv is KvDtype.FP8
        regions = ({"Scale": "scales"} if fp8 else {"Ring": "ring", "V": "v"}) | {
            "Q": "q", "P": "p", "Red": "red", "Stats": "stats", "Bar": "bars"}
        out = [(f"Geo::kSmem == {plan.smem_bytes}", "shared memory plan differs from the wgmma variant's plan"),
               (_offsets(plan, regions), "shared memory offsets differ from the wgmma variant's plan")]
        if fp8:
            return out + [
                ("Config::kKv == k3gen::mla::Kv::kFp8 && Config::kMT == 1 &&\n              "
                 f"k3gen::mla::wg8::kThreads == {plan.threads}",
                 "the FP8 wgmma schedule: FP8 KV, 16 query rows, 3 warpgroups"),
                ("Config::kPage == k3gen::mla::kTok", "FP8 pages are one 64-token tile")]
        return out + [
            ("Config::kKv == k3gen::mla::Kv::kNvfp4 && Config::kMT == 1 && !Config::kSwizzle &&\n              "
             f"k3gen::mla::wg4::kThreads == {plan.threads}",
             "the NVFP4 wgmma schedule: NVFP4 KV with linear scales, 16 query rows, 3 warpgroups"),
            ("Config::kPage == 128 && Config::kNumTensors == 4 && Config::kRing <= 16 + 8",
             "NVFP4: 128-token pages; codes, tile scales, rope scales, hp_tail")]


def _fp8_smem(stages: int) -> dict:
    """decode_wg_fp8.cuh's Geo8: stages of codes, their scales, then from a 1024-aligned offset Q hi
    and lo (5 SW128 blocks of [16 rows][128 B] each), P ([16][128 B] per latent scale group, per
    consumer), red ([consumer][warp][16 maxima + scale max, padded to 20]), stats, full/empty
    mbarriers per stage and the consumers' two handoffs. The [2][16][516] FP32 merge buffer reuses
    the stages."""
    plan = {"stages": 0, "scales": stages * FP8_CODE_BYTES}
    plan["q"] = _aligned(plan["scales"] + stages * FP8_SCALE_BYTES)
    plan["p"] = plan["q"] + 2 * 5 * WG_ROWS * 128
    plan["red"] = plan["p"] + 2 * 4 * WG_ROWS * 128
    plan["stats"] = plan["red"] + 2 * 4 * (WG_ROWS + 4) * 4
    plan["bars"] = plan["stats"] + 2 * 2 * WG_ROWS * 4
    plan["end"] = plan["bars"] + 2 * stages * 8 + 2 * 8
    plan["total"] = plan["end"] + ALIGN
    return plan


def _nvfp4_smem(stages: int) -> dict:
    """decode_wg_nvfp4.cuh's Geo4: stages, the live rows ([16][576] BF16), from a 1024-aligned offset
    the two consumers' decoded V tiles (8 SW128 blocks of [64 tok][64 dims] f16 each; later the
    [2][16][516] FP32 merge buffer), Q (9 SW128 blocks of [16][64] f16), P^T per consumer ([16][64]
    f16), red ([consumer][warp][16]), stats, full/empty mbarriers per stage and the consumers' two
    handoffs."""
    plan = {"stages": 0, "ring": stages * NVFP4_STAGE_BYTES}
    plan["v"] = _aligned(plan["ring"] + NVFP4_RING_BYTES)
    plan["q"] = plan["v"] + 2 * NVFP4_V_BYTES
    plan["p"] = plan["q"] + 9 * WG_ROWS * 128
    plan["red"] = plan["p"] + 2 * WG_ROWS * 128
    plan["stats"] = plan["red"] + 2 * 4 * WG_ROWS * 4
    plan["bars"] = plan["stats"] + 2 * 2 * WG_ROWS * 4
    plan["end"] = plan["bars"] + 2 * stages * 8 + 2 * 8
    plan["total"] = plan["end"] + ALIGN
    return plan


# tcgen05 (decode_tc.cuh): 64 query rows x 256 output dims per CTA; regions from the 1024-aligned base.
TC_ROWS = 64
BLK_TC = TILE_TOKENS * 128        # one [64][64] 16-bit SW128 block
TC_TILE_BYTES = BF16_TILE_BYTES    # one [64 tok][576] 16-bit operand tile (TMA BF16 stage or decoded f16)


def tc_raw_bytes(spec) -> int:
    """One FP8 / NVFP4 raw stage: the tile's codes and scales as the bulk copies land them (NVFP4: the
    page's whole 128x4-swizzled [128, 36] scale matrix)."""
    if spec.kv is KvDtype.FP8:
        return TILE_TOKENS * MLA_ROW + (0 if spec.layout.fp8_scales.value == "per_tensor" else TILE_TOKENS * 5 * 4)
    if spec.kv is KvDtype.NVFP4:
        return TILE_TOKENS * MLA_ROW // 2 + 128 * 36
    return 0


def tc_smem(spec, stages: int) -> dict:
    """TcGeo: operand tiles (BF16: the TMA stages; FP8/NVFP4: one decoded tile), Q (9 SW128 blocks of
    [64 rows][64 dims]), P ([64 rows][64 tok] SW128), the raw ring (FP8/NVFP4), mbarriers (full/empty
    per stage, decoded full/empty, S full x 2, P full, O done), the TMEM address slot, a reduction
    scratch."""
    dec = spec.kv is not KvDtype.BF16
    ring = stages
    return _stacked((("op", (1 if dec else stages) * TC_TILE_BYTES), ("q", TC_ROWS * MLA_ROW * 2),
                     ("p", TC_ROWS * TILE_TOKENS * 2), ("raw", (stages if dec else 0) * tc_raw_bytes(spec)),
                     ("bars", 8 * (2 * ring + 6)), ("tmem", 16), ("red", 64)))


class TcKernel(MlaKernel):
    def m_tiles_allowed(self, spec):
        return (4,)

    def default_m_tiles(self, spec):
        return 4

    def geometry(self, spec):
        stages = next((s for s in (4, 3, 2, 1) if tc_smem(spec, s)["total"] <= SMEM_LIMIT), 1)
        if spec.kv is KvDtype.BF16:
            stages = min(stages, 2)   # two 72 KB TMA tiles fit beside Q and P
        smem = tc_smem(spec, stages)
        dec = spec.kv is not KvDtype.BF16
        # Grid x = 2 * row groups: each CTA writes 256 of the 512 output dims (TMEM holds S and half of O).
        return Plan(rows=TC_ROWS, groups=2 * _groups(spec, TC_ROWS), threads=320 if dec else 192,
                    max_registers=255, ctas_per_sm=1, stages=stages,
                    stage_bytes=tc_raw_bytes(spec) if dec else TC_TILE_BYTES, smem_bytes=smem["total"],
                    smem_limit=SMEM_LIMIT, smem=smem, kv_map=not dec)

    def template_inputs(self, spec) -> dict:
        d = super().template_inputs(spec)
        if spec.kv is KvDtype.BF16:
            d.update(call="k3gen::mla::tc::decode<Config>(p, &kv_map)",
                     params=",\n    const __grid_constant__ k3gen::sm90::TmaMap kv_map",
                     note="\n//                             (+ kv_map: TMA map of c0 as uint8 [pages * 64 rows][1152], "
                          "box [64][128], 128B swizzle)")
        else:
            d.update(call="k3gen::mla::tc::decode<Config>(p, nullptr)")
        return d

    def checks_of(self, spec, plan):
        return [
            (f"Geo::kSmem == {plan.smem_bytes}", "shared memory plan differs from the tcgen05 variant's plan"),
            (_offsets(plan, {"Q": "q", "P": "p", "Raw": "raw", "Bar": "bars", "Tmem": "tmem", "Red": "red"}),
             "shared memory offsets differ from the tcgen05 variant's plan"),
            (f"Geo::kThreads == {plan.threads} && Geo::kRawBytes == {tc_raw_bytes(spec)}",
             "threads / raw stage differ from the tcgen05 variant's plan"),
            ("Config::kMT == 4 && Config::kPage % k3gen::mla::kTok == 0", "64 query rows; tiles never straddle pages"),
            ("Config::kKv != k3gen::mla::Kv::kNvfp4 || (Config::kSwizzle && Config::kNumTensors == 3)",
             "NVFP4: 128x4-swizzled scales, hp_tail"),
        ] + tc_probes(spec.kv is KvDtype.BF16)


def tc_probes(bf16: bool) -> list[tuple[str, str]]:
    """The header's descriptor encoders against k3gen.arch.sm100 (QK's K-major operands at the second
    stage's rope block, PV's MN-major V of the upper half, both instruction descriptors)."""
    a_k = TC_TILE_BYTES + 8 * BLK_TC + 3 * 32
    a_v = 4 * BLK_TC + 3 * 2048
    b = "true" if bf16 else "false"
    return [
        (f"k3gen::mla::tc::desc<16, 1024>({a_k}u) == {umma_desc(a_k, SW128_KMAJOR)}ull &&\n              "
         f"k3gen::mla::tc::desc<{BLK_TC}, 1024>({a_v}u) == {umma_desc(a_v, sw128_mnmajor(BLK_TC))}ull",
         "tcgen05 shared-memory descriptor differs from k3gen.arch.sm100.umma_desc"),
        (f"k3gen::mla::tc::idesc<{b}, false, 64, 64>() == {idesc_f16(bf16=bf16, m=64, n=64)}u &&\n              "
         f"k3gen::mla::tc::idesc<{b}, true, 64, 256>() == {idesc_f16(bf16=bf16, m=64, n=256, b_mn=True)}u",
         "tcgen05 instruction descriptor differs from k3gen.arch.sm100.idesc_f16"),
    ]


# tcgen05_tm (decode_tm.cuh): tokens on M; R = 16 m_tiles query rows x all 512 output dims per CTA.
TM_MAX_ROWS = 64


def tm_default_rows(ht: int) -> int:
    """H * T in the fewest groups of <= 64 rows, balanced, each padded to 16 (the PV's N step)."""
    groups = -(-ht // TM_MAX_ROWS)
    return 16 * -(-(-(-ht // groups)) // 16)


def tm_tmem_cols(rows: int) -> int:
    """TMEM columns allocated: S^T ping-pong (2 R), O^T (4 R), the denominator partials (R), rounded up
    to a power of two >= 32."""
    return max(32, 1 << (7 * rows - 1).bit_length())


def tm_smem(spec, rows: int, op_stages: int, raw_stages: int) -> dict:
    """TmGeo: operand tiles (BF16: the TMA stages), Q ([R][576] as 9 SW128 blocks), P^T ([R][64 tok]
    SW128), the raw ring (FP8/NVFP4), mbarriers (ring full/empty, operand full/empty when decoded,
    S full x 2, P full, O done), the TMEM address slot, the column reduction [4][R], the per-column
    m and alpha (the epilogue's 1 / l)."""
    dec = spec.kv is not KvDtype.BF16
    ring = raw_stages if dec else op_stages
    return _stacked((("op", op_stages * TC_TILE_BYTES), ("q", rows * MLA_ROW * 2), ("p", rows * TILE_TOKENS * 2),
                     ("raw", (raw_stages if dec else 0) * tc_raw_bytes(spec)),
                     ("bars", 8 * (2 * ring + (2 * op_stages if dec else 0) + 4)), ("tmem", 16), ("red", 4 * rows * 4),
                     ("col", 2 * rows * 4)))


class TmKernel(MlaKernel):
    def m_tiles_allowed(self, spec):
        return (1, 2, 3, 4)

    def default_m_tiles(self, spec):
        return tm_default_rows(spec.heads * spec.tokens) // 16

    def stages(self, spec, rows: int) -> tuple[int, int]:
        """(operand tiles, raw stages). BF16: the deepest TMA ring that fits. FP8/NVFP4: two decoded
        operand tiles (the decode of the next tile runs under this one's softmax and PV) when a
        2-deep raw ring still fits, else one and the deepest raw ring."""
        fits = lambda o, r: tm_smem(spec, rows, o, r)["total"] <= SMEM_LIMIT   # noqa: E731
        if spec.kv is KvDtype.BF16:
            return next((o for o in (4, 3, 2) if fits(o, 0)), 1), 0
        for o in (2, 1):
            r = next((r for r in (4, 3, 2, 1) if fits(o, r)), 0)
            if r >= (2 if o == 2 else 1):
                return o, r
        return 1, 1

    def geometry(self, spec):
        rows = 16 * spec.m_tiles
        op, raw = self.stages(spec, rows)
        smem = tm_smem(spec, rows, op, raw)
        dec = spec.kv is not KvDtype.BF16
        return Plan(rows=rows, groups=_groups(spec, rows), threads=320 if dec else 192, max_registers=255,
                    ctas_per_sm=1, stages=raw if dec else op, stage_bytes=tc_raw_bytes(spec) if dec else TC_TILE_BYTES,
                    smem_bytes=smem["total"], smem_limit=SMEM_LIMIT, smem=smem, kv_map=not dec,
                    desc_probe=(op, tm_tmem_cols(rows)))

    def template_inputs(self, spec) -> dict:
        d = super().template_inputs(spec)
        # The operand tiles are a second stage count: rendered into this variant's Config only.
        d["config"] = f"\n  static constexpr int kOpStages = {self.plan(spec).desc_probe[0]};"
        if spec.kv is KvDtype.BF16:
            d.update(call="k3gen::mla::tm::decode<Config>(p, &kv_map)",
                     params=",\n    const __grid_constant__ k3gen::sm90::TmaMap kv_map",
                     note="\n//                             (+ kv_map: TMA map of c0 as uint8 [pages * 64 rows][1152], "
                          "box [64][128], 128B swizzle)")
        else:
            d.update(call="k3gen::mla::tm::decode<Config>(p, nullptr)")
        return d

    def checks_of(self, spec, plan):
        op, cols = plan.desc_probe
        return [
            (f"Geo::kSmem == {plan.smem_bytes}", "shared memory plan differs from the tcgen05_tm variant's plan"),
            (_offsets(plan, {"Q": "q", "P": "p", "Raw": "raw", "Bar": "bars", "Tmem": "tmem", "Red": "red",
                             "Col": "col"}), "shared memory offsets differ from the tcgen05_tm variant's plan"),
            (f"Geo::kThreads == {plan.threads} && Geo::Raw::kRawBytes == {tc_raw_bytes(spec)} && "
             f"Geo::kOpStages == {op} && Geo::kTmemCols == {cols}",
             "threads / raw stage / operand tiles / TMEM columns differ from the tcgen05_tm variant's plan"),
            (f"Geo::kR == {plan.rows} && Config::kPage % k3gen::mla::kTok == 0",
             "query rows per CTA; tiles never straddle pages"),
            ("Config::kKv != k3gen::mla::Kv::kNvfp4 || (Config::kSwizzle && Config::kNumTensors == 3)",
             "NVFP4: 128x4-swizzled scales, hp_tail"),
        ] + tm_probes(spec.kv is KvDtype.BF16, plan.rows)


def tm_probes(bf16: bool, rows: int) -> list[tuple[str, str]]:
    """decode_tm.cuh's descriptors against k3gen.arch.sm100: QK's B (Q, [R][576] K-major: the rope
    block, last k16), PV's A (V^T MN-major over two 64-dim blocks, LBO the block stride) and P^T's
    B, both instruction descriptors (QK M = 64 N = R; PV M = 128 N = R, A MN-major)."""
    a_q = 8 * rows * 128 + 3 * 32
    a_v = TC_TILE_BYTES + 6 * BLK_TC + 3 * 2048
    a_p = 3 * 32
    b = "true" if bf16 else "false"
    return [
        (f"k3gen::sm100::desc<16, 1024>({a_q}u) == {umma_desc(a_q, SW128_KMAJOR)}ull &&\n              "
         f"k3gen::sm100::desc<{BLK_TC}, 1024>({a_v}u) == {umma_desc(a_v, sw128_mnmajor(BLK_TC))}ull &&\n              "
         f"k3gen::sm100::desc<16, 1024>({a_p}u) == {umma_desc(a_p, SW128_KMAJOR)}ull",
         "tcgen05 shared-memory descriptor differs from k3gen.arch.sm100.umma_desc"),
        (f"k3gen::sm100::idesc<{b}, false, 64, {rows}>() == {idesc_f16(bf16=bf16, m=64, n=rows)}u &&\n              "
         f"k3gen::sm100::idesc<{b}, false, 128, {rows}, true>() == "
         f"{idesc_f16(bf16=bf16, m=128, n=rows, a_mn=True)}u",
         "tcgen05 instruction descriptor differs from k3gen.arch.sm100.idesc_f16"),
    ]


_WGMMA = (lambda s: s.target.mma == "wgmma", "needs wgmma (sm_90a); this target has none")
_TCGEN05 = (lambda s: s.target.mma == "tcgen05", "needs tcgen05 (sm_100a family); this target has none")

_SWZ = (lambda s: s.kv is not KvDtype.NVFP4 or s.scale_layout is ScaleLayout.SWIZZLE_128X4,
        "reads NVFP4 scales in the 128x4 swizzle only (the SM100 family's layout)")

VARIANTS = VariantTable("mla_decode", (
    TmKernel("tcgen05_tm", doc="tcgen05, KV tokens on M, query rows on N, all 512 dims per CTA",
             checks=(_TCGEN05, _SWZ), header="k3gen/mla/decode_tm.cuh", geo="k3gen::mla::tm::TmGeo<Config>",
             m_tiles_why="tcgen05_tm: 16 m_tiles query rows per CTA = the MMAs' N (16..64)"),
    TcKernel("tcgen05", doc="tcgen05 MMA, TMEM accumulators, TMA / bulk-copy producer",
             checks=(_TCGEN05, _SWZ),
             header="k3gen/mla/decode_tc.cuh", geo="k3gen::mla::tc::TcGeo<Config>",
             m_tiles_why="tcgen05: 64 query rows per CTA (M = 64)"),
    QmKernel("wgmma_qm", doc="query rows on the wgmma M side, TMA producer",
             checks=(_WGMMA, (lambda s: s.kv is KvDtype.BF16,
                              "reads BF16 KV only (FP8 and NVFP4 KV: schedule 'wgmma')")),
             header="k3gen/mla/decode_wg_qm.cuh", geo="k3gen::mla::wgq::QmGeo<Config>",
             call="k3gen::mla::wgq::decode<Config>(p, &kv_map)",
             params=",\n    const __grid_constant__ k3gen::sm90::TmaMap kv_map",
             note="\n//                             (+ kv_map: TMA map of c0 as uint8 [pages * 64 rows][1152], "
                  "box [64][128], 128B swizzle)"),
    WgKernel("wgmma", doc="FP8 / NVFP4 KV on wgmma, tokens on the M side",
             checks=(_WGMMA, (lambda s: s.kv in (KvDtype.FP8, KvDtype.NVFP4),
                              "reads FP8 or NVFP4 KV only (BF16 KV: schedule 'wgmma_qm')"),
                     (lambda s: s.kv is not KvDtype.NVFP4 or s.scale_layout is ScaleLayout.LINEAR,
                      "reads NVFP4 tile scales in the linear layout only (the 128x4 swizzle is the SM100 "
                      "family's; schedule 'mma' reads both)")),
             m_tiles_why="registers: 32 FP32 accumulators per tile; FP8/NVFP4 wgmma: 16 rows (H * T <= 16)"),
    MmaKernel("mma", doc="mma.sync, every target", header="k3gen/mla/decode.cuh", geo="k3gen::mla::Geo<Config>",
              call="k3gen::mla::decode<Config>(p)"),
))
MlaDecodeSpec.variants = VARIANTS
