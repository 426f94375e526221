"""The kernels that implement kda_prefill, in the order `auto` tries them (the spec's `algo` field
carries the choice), and each one's plan: record size, state-pass launches, shared memory, TMEM.

- `chunk64_tc` (targets with tcgen05, the SM100 family: sm103 / sm107; include/k3gen/kda/
  prefill_chunk64_tc.cuh): chunk64's prep and emit (the same code; prep writes its record as the
  128B-swizzled K-major operand images the MMAs read) with the state pass on tcgen05: one CTA of 5
  warps per (sequence, head) keeps S^T (128 x 128 FP32) in TMEM for the whole sequence and issues
  M = 128 kind::f16 MMAs with BF16 operands from shared memory (S_b and V_new as the warps round
  them, the record's tiles by bulk copy); the FP32 parts (U^T as the accumulator's start, the
  e^(G_C) column scaling of S) by the warps through tcgen05.ld/st. chunk64's rounding contract
  (spec.py, the header), so its tolerances hold. Proven by compile, SASS and CPU replay only (no
  Blackwell GPU in this project). Prep stays on mma.sync: its MMAs are small beside its FP32 solve
  and its 220 KB of shared memory leaves no room for operand images.
- `chunk64` (every sm_90+ target; prefill_chunk64.cuh): 64-token WY chunks, BF16 mma.sync operands
  with FP32 sums, FP32 state and solve; the state pass split over the state rows (W warps of 16
  rows, 8 / W CTAs per (sequence, head), W chosen at launch). H200-tested.

The 16-token 3xTF32 forms (`chunk16`, `chunkpar`) were deleted once chunk64 passed the H200 tests
(issue 30); the FP32 token loop in reference.py stays the oracle.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.arch.sm100 import idesc_f16, umma_desc
from k3gen.arch.sm90 import SW128_KMAJOR
from k3gen.ir.layouts import KDA_DK
from k3gen.ir.variant import VariantTable
from k3gen.ops.kda_decode.variants import ASYNC_COPIES, KdaKernel
from k3gen.ops.kda_prefill.spec import (C64_PREP_SMEM, C64_REC_BYTES, C64_REC_HEAD, C64_STATE_WARPS, C64TC_REC_BYTES,
                                          C64TC_REC_TILES, KdaPrefillSpec, c64_state_smem)

SMEM_LIMIT = 227 * 1024   # opt-in dynamic shared memory per block (SM90 and the SM100 family)
TMEM_COLS = 512           # TMEM columns per SM (128 lanes x 32 bits each)
C = 64                    # tokens per chunk


@dataclass(frozen=True)
class StateLaunch:
    """One entry of the state pass: grid (H, B, grid_z), `threads` per CTA."""
    entry: str
    threads: int
    grid_z: int
    smem_bytes: int
    tmem_cols: int = 0    # TMEM columns each CTA allocates (tcgen05)


@dataclass(frozen=True)
class Plan:
    rec_bytes: int        # one (chunk, head) record of the workspace
    prep_smem: int        # prep's dynamic shared memory (emit uses none)
    states: dict          # key -> StateLaunch; chunk64: by warps (the launcher picks), chunk64_tc: one
    smem: dict            # chunk64_tc: byte offsets of the state pass's regions (1024-aligned base)
    tmem: dict            # chunk64_tc: first TMEM column of S^T, D_V and the two D_O buffers


def tc_smem() -> dict:
    """prefill_chunk64_tc.cuh's state-pass plan: the record tiles of two buffers, S_b ([128][128]
    BF16), V_b ([128][64] BF16), the FP32 parts (e^(G_C) | U^T) of two buffers, 6 mbarriers, the TMEM
    address slot; `total` adds the 1024 bytes that align the dynamic window up."""
    eu = C64TC_REC_BYTES - C64TC_REC_TILES
    s = {"tiles": 0, "sb": 2 * C64TC_REC_TILES}
    s["vb"] = s["sb"] + KDA_DK * KDA_DK * 2
    s["eu"] = s["vb"] + KDA_DK * C * 2
    s["bars"] = s["eu"] + 2 * eu
    s["tmem"] = s["bars"] + 6 * 8
    s["end"] = s["tmem"] + 16
    s["total"] = s["end"] + 1024
    return s


TC_TMEM = {"S": 0, "V": 128, "O": (256, 320)}   # columns; 384 used, 512 allocated (a power of two)
TC_THREADS = 160                                # 4 TMEM warps (thread = state row v) + the MMA/copy warp
# The record's operand images (byte offsets; prefill_chunk64_tc.cuh kOff*) and their rows.
TC_REC = {"w": (0, C), "qg": (C * KDA_DK * 2, C), "kgt": (2 * C * KDA_DK * 2, KDA_DK),
          "aqk": (3 * C * KDA_DK * 2, C), "egl": (C64TC_REC_TILES, 0), "ut": (C64TC_REC_TILES + KDA_DK * 4, 0)}


@dataclass(frozen=True)
class PrefillKernel(KdaKernel):
    def plan(self, spec) -> Plan:
        states = {w: StateLaunch(f"k3gen_kda_prefill_state{w}", 32 * w, 8 // w, c64_state_smem(w))
                  for w in C64_STATE_WARPS}
        return Plan(rec_bytes=C64_REC_BYTES, prep_smem=C64_PREP_SMEM, states=states, smem={}, tmem={})

    def inputs(self, spec) -> dict:
        """The template's values: prep's record layout, the static_asserts that tie the headers to
        this plan, and the state-pass entries."""
        plan = self.plan(spec)
        asserts = [(f"sizeof(k3gen::kda::c64::Rec) == {C64_REC_BYTES} && k3gen::kda::c64::kRecHead == {C64_REC_HEAD} &&"
                    f"\n              k3gen::kda::c64::kC == {spec.par_item}", "workspace layout the launcher sizes (spec.py)")]
        asserts += [(f"sizeof(k3gen::kda::c64::StateSmem<{w}>) <= {st.smem_bytes}", f"dynamic shared memory of state{w}")
                    for w, st in plan.states.items()]
        states = [{"entry": st.entry, "threads": st.threads,
                   "comment": f"the state pass with {w} warps (16 rows of S^T each), grid ({spec.heads}, B, {st.grid_z}).",
                   "call": f"k3gen::kda::c64::state<Config, {w}>(p, *reinterpret_cast<k3gen::kda::c64::StateSmem<{w}>*>"
                           "(smem_raw))"} for w, st in plan.states.items()]
        return {**super().inputs(spec), "doc": self.doc, "prep_args": "Config", "asserts": asserts, "states": states}


@dataclass(frozen=True)
class TcPrefillKernel(PrefillKernel):
    def plan(self, spec) -> Plan:
        smem = tc_smem()
        st = StateLaunch("k3gen_kda_prefill_state_tc", TC_THREADS, 1, smem["total"], TMEM_COLS)
        return Plan(rec_bytes=C64TC_REC_BYTES, prep_smem=C64_PREP_SMEM, states={"tc": st}, smem=smem, tmem=TC_TMEM)

    def inputs(self, spec) -> dict:
        plan = self.plan(spec)
        st, sm = plan.states["tc"], plan.smem
        ns = "k3gen::kda::c64tc::"
        j = " &&\n              "
        asserts = [
            (f"{ns}kRecBytes == {C64TC_REC_BYTES} && {ns}kTiles == {C64TC_REC_TILES} && k3gen::kda::c64::kC == "
             f"{spec.par_item}", "workspace layout the launcher sizes (spec.py)"),
            (j.join(f"{ns}kOff{n} == {TC_REC[k][0]}" for n, k in (("W", "w"), ("Qg", "qg"), ("Kgt", "kgt"),
                                                                  ("Aqk", "aqk"), ("Egl", "egl"), ("Ut", "ut"))),
             "record offsets differ from variants.py TC_REC"),
            (f"{ns}kSmem == {st.smem_bytes} && {ns}kThreads == {st.threads} && {ns}kTmemCols == {st.tmem_cols}" + j +
             j.join(f"{ns}kSm{n} == {sm[k]}" for n, k in (("Sb", "sb"), ("Vb", "vb"), ("Eu", "eu"), ("Bar", "bars"),
                                                          ("Tmem", "tmem"))) + j +
             f"{ns}kColS == {TC_TMEM['S']} && {ns}kColV == {TC_TMEM['V']} && {ns}kColO == {TC_TMEM['O'][0]}",
             "state_tc shared-memory / TMEM plan differs from variants.py"),
        ] + tc_probes()
        states = [{"entry": st.entry, "threads": st.threads,
                   "comment": f"the state pass on tcgen05, S^T in TMEM, grid ({spec.heads}, B, 1), "
                              f"{st.smem_bytes} B dynamic shared memory, {st.tmem_cols} TMEM columns.",
                   "call": "k3gen::kda::c64tc::state<Config>(p, smem_raw)"}]
        return {**super().inputs(spec), "prep_args": "Config, k3gen::kda::c64tc::RecTc", "asserts": asserts,
                "states": states}


def sw128(rows: int, row: int, ch: int) -> int:
    """prefill_chunk64_tc.cuh c64tc::sw128: byte of 16-byte chunk `ch` of `row` in a `rows`-row operand
    of SW128 blocks of [rows][64 BF16] (k3gen.arch.sm90.blocked_sw128_offset)."""
    return (ch >> 3) * rows * 128 + (row >> 3) * 1024 + (row & 7) * 128 + (((ch & 7) ^ (row & 7)) << 4)


def kstep(rows: int, ks: int) -> int:
    """c64tc::kstep: where k16 step ks of a `rows`-row SW128 operand starts (4 steps of 32 bytes a block)."""
    return (ks >> 2) * rows * 128 + (ks & 3) * 32


def ut_off(v: int, r4: int) -> int:
    """c64tc::ut_off: the record byte of U^T row v, t = 4 r4 .. 4 r4 + 3 (FP32)."""
    return TC_REC["ut"][0] + (r4 * KDA_DK + v) * 16


def tc_probes() -> list[tuple[str, str]]:
    """The header's encoders and address functions against k3gen.arch.sm100 and this module's twins."""
    ns = "k3gen::kda::"
    a = tc_smem()["sb"] + 16384 + 96
    pts = ((64, 37, 11), (128, 101, 5), (128, 7, 15), (64, 0, 0))
    return [
        (f"k3gen::sm100::desc<16, 1024>({a}u) == {umma_desc(a, SW128_KMAJOR)}ull", "tcgen05 descriptor differs from "
         "k3gen.arch.sm100.umma_desc"),
        (f"k3gen::sm100::idesc<true, false, 128, 64>() == {idesc_f16(bf16=True, m=128, n=64)}u && "
         f"k3gen::sm100::idesc<true, false, 128, 128>() == {idesc_f16(bf16=True, m=128, n=128)}u",
         "tcgen05 instruction descriptor differs from k3gen.arch.sm100.idesc_f16"),
        (" && ".join(f"{ns}c64tc::sw128({r}, {w}, {c}) == {sw128(r, w, c)}u" for r, w, c in pts),
         "SW128 offsets differ from variants.sw128"),
        (" && ".join(f"{ns}c64tc::kstep({r}, {ks}) == {kstep(r, ks)}u" for r in (64, 128) for ks in (1, 4, 7)) +
         " &&\n              " + " && ".join(f"{ns}c64tc::ut_off({v}, {r4}) == {ut_off(v, r4)}u"
                                             for v, r4 in ((0, 0), (37, 5), (127, 15))),
         "MMA k-step / U^T offsets differ from variants.kstep / ut_off"),
    ]


_TCGEN05 = (lambda s: s.target.mma == "tcgen05", "needs tcgen05 (the sm_100a family); this target has none")

VARIANTS = VariantTable("kda_prefill", (
    TcPrefillKernel("chunk64_tc", lowering="nvrtc", header="k3gen/kda/prefill_chunk64_tc.cuh",
                    doc="chunk64's prep and emit; the state pass on tcgen05 (S^T in TMEM, M = 128 kind::f16 BF16 "
                        "MMAs, FP32 state), chunk64's rounding contract; compile-only",
                    checks=(ASYNC_COPIES, _TCGEN05)),
    PrefillKernel("chunk64", lowering="nvrtc", header="k3gen/kda/prefill_chunk64.cuh",
                  doc="64-token WY chunks, BF16 mma.sync operands with FP32 sums, FP32 state and solve; "
                      "parallel prep and emit, sequential state pass split over the state rows",
                  checks=(ASYNC_COPIES,)),
))
KdaPrefillSpec.variants = VARIANTS
