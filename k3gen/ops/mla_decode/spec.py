"""mla_decode: absorbed MLA attention over the paged latent KV cache (SPEC.md sections 4 and 5).

Kernel contract (shared by the template, the reference and the launcher):

- `q[B, T, H, 576]` BF16 (per head `[q_lat 512 | q_pe 64]`, the mla_q_absorb output of T tokens),
  contiguous. Query row r = t * H + h of sequence b.
- `lengths[B]` int32: tokens in the cache of sequence b, the T new ones included (T <= length).
  Bottom-right causal: query token t sees positions 0 .. length - T + t.
- Row of position p: page `block_table[b, p // page]`, slot `p % page`; KV formats of KvLayout.
  FP8 and NVFP4 rows are dequantized exactly as `reference.kv_cache_write.gather_rows` does; NVFP4
  positions of the live incomplete 16-token tile (`length // 16 * 16 .. length - 1`) come from the
  BF16 HP tail ring `hp_tail[ring_slot[b], p % ring]`.
- `s = (q . row) * softmax_scale` (1/sqrt(192)), softmax in FP32, `o_lat = sum p * row[:512]`,
  BF16 `out[B, T, H, 512]`.

Lowering (SM90 and, same source, the SM100 family): a CTA handles `16 * m_tiles` query rows of one
sequence over one split of its KV tiles (64 tokens each). KV tiles stream through a cp.async ring
in shared memory and feed mma.sync m16n8k16 (QK over 576, PV over 512); online softmax in FP32.
With one 16-row query tile its A fragments stay in registers. NVFP4 tiles are dequantized in
shared memory to BF16 (rounded once, RNE); FP8 codes go from the stage straight into f16
fragments (exact), the per-token scales applied to FP32 partials (QK) or folded into the
probabilities (PV): see include/k3gen/mla/decode_fp8.cuh. With more than one
split the CTAs write FP32 partial outputs + log-sum-exp into a workspace and a second entry
(`k3gen_mla_decode_combine`) merges them. The split count is chosen on the host (`plan_splits`)
from the batch shape only, so a captured graph stays valid when lengths change; each CTA derives
its token range from the device lengths. The tcgen05 block-scaled FP4 path of SM103/SM107 is not
written yet: those targets compile this mma.sync kernel.

`schedule="wgmma"` (sm_90a, BF16 KV; include/k3gen/mla/decode_wg.cuh) puts the 64 tokens
of a tile on the wgmma M side (S^T = K_tile Q^T, O^T += V^T P^T, both operands from shared memory)
with a cp.async producer warpgroup and two consumer warpgroups that take alternate tiles (each its
own online-softmax state, merged at the end), so one's softmax runs under the other's MMAs.
Above 32 query rows (H * T > 32) a CTA covers 64 rows (`m_tiles` 4) and the two consumers split the
rows instead (32 each, both on every tile, nothing to merge): half the CTAs per sequence re-read the
KV of the N = 32 plan, and the 227 KB still hold two stages, the 64-row Q and both P tiles.

`schedule="wgmma_qm"` (sm_90a, BF16 KV; include/k3gen/mla/decode_wg_qm.cuh; the sm90 default
for BF16) puts 64 query rows on the wgmma M side instead: S = Q K^T as m64n64k16 and O += P V as
m64n128k16, both operands from shared memory, V read N-major straight from the tile. One consumer
warpgroup runs QK, the softmax (a row's scores in the 4 lanes of a quad) and PV over latent dims
0..255, the other PV over 256..511 once P is published; a TMA producer thread streams each tile as 9
boxes of [64 tok][128 B] (one page, SW128-swizzled by the map: the wgmma layout), so one thread keeps
a whole 72 KB tile in flight (cp.async from a warpgroup reached ~21 GB/s per SM with two stages, TMA
~31). Rows past the sequence end are not zero-filled by the box: each consumer zeroes the V rows it
multiplies, and the scores there are masked by a select. The launcher passes the map of the `kv`
tensor by value (encoded on the host, cached per pointer).

`schedule="wgmma"` over FP8 KV (include/k3gen/mla/decode_wg_fp8.cuh; the sm90 default for
FP8) keeps that frame with 16 query rows per CTA (`m_tiles` 1; more rows are more CTAs) and E4M3
wgmma on the codes themselves: the query and the probabilities enter as E4M3 hi + lo pairs (a BF16
value's 8 significant bits, so BF16-level results), QK reads both operands from shared memory
(m64n32k32: hi and lo as 32 columns), PV builds V^T's register fragments by byte transposes of the
stage (register-A m64n16k32), and the per-token group scales weight the QK partials and fold into
the probabilities with a per-tile power of two. Four 42 KB stages fit beside Q and P.

`schedule="wgmma"` over NVFP4 KV with linear scales (include/k3gen/mla/decode_wg_nvfp4.cuh)
keeps the same frame. Hopper has no FP4 MMA and the tile scales change every 16 dims and 16
tokens, so each consumer decodes a tile once: e2m1 x E4M3 scale code x 2^-8 is exact in f16, the
decoded registers are QK's register-A operand (m64n16k16 f16 against Q * 2^E) and are also stored
into the consumer's f16 V tile, which PV reads MN-major as the BF16 schedule reads its stage. The
tiles mask the live 16-token tile; its rows (BF16 HP tail ring, staged once per CTA) are folded
into one consumer's softmax state in FP32 on CUDA cores, as the mma.sync kernel does.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from k3gen.errors import SpecError, TargetError
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ir.layouts import MLA_LATENT, MLA_ROW, PAGE_TOKENS, KvLayout
from k3gen.ir.spec import OpSpec, register_op

TILE_TOKENS = 64              # KV tokens per pipeline stage
THREADS = 256                 # 8 warps
SMEM_LIMIT = 227 * 1024       # opt-in shared memory per block on SM90 / SM100
SMEM_PER_SM = 228 * 1024      # shared memory per SM, shared by its resident CTAs
MAX_TOKENS = 8
SOFTMAX_SCALE = 192 ** -0.5
_PAD = 8                      # BF16 elements of padding per shared probability row
SCHEDULES = ("mma", "wgmma", "wgmma_qm")
WG_SCHEDULES = ("wgmma", "wgmma_qm")   # the sm_90a warp-specialized ones (384 threads)
# schedule="auto" (the default) resolves BF16 KV to "wgmma_qm" on wgmma targets at every H * T. H200,
# 2026-11-30 13:29 (one run, T1 L8K): B128 H128 530 us (wgmma 1070, mma.sync 2160; the naive peer
# 2030), H64 305 (wgmma 549), H16 302 (mma.sync 324), H12 302 (mma.sync 328); H12 T4 B4 27.0 (mma.sync
# 45.8, wgmma 33.4). The one loss: H12 T1 B1 L8K 15.4 us vs mma.sync 14.3 (B1 L32K 25.3 vs 25.6).
# FP8 KV resolves to "wgmma" on wgmma targets at every H * T (16 query rows per CTA there). H200,
# bench mla_decode --quick 2026-11-30 06:04-06:11, T1 L8K: H12 B128 182.3-185.8 us vs mma.sync
# 291.3-294.4 us; H128 B128 1358.8-1373.8 vs 2105.8-2114.0 us; B1 within 1 us (23.1-25.5 vs 22.4-38.1).
# NVFP4 KV with linear scales (the sm90 default) resolves to "wgmma" too. H200, 2026-11-30 08:01-08:09,
# H12 T1 L8K: B128 247 us vs mma.sync 420 us, B32 74 vs 115 us, B1 24.5 vs 24.7 us.
WG_THREADS = 384              # wgmma schedule: producer + 2 consumer warpgroups
COMBINE_THREADS = 512         # split combine: 4 groups of 128 threads x 4 columns
WG_STAGES = 2                 # one 72 KB tile per consumer warpgroup (a third does not fit with Q)
WG_ALIGN = 1024               # SW128 operand tiles are 1024-byte aligned; the kernel aligns the base up
WG_OSTRIDE = MLA_LATENT + 4   # FP32 per row of the merge buffer (conflict-free fragment stores)
# wgmma schedule over FP8 KV (mla/decode_wg_fp8.cuh): 16 query rows per CTA, E4M3 hi/lo query and
# probabilities; a stage is the tile's codes as 5 SW128 blocks plus its [64][5] FP32 scales.
WG8_CODE_BYTES = 5 * TILE_TOKENS * 128
WG8_SCALE_BYTES = TILE_TOKENS * 5 * 4
WG8_ROWS = 16
# wgmma schedule over NVFP4 KV with linear scales (mla/decode_wg_nvfp4.cuh): 16 query rows per CTA; a
# stage is the tile's codes (latent [64][256], rope [64][32]) and its scale bytes; each consumer
# decodes into its own [64][512] f16 V tile; the live rows (<= 16, BF16) are staged once per CTA.
WG4_STAGE_BYTES = TILE_TOKENS * (MLA_ROW // 2) + 4 * 32 + TILE_TOKENS * 4
WG4_RING_BYTES = 16 * MLA_ROW * 2
WG4_V_BYTES = TILE_TOKENS * MLA_LATENT * 2


def _stacked(parts) -> dict:
    """Byte offsets of (name, size) regions laid one after another, plus "end" and "total" (end + the
    slack the kernel uses to align the dynamic window up to 1024 bytes)."""
    plan, off = {}, 0
    for name, size in parts:
        plan[name] = off
        off += size
    plan["end"] = off
    plan["total"] = off + WG_ALIGN
    return plan


@register_op("mla_decode")
@dataclass(frozen=True, kw_only=True)
class MlaDecodeSpec(OpSpec):
    heads: int                            # per rank: 6, 12, 24, 48, 96; 1..128
    tokens: int = 1                       # T query tokens per sequence (1 decode, 1 + M verify)
    kv: KvDtype = KvDtype.BF16
    fp8_scales: Fp8ScaleGranularity = Fp8ScaleGranularity.PER_TOKEN_128
    scale_layout: ScaleLayout | None = None  # NVFP4 only; defaults to the target's layout
    max_drafts: int = 0                   # NVFP4 HP tail ring = 16 + max_drafts rows
    m_tiles: int | None = None            # 16-row query tiles per CTA; default from H * T (and schedule)
    schedule: str = "auto"                # "mma" (mma.sync, every target), "wgmma" (sm_90a),
                                          # "wgmma_qm" (sm_90a, BF16 KV, query rows on M) or
                                          # "auto" (resolved here by target, KV dtype and H * T)

    def __post_init__(self):
        if (self.schedule == "auto" and isinstance(self.heads, int) and isinstance(self.tokens, int)
                and hasattr(self.target, "mma")):
            layout = self.scale_layout or self.target.nvfp4_scale_layout
            wg = self.target.mma == "wgmma" and (
                self.kv is KvDtype.FP8 or (self.kv is KvDtype.NVFP4 and layout is ScaleLayout.LINEAR))
            qm = self.target.mma == "wgmma" and self.kv is KvDtype.BF16
            object.__setattr__(self, "schedule", "wgmma_qm" if qm else "wgmma" if wg else "mma")
        if self.scale_layout is None:
            object.__setattr__(self, "scale_layout", self.target.nvfp4_scale_layout
                               if self.kv is KvDtype.NVFP4 else ScaleLayout.LINEAR)
        if self.m_tiles is None and isinstance(self.heads, int) and isinstance(self.tokens, int):
            object.__setattr__(self, "m_tiles", self._default_m_tiles())
        super().__post_init__()

    def _default_m_tiles(self) -> int:
        ht = self.heads * self.tokens
        if self.schedule == "wgmma_qm":
            return 4
        if ht <= 16 or (self.schedule == "wgmma" and self.kv is not KvDtype.BF16):
            return 1
        return 4 if self.schedule == "wgmma" and ht > 32 else 2

    def validate(self) -> None:
        if not isinstance(self.heads, int) or isinstance(self.heads, bool) or not 1 <= self.heads <= 128:
            raise SpecError("heads", self.heads, "1..128")
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or not 1 <= self.tokens <= MAX_TOKENS:
            raise SpecError("tokens", self.tokens, f"1..{MAX_TOKENS}")
        if not isinstance(self.kv, KvDtype):
            raise SpecError("kv", self.kv, [k.value for k in KvDtype])
        if self.kv not in self.target.kv_dtypes:
            raise TargetError("kv", self.kv.value, [k.value for k in self.target.kv_dtypes],
                              f"target {self.target.name}")
        if self.kv is not KvDtype.NVFP4 and self.scale_layout is not ScaleLayout.LINEAR:
            raise SpecError("scale_layout", self.scale_layout.value, [ScaleLayout.LINEAR.value],
                            f"{self.kv} KV has no FP4 tile scales")
        if self.kv is not KvDtype.NVFP4 and self.max_drafts:
            raise SpecError("max_drafts", self.max_drafts, [0], "only NVFP4 KV keeps an HP tail ring")
        if self.schedule not in SCHEDULES:
            raise SpecError("schedule", self.schedule, list(SCHEDULES))
        if self.schedule in WG_SCHEDULES:
            if self.target.mma != "wgmma":
                raise TargetError("schedule", self.schedule, ["mma"], f"target {self.target.name} has no wgmma")
            if self.kv is KvDtype.NVFP4 and self.scale_layout is not ScaleLayout.LINEAR:
                raise SpecError("scale_layout", self.scale_layout.value, [ScaleLayout.LINEAR.value],
                                "the NVFP4 wgmma schedule reads linear tile scales (the 128x4 swizzle is "
                                "the SM100 family's; schedule 'mma' reads both)")
        if self.schedule == "wgmma_qm" and self.kv is not KvDtype.BF16:
            raise SpecError("kv", self.kv.value, [KvDtype.BF16.value], "schedule 'wgmma_qm' reads BF16 KV")
        if self.schedule == "wgmma_qm":
            allowed = [4]
        elif self.schedule == "wgmma" and self.kv is not KvDtype.BF16:
            allowed = [1]
        else:
            allowed = [1, 2, 4] if self.schedule == "wgmma" else [1, 2]
        if self.m_tiles not in allowed:
            raise SpecError("m_tiles", self.m_tiles, allowed, "registers: 32 FP32 accumulators per tile"
                            + ("; wgmma 4: two consumers of 32 rows" if self.schedule == "wgmma" else "")
                            + ("; FP8/NVFP4 wgmma: 16 rows (H * T <= 16)" if allowed == [1] else ""))
        self.layout  # page and draft checks live in KvLayout
        if self.smem_bytes > self.smem_limit:
            raise SpecError("m_tiles", self.m_tiles, "a smaller value",
                            f"{self.smem_bytes} B of shared memory > {self.smem_limit}")

    @property
    def layout(self) -> KvLayout:
        return KvLayout(kv=self.kv, page=PAGE_TOKENS[self.kv], fp8_scales=self.fp8_scales,
                        scale_layout=self.scale_layout, max_drafts=self.max_drafts)

    @property
    def page(self) -> int:
        return PAGE_TOKENS[self.kv]

    # -- geometry (mirrored by static_asserts in the template) -------------------------------
    @property
    def threads(self) -> int:
        return WG_THREADS if self.schedule in WG_SCHEDULES else THREADS

    @property
    def combine_threads(self) -> int:
        """Threads of the split combine (templates: kCombineThreads): 4 groups of 128, each a
        quarter of the splits over all 512 columns (4 per thread)."""
        return COMBINE_THREADS

    @property
    def max_registers(self) -> int:
        """One CTA per SM (the pipeline takes most of the shared memory): 255 costs no occupancy.
        The wgmma schedule launches 384 threads: 168 each at launch, then setmaxnreg moves the
        producer to 56 and the consumers to 224 (128 * 56 + 256 * 224 <= 65536)."""
        return 168 if self.schedule in WG_SCHEDULES else 255

    @property
    def softmax_scale(self) -> float:
        return SOFTMAX_SCALE

    @property
    def rows(self) -> int:
        """Query rows per CTA."""
        return 16 * self.m_tiles

    @property
    def wg_split_rows(self) -> bool:
        """wgmma schedule: the two consumers take half the rows each (every tile) rather than
        alternate tiles (all rows)."""
        return self.schedule == "wgmma" and self.m_tiles == 4

    @property
    def wg_cols(self) -> int:
        """wgmma schedule: query rows per consumer = the N of its m64nNk16 instructions."""
        return self.rows // 2 if self.wg_split_rows else self.rows

    @property
    def groups(self) -> int:
        """CTAs per (sequence, split): query rows H * T in tiles of `rows`."""
        return -(-self.heads * self.tokens // self.rows)

    @property
    def raw_stage_bytes(self) -> int:
        """Bytes one pipeline stage holds before dequantization (codes + scales of 64 tokens)."""
        if self.kv is KvDtype.BF16:
            return TILE_TOKENS * MLA_ROW * 2                     # XOR-swizzled rows, no padding
        if self.kv is KvDtype.FP8:
            # 608-byte code rows (bank-conflict free fragment loads), 5 scales padded to 8
            return TILE_TOKENS * (MLA_ROW + 32) + TILE_TOKENS * 8 * 4
        # 304-byte code rows (288 + 16: conflict-free fragment loads) + scale bytes (swizzled half page)
        return TILE_TOKENS * (MLA_ROW // 2 + 16) + 9 * 32 * 8

    @property
    def ctas_per_sm(self) -> int:
        """Resident CTAs per SM the mma schedule is built for (launch bounds and shared memory).
        FP8/NVFP4 with one query tile: 2. Their fragment decode makes them issue/latency-bound at 8
        warps per SM (H200 ncu: DRAM 39% / 15%, 38% of FP8 stall samples on fixed-latency
        dependencies), so Q moves from registers (144 per thread) to shared memory for a second
        CTA; BF16 keeps Q in registers and a 3-deep ring of 72 KB tiles at one CTA per SM."""
        if self.schedule == "mma" and self.kv is not KvDtype.BF16 and self.m_tiles == 1:
            return 2
        return 1

    @property
    def q_in_registers(self) -> bool:
        return self.m_tiles == 1 and self.ctas_per_sm == 1

    @property
    def smem_limit(self) -> int:
        """Dynamic shared memory one CTA may use: the per-block cap, or its share of the SM's
        228 KB (each resident CTA also reserves 1 KB)."""
        return min(SMEM_LIMIT, SMEM_PER_SM // self.ctas_per_sm - 1024)

    @property
    def stages(self) -> int:
        """KV ring depth: as many stages as fit, 2..4 (BF16 tiles are their own buffer; the BF16 wgmma
        schedules keep two 72 KB stages beside the query)."""
        if self.schedule in WG_SCHEDULES:
            if self.kv is not KvDtype.BF16:
                plan = self._wg8_plan if self.kv is KvDtype.FP8 else self._wg4_plan
                for st in (4, 3, 2):
                    if plan(st)["total"] <= self.smem_limit:
                        return st
            return WG_STAGES
        fixed = self._fixed_smem()
        for s in (4, 3, 2):
            if fixed + s * self.raw_stage_bytes <= self.smem_limit:
                return s
        return 2

    def _fixed_smem(self) -> int:
        r = self.rows
        # Register Q (one 16-row tile at one CTA per SM) is staged once through the last ring
        # stage; otherwise the query rows are re-read from shared memory per KV tile.
        q = 0 if self.q_in_registers else r * (MLA_ROW * 2 + (0 if self.kv is KvDtype.BF16 else 64))
        s = r * (TILE_TOKENS + 4) * 4                 # FP32 scores
        p = r * (TILE_TOKENS + _PAD) * 2              # BF16 probabilities
        stats = r * 4 * 4                             # m, l, alpha, causal limit
        return q + s + p + stats

    @property
    def smem_bytes(self) -> int:
        if self.schedule in WG_SCHEDULES:
            return self.wg_smem()["total"]
        return self._fixed_smem() + self.stages * self.raw_stage_bytes

    def wg_smem(self) -> dict:
        """Shared-memory plan of the wgmma schedule (byte offsets from the 1024-aligned base;
        mirrored by mla/decode_wg.cuh's WgGeo, checked by static_asserts in the template).
        stages: 2 x 64 x 576 BF16 KV tiles as 9 SW128 K-major blocks of [64 tok][64 dims];
        q: [rows][576] as 9 SW128 blocks of [rows][64 dims]; p: one [cols][64 tok] SW128 tile per
        consumer (cols = wg_cols); red: column maxima [2 consumers][4 warps][cols] (one buffer: a
        consumer's warps all pass the P barrier between reading it and rewriting it); stats: m, l
        per consumer and row, only when the consumers' states are merged (alternate tiles); bars:
        full[2], empty[2]. The final [rows][516] FP32 output buffer reuses the stages."""
        if self.kv is KvDtype.FP8:
            return self._wg8_plan(self.stages)
        if self.kv is KvDtype.NVFP4:
            return self._wg4_plan(self.stages)
        if self.schedule == "wgmma_qm":
            return self._qm_plan()
        r, n = self.rows, self.wg_cols
        plan = _stacked((("stages", WG_STAGES * self.raw_stage_bytes), ("q", r * MLA_ROW * 2),
                         ("p", 2 * n * TILE_TOKENS * 2), ("red", 2 * 4 * n * 4),
                         ("stats", 0 if self.wg_split_rows else 2 * 2 * r * 4), ("bars", 4 * 8)))
        assert r * WG_OSTRIDE * 4 <= WG_STAGES * self.raw_stage_bytes
        return plan

    def _qm_plan(self) -> dict:
        """wgmma_qm plan (mla/decode_wg_qm.cuh's QmGeo): the two 72 KB stages, Q (9 SW128 blocks of [64
        rows][64 dims]), P ([64 rows][64 tok] SW128), the tile's per-row rescale factors, the final m
        and l per row, full/empty mbarriers per stage."""
        return _stacked((("stages", WG_STAGES * self.raw_stage_bytes), ("q", 64 * MLA_ROW * 2),
                         ("p", 64 * TILE_TOKENS * 2), ("alpha", 64 * 4), ("stats", 2 * 64 * 4), ("bars", 4 * 8)))

    def _wg8_plan(self, stages: int) -> dict:
        """FP8 wgmma plan (mla/decode_wg_fp8.cuh's Geo8): stages of codes, their scales, then from a
        1024-aligned offset Q hi and lo (5 SW128 blocks of [16 rows][128 B] each), P ([16][128 B]
        per latent scale group, per consumer), red ([consumer][warp][16 maxima + scale max, padded
        to 20]), stats, full/empty mbarriers per stage."""
        plan = {"stages": 0, "scales": stages * WG8_CODE_BYTES}
        q = plan["scales"] + stages * WG8_SCALE_BYTES
        plan["q"] = -(-q // WG_ALIGN) * WG_ALIGN
        plan["p"] = plan["q"] + 2 * 5 * WG8_ROWS * 128
        plan["red"] = plan["p"] + 2 * 4 * WG8_ROWS * 128
        plan["stats"] = plan["red"] + 2 * 4 * (WG8_ROWS + 4) * 4
        plan["bars"] = plan["stats"] + 2 * 2 * WG8_ROWS * 4
        plan["end"] = plan["bars"] + 2 * stages * 8
        plan["total"] = plan["end"] + WG_ALIGN
        return plan

    def _wg4_plan(self, stages: int) -> dict:
        """NVFP4 wgmma plan (mla/decode_wg_nvfp4.cuh's Geo4): stages, the live rows ([16][576] BF16), from a
        1024-aligned offset the two consumers' decoded V tiles (8 SW128 blocks of [64 tok][64 dims]
        f16 each; later the [16][516] FP32 merge buffer), Q (9 SW128 blocks of [16][64] f16), P^T per
        consumer ([16][64] f16), red ([consumer][warp][16]), stats, full/empty mbarriers per stage."""
        plan = {"stages": 0, "ring": stages * WG4_STAGE_BYTES}
        plan["v"] = -(-(plan["ring"] + WG4_RING_BYTES) // WG_ALIGN) * WG_ALIGN
        plan["q"] = plan["v"] + 2 * WG4_V_BYTES
        plan["p"] = plan["q"] + 9 * WG8_ROWS * 128
        plan["red"] = plan["p"] + 2 * WG8_ROWS * 128
        plan["stats"] = plan["red"] + 2 * 4 * WG8_ROWS * 4
        plan["bars"] = plan["stats"] + 2 * 2 * WG8_ROWS * 4
        plan["end"] = plan["bars"] + 2 * stages * 8
        plan["total"] = plan["end"] + WG_ALIGN
        return plan

    @property
    def wg_desc_probe(self) -> tuple[int, int]:
        """(shared address, descriptor) the template's static_assert checks the device encoder
        against: the MN-major V^T operand of the last PV step of the second stage."""
        from k3gen.arch.sm90 import SW128_MNMAJOR_1BLOCK, encode_desc, sw128_mnmajor
        addr = self.raw_stage_bytes + 7 * TILE_TOKENS * 128 + 3 * 2048 + 1024
        if self.schedule == "wgmma_qm":   # V as N-major B over two 64-dim blocks: dims 384..511, last k16
            addr = self.raw_stage_bytes + 6 * TILE_TOKENS * 128 + 3 * 2048
            return addr, encode_desc(addr, sw128_mnmajor(TILE_TOKENS * 128))
        return addr, encode_desc(addr, SW128_MNMAJOR_1BLOCK)

    def slug(self) -> str:
        s = f"h{self.heads}-t{self.tokens}-{self.kv.value}"
        if self.kv is KvDtype.FP8:
            s += "-" + ("tensor" if self.fp8_scales is Fp8ScaleGranularity.PER_TENSOR else "tok128")
        if self.kv is KvDtype.NVFP4:
            s += f"-{self.scale_layout.value}-m{self.max_drafts}"
        if self.m_tiles != self._default_m_tiles():
            s += f"-mt{self.m_tiles}"
        if self.schedule != "mma":
            s += f"-{self.schedule}"
        return s

    # -- estimates --------------------------------------------------------------------------
    def kv_bytes(self):
        """KV bytes read for B sequences of L tokens (sympy over B, L): the bench's byte count.
        NVFP4 adds the HP tail rows of the live tile (7.5 on average)."""
        B, L = sym("B"), sym("L")
        b = B * L * self.layout.bytes_per_token
        if self.kv is KvDtype.NVFP4:
            b += B * sympy.Rational(15, 2) * MLA_ROW * 2
        return b

    def bytes_moved(self):
        B, L = sym("B"), sym("L")
        qo = B * self.tokens * self.heads * (MLA_ROW + MLA_LATENT) * 2
        meta = B * 4 * (1 + L / self.page)
        return self.kv_bytes() + qo + meta

    def flops(self):
        B, L = sym("B"), sym("L")
        return 2 * B * L * self.tokens * self.heads * (MLA_ROW + MLA_LATENT)


def choose_splits(batch: int, max_len: int, heads: int, sm_count: int, tokens: int = 1,
                  rows_per_cta: int | None = None, max_splits: int = 132) -> int:
    """KV splits per (sequence, row group): enough CTAs for about one wave of `sm_count` CTA slots
    (SMs x MlaDecodeSpec.ctas_per_sm: the pipeline takes most of the shared memory), at least 2 KV
    tiles per split.

    Depends only on the batch size and the largest length, so a graph captured with it stays
    valid for any lengths up to that maximum (each CTA splits its own sequence's tiles on the
    device).
    """
    if rows_per_cta is None:
        rows_per_cta = 16 if heads * tokens <= 16 else 32
    base = batch * -(-heads * tokens // rows_per_cta)
    if base == 0 or base * 2 > sm_count:
        return 1
    tiles = -(-max_len // TILE_TOKENS)
    n = int(max(1, min(sm_count // base, tiles // 2, max_splits)))
    # Each CTA takes ceil(tiles / n) tiles, so no more splits than that needs: 512 tiles over 132
    # splits leave 4 CTAs empty (still launched, still merged). H200 sweep 2026-11-30 08:41
    # (scripts/sweep_mla_splits.py, H12 B1 L32K): 128 splits 26.85 / 22.37 / 22.72 us vs 132 splits
    # 27.18 / 22.99 / 23.25 (BF16 / FP8 / NVFP4); B4 L8K: 32 vs 33 splits 23.55 vs 24.13 us (BF16).
    per = -(-tiles // n)
    return -(-tiles // per)


def plan_splits(lengths, heads: int, sm_count: int, tokens: int = 1, rows_per_cta: int | None = None) -> int:
    """choose_splits for a batch given by its lengths (a sequence or a CPU tensor)."""
    vals = [int(x) for x in (lengths.tolist() if hasattr(lengths, "tolist") else lengths)]
    return choose_splits(len(vals), max(vals, default=0), heads, sm_count, tokens, rows_per_cta)
