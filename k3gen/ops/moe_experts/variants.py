"""The kernels that implement moe_experts, in the order `auto` tries them: "mma_swapab" on targets
without hardware FP4 conversion (SM90), "tcgen05" on the SM100 family (sm103 / sm107). Both implement
the one contract of spec.py with the same launch interface (ExpertArgs, work items, combine entry,
error word, workspace), so the launcher and the torch op serve every target.

"mma_swapab" (SM90, NVRTC; include/k3gen/moe/experts.cuh): warp-level mma.sync m16n8k16 BF16 with
the weight rows on M (16 per warp: 8 gate + 8 up rows for gate_up, so one lane holds a column's
gate and up and applies the activation in registers) and the few tokens of an expert on N (8 per
MMA, n_tiles per item). The E2M1 codes are decoded in registers by two byte-permute lookups per
four nibbles (prmt) into exact BF16, times the group scale (an exact BF16 product: e2m1 * 2^n, or
e2m1 * e4m3 which has at most 5 significant bits). Each lane owns 32 consecutive K values of its two
rows per 128-column chunk (one 16-byte load per row; the activation operand uses the same K
permutation), so every weight byte is read once with 16-byte loads and a warp holds up to 8
chunks of both rows in flight before its first MMA. K is split over up to 8 warps of a CTA and
summed in warp order in shared memory, so T = 1 (16 experts) still puts thousands of warps on the
132 SMs.

Why not wgmma (a deviation from the issue's "into wgmma operands"): at decode an expert sees ~1
token (T k / E slots per expert: 0.02 at T1, 1.1 at T64 at K3 TP8), so the op moves weight bytes
and does ~1 useful MMA column in 8; wgmma would need the decoded operand in shared memory (a
register-sourced A must be the M side, 64 rows per warpgroup, 128 rows per CTA and a 64-deep K
tile per instruction), adding a shared-memory round trip per decoded byte and coarser tiles that
underfill the GPU at T = 1, for tensor throughput these shapes cannot use. mma.sync consumes
the decoded registers directly.

Deviation (intermediate): the SiTU output h is BF16 for both activation formats. An FP8
per-token-128 intermediate needs the amax of 128 columns, which span 8 CTAs of the gate_up grid;
h is T k I BF16 values (12 KB at T1), so quantizing it would cost a pass and save nothing.

"tcgen05" (sm_103a / sm_107a, NVRTC C++ with inline tcgen05 PTX; include/k3gen/moe/experts_tc.cuh;
compile + SASS + CPU replay only, never run: no Blackwell GPU exists here). Warp-specialized,
persistent over the same work items: a producer thread streams each 64-row weight tile's codes by
TMA ([32 rows][128 B] boxes, K in stages of 256) and its scale rows by bulk copies; 8 decoder warps
turn codes into BF16 with the hardware conversion (cvt.rn.bf16x2.e2m1x2, F2FP) times the group
scale (the SM90 kernel's segment_scales, an exact BF16 product) into K-major SW128 A tiles and copy
the activation rows into the B tile; one thread issues tcgen05.mma kind::f16 m64nNk16 (N = 8
n_tiles tokens) into two TMEM accumulators; 4 epilogue warps apply the NVFP4 global and SiTU (gate_up:
MMA rows 0-31 gate, 32-63 up, exchanged through shared memory) or write the FP32 partials (down).
The combine and the error-word behaviour are the SM90 kernel's own code.

Why not a block-scaled kind (a deviation from issue 21's "tcgen05 block-scaled MMA"): the numerics
contract is exact dequantization with BF16 activations (W4A16, what the model launches) and a BF16
intermediate h in every format. kind::mxf8f6f4 would take MXFP4 weights as they are (E2M1, UE8M0
per 32) but needs the other operand in FP8/FP6/FP4 with UE8M0 per-32 scales: BF16 x and h are not
representable (splitting them into E4M3 pieces is inexact for elements far below their group's
max); kind::mxf4nvf4 needs both operands E2M1; NVFP4 weights (E4M3 per-16 scales) against E4M3
activations have no block-scaled kind at all. The MMA rate is not what bounds this op: at decode an
expert sees about one token (N padded to 8 n_tiles), so the kernel moves weight bytes, and the
decode costs one F2FP and one HMUL2 per two values on the CUDA cores. The one exact block-scaled
case left (MXFP4 x FP8-UE8M0 activations, gate_up only) is not built.

Refused on tcgen05: FP8 activations with FP32 per-token-128 scales (the SM90 kernel applies them to
FP32 partial sums per 128 columns; as BF16 operand factors they round, and per-128-column TMEM
partials are not built); hidden not a multiple of 64 (the down GEMM's 64-row M tiles). FP8
activations with UE8M0 scales become E4M3 x 2^(b - 127) BF16 operands: the reference's values bit for
bit for scale bytes 3..254 (an E4M3 x 2^n product has 4 significant bits; past BF16's range it is
past FP32's too); bytes 0..2 round products below BF16's subnormal step. The SM90 kernel scales FP32
partials instead.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.moe_experts.spec import ActFormat, MoeExpertsSpec, cdiv

SMEM_LIMIT = 227 * 1024   # opt-in shared memory per block (static + dynamic) on the SM100 family
TC_ROWS = 64              # MMA M: weight rows per CTA tile (gate_up: 32 gate + the 32 up rows below)
TC_KSTAGE = 256           # K values per stage: one 128-byte TMA box row of codes
TC_DEC_WARPS, TC_EPI_WARPS = 8, 4
TC_THREADS = 32 * (TC_DEC_WARPS + TC_EPI_WARPS + 2)   # + the producer and the MMA warps: 448
TC_OP_STAGES = 2          # decoded operand tiles (decoders -> MMA): a double buffer
TC_MAX_RAW = 16           # raw code stages in flight at most
TC_MAX_SCALE_BUFS = 8
ALIGN = 1024


def _up(a: int, b: int) -> int:
    return cdiv(a, b) * b


@dataclass(frozen=True)
class TcPlan:
    """One grouped GEMM of the tcgen05 kernel (experts_tc.cuh Geo mirrors it; the template's
    static_asserts compare the two): a CTA per 64-row M tile and item row, K in `stages` stages of
    `kstage` values, `raw_stages` TMA stages of codes in flight, `op_stages` decoded operand tiles,
    `scale_bufs` items' scale rows, two TMEM accumulators of `nb` columns."""
    gate_up: bool
    rows: int                 # weight rows per expert (2I or W)
    k: int
    kstage: int
    stages: int
    nb: int
    raw_stages: int
    op_stages: int
    scale_bufs: int
    group: int
    smem: dict                # byte offsets from the 1024-aligned base, "end" and "total"
    threads: int = TC_THREADS

    @property
    def mtiles(self) -> int:
        return self.rows // TC_ROWS

    grid_x = mtiles

    @property
    def smem_bytes(self) -> int:
        return self.smem["total"]

    @property
    def scale_row(self) -> int:
        return self.k // self.group

    @property
    def raw_bytes(self) -> int:
        return TC_ROWS * self.kstage // 2

    @property
    def atoms(self) -> int:
        return cdiv(self.kstage, 64)

    @property
    def a_bytes(self) -> int:
        return self.atoms * TC_ROWS * 128

    @property
    def b_atom(self) -> int:
        return self.nb * 128

    @property
    def op_bytes(self) -> int:
        return self.a_bytes + self.atoms * self.b_atom

    @property
    def tmem_cols(self) -> int:
        return next(c for c in (32, 64, 128) if c >= 2 * self.nb)

    @staticmethod
    def static_smem(threads: int = TC_THREADS) -> int:
        """ItemList in static shared memory: first/count per thread, warp sums, total, two Items."""
        return 8 * threads + 4 * (threads // 32) + 4 + 24

    def item_rows(self, items: int, sms: int | None) -> int:
        """grid.y: one CTA per SM is resident (the ring fills shared memory), so with the SM count
        at most sms // mtiles rows, each walking items y, y + rows, ..."""
        if sms is None:
            return items
        return max(1, min(items, sms // self.mtiles))


def tc_layout(p: dict) -> dict:
    """experts_tc.cuh Geo's offsets for the plan fields in `p`."""
    atoms = cdiv(p["kstage"], 64)
    op = atoms * TC_ROWS * 128 + atoms * p["nb"] * 128
    raw = TC_ROWS * p["kstage"] // 2
    scl = _up(TC_ROWS * p["k"] // p["group"], 16)
    off = {"op": 0, "raw": p["op_stages"] * op}
    off["scl"] = off["raw"] + p["raw_stages"] * raw
    off["xch"] = off["scl"] + p["scale_bufs"] * scl
    off["bar"] = _up(off["xch"] + 32 * (p["nb"] + 1) * 4, 8)
    off["tmem"] = off["bar"] + 8 * 2 * (p["raw_stages"] + p["op_stages"] + p["scale_bufs"] + 2)
    off["end"] = off["tmem"] + 16
    off["total"] = off["end"] + ALIGN
    return off


def tc_plan(spec: MoeExpertsSpec, gate_up: bool) -> TcPlan:
    """The raw ring depth (<= TC_MAX_RAW) and scale buffers (2..TC_MAX_SCALE_BUFS) that fit SMEM_LIMIT
    and keep the most code stages in flight: the producer runs ahead by min(raw stages, scale
    buffers x stages per item). ValueError when not even 2 raw stages fit."""
    k = spec.hidden if gate_up else spec.inter
    kstage = min(TC_KSTAGE, k)
    p = dict(gate_up=gate_up, rows=2 * spec.inter if gate_up else spec.hidden, k=k, kstage=kstage,
             stages=cdiv(k, kstage), nb=spec.tokens_per_item, op_stages=TC_OP_STAGES, group=spec.group)
    budget = SMEM_LIMIT - TcPlan.static_smem()

    def deepest(bufs: int) -> int:
        rs = TC_MAX_RAW
        while rs >= 2 and tc_layout({**p, "raw_stages": rs, "scale_bufs": bufs})["total"] > budget:
            rs -= 1
        return rs

    # Ties keep the fewer buffers (first found).
    rs, bufs = max(((deepest(b), b) for b in range(2, TC_MAX_SCALE_BUFS + 1)),
                   key=lambda c: (min(c[0], c[1] * p["stages"]), -c[1]))
    if rs < 2:
        raise ValueError(f"K = {k}: {bufs} items' scale rows and 2 raw stages exceed {SMEM_LIMIT} bytes")
    return TcPlan(raw_stages=rs, scale_bufs=bufs, smem=tc_layout({**p, "raw_stages": rs, "scale_bufs": bufs}), **p)


@functools.lru_cache(maxsize=1024)
def plans(spec: MoeExpertsSpec) -> tuple[TcPlan, TcPlan]:
    """(gate_up, down) plans of the tcgen05 kernel."""
    return tc_plan(spec, True), tc_plan(spec, False)


@dataclass(frozen=True)
class TcKernel(Variant):
    """The tcgen05 variant: its plans, and the template's checks that experts_tc.cuh's Geo agrees."""

    def plans(self, spec) -> tuple[TcPlan, TcPlan]:
        return plans(spec)

    def asserts(self, name: str, plan: TcPlan) -> list[tuple[str, str]]:
        g = f"k3gen::moe::tc::Geo<Config, {name}>"
        offs = {"Op": "op", "Raw": "raw", "Scl": "scl", "Xch": "xch", "Bar": "bar", "Tmem": "tmem", "End": "end"}
        cond = " && ".join(f"{g}::k{n}Off == {plan.smem[k]}" if n != "End" else f"{g}::kEnd == {plan.smem[k]}"
                           for n, k in offs.items())
        return [(cond, f"experts_tc.cuh Geo differs from variants.TcPlan ({name})"),
                (f"{g}::kSmem == {plan.smem_bytes} && {g}::kTmemCols == {plan.tmem_cols}",
                 f"dynamic shared memory / TMEM columns differ from the plan ({name})"),
                (f"k3gen::moe::tc::kThreads == {plan.threads}", "thread count differs from the plan")]


def _fits(spec) -> bool:
    try:
        plans(spec)
    except ValueError:
        return False
    return True

VARIANTS = VariantTable("moe_experts", (
    Variant("mma_swapab", lowering="nvrtc",
            doc="mma.sync BF16 with weight rows on M and tokens on N, E2M1 decoded in registers "
                "(prmt lookups), K split over the CTA's warps; down to FP32 partials; ordered combine",
            checks=((lambda s: s.target.sm >= 90, "needs bf16x2 multiplies and griddepcontrol (sm_90)"),
                    (lambda s: not s.target.fp4_cvt,
                     "targets with hardware FP4 (fp4_cvt) get the tcgen05 kernel"))),
    TcKernel("tcgen05", lowering="nvrtc",
            doc="tcgen05.mma kind::f16 on BF16 tiles decoded by the hardware E2M1 conversion times the group "
                "scale (exact), TMA code stages, TMEM accumulators; down to FP32 partials; ordered combine",
            checks=((lambda s: s.target.mma == "tcgen05" and s.target.fp4_cvt and s.target.tma,
                     "needs tcgen05, TMA and the hardware FP4 conversion (the SM100 family)"),
                    (lambda s: s.act is not ActFormat.FP8 or s.recipe is ScaleRecipe.UE8M0,
                     "FP8 activations need UE8M0 scales here: FP32 per-128-column scales are not exact as BF16 "
                     "operand factors and per-128-column FP32 partials are not built for tcgen05"),
                    (lambda s: s.hidden % TC_ROWS == 0,
                     f"hidden must be a multiple of {TC_ROWS}: the down GEMM's {TC_ROWS}-row M tiles"),
                    (_fits, "the scale rows of one item and two code stages do not fit in shared memory"))),
))
MoeExpertsSpec.variants = VARIANTS
