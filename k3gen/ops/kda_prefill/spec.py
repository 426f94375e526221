"""kda_prefill: the prompt tokens of a varlen batch through the fused KDA step (SPEC.md section 2),
writing every token's output, the final state into the pool slot and the last three raw inputs
into the conv window; a sequence may continue from the state already in its slot (chunked
continuation). The algorithm (`algo`, the variant field; variants.py): `chunk64`, the chunked WY
form with 64-token chunks on BF16 tensor-core operands (mma.sync, FP32 sums, FP32 triangular solve
and state; include/k3gen/kda/prefill_chunk64.cuh), and `chunk64_tc`, the same prep and emit with the
state pass on tcgen05 (S in TMEM; prefill_chunk64_tc.cuh) under the same rounding contract;
tolerances KDA_CHUNK64_* in tests/numerics.py for both.

Kernel contract (shared by the template, the reference and the launcher). D = heads * 128,
N = total tokens; sequence b owns rows cu_seqlens[b] .. cu_seqlens[b+1]-1.

Inputs (BF16 unless stated):
- `qkvg[N, >= 4D]`, `fa[N, 128]`, `beta_logit[N, H]`: any row stride, unit inner stride.
- `cu_seqlens[B + 1]` int32, non-decreasing, cu_seqlens[0] = 0, cu_seqlens[B] = N.
- `slots[B]` int32 (negative: padded sequence, zeros out, nothing touched; >= num_slots is bad
  input treated like padding), `resume[B]` int32: non-zero continues from ssm[slot] and the conv
  window of the slot; zero starts from S = 0 and an all-zero window (the slot's old contents are
  ignored and overwritten).
- weights exactly as kda_decode.
Pools (kda_decode's StatePoolLayout): `ssm[num_slots, H, 128, 128]` FP32 or BF16 (written once,
after the last token: the recurrence never rounds in between), `conv[num_slots, 3D, 3]` BF16.
Output: `out[N, H, 128]` BF16 contiguous (8-byte aligned). A sequence of length 0 touches nothing.

Rounding contract of the state pass (chunk64 and chunk64_tc alike; reference.chunk64_state_pass):
the state S is FP32 from load to store and enters each chunk's products as bf16_rn(S);
V_new = U + (-W) bf16(S)^T is FP32 (the MMA accumulator starts at the FP32 U) and enters its products
as bf16_rn(V_new) once; O = e^G Q bf16(S)^T + Aqk bf16(V_new) sums in one FP32 accumulator;
S <- fl(S * e^(G_C)) + bf16(V_new)^T K e^(G_C - G). The sums inside a tensor-core product are the
hardware's (mma.sync m16n8k16 steps vs tcgen05 k16 steps), the only difference between the two
(chunk64 also skips Aqk's blocks above the diagonal, which chunk64_tc multiplies as exact zeros).

Launch: three kernels over a workspace sized from (N, B, H) only (`workspace_bytes`), so the
launches stay graph-safe: `prep` (grid (H, N / 64 + B), one 64-token item each: conv, norms, gates,
A, the triangular solve, W, U, Aqk, none of which reads the state) writes one record per item and
head; `state` (chunk64: grid (H, B, 8 / W), W warps of 16 state rows each; chunk64_tc: grid (H, B),
all 128 rows in TMEM) runs the FP32 recurrence over the records and writes raw FP32 outputs; `emit`
(grid (H, N / 64 + B)) applies the gated RMSNorm.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from k3gen.errors import SpecError
from k3gen.ir.checks import check_enum_fields, check_heads, check_ssm_on_target
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import BF16, FP32, INT32, GateKind, SsmDtype
from k3gen.ir.layouts import CONV_TAPS, KDA_DK, KDA_DV
from k3gen.ir.spec import OpSpec, register_op
from k3gen.ops.kda_decode.spec import FLOPS_PER_TOKEN_HEAD, FbWeight, KdaState


class PrefillAlgo(str, enum.Enum):
    AUTO = "auto"          # resolved at construction to the first variant that can (variants.py)
    CHUNK64 = "chunk64"    # 64-token WY chunks, BF16 tensor-core operands, FP32 sums and state, three kernels
    CHUNK64_TC = "chunk64_tc"  # chunk64 with the state pass on tcgen05 (S in TMEM), the SM100 family

    def __str__(self) -> str:
        return self.value


# Tokens per prep / emit work item (one 64-token chunk).
PAR_ITEM = 64
# chunk64 (include/k3gen/kda/prefill_chunk64.cuh, whose static_asserts check these): one chunk's
# record c64::Rec = -W, e^G Q ([64][136] BF16 each), K^T ([128][72] BF16), Aqk ([64][72] BF16),
# e^(G_C) (FP32 [128]) = the head the state kernel copies whole, then U^T (FP32 [128][72]).
C64_REC_HEAD = 2 * 64 * (KDA_DK + 8) * 2 + KDA_DK * 72 * 2 + 64 * 72 * 2 + KDA_DK * 4
C64_REC_BYTES = C64_REC_HEAD + KDA_DV * 72 * 4
C64_PREP_SMEM = 220 * 1024
C64_STATE_WARPS = (2, 4, 8)  # warps (16 state rows each) per state CTA: 8 / W CTAs per (sequence, head)
# chunk64_tc (include/k3gen/kda/prefill_chunk64_tc.cuh, c64tc::k*): the record as the tcgen05 state pass
# reads it: -W, e^G Q ([64 t][128 k]), (K e^(G_C - G))^T ([128 k][64 t]), Aqk ([64][64]) as 128B-swizzled
# K-major BF16 operand images (C64TC_REC_TILES bytes, one bulk copy), then e^(G_C) (FP32 [128]) and U^T
# (FP32 [16 t-quads][128 v][4]).
C64TC_REC_TILES = 2 * 64 * KDA_DK * 2 + KDA_DK * 64 * 2 + 64 * 64 * 2
C64TC_REC_BYTES = C64TC_REC_TILES + KDA_DK * 4 + KDA_DV * 64 * 4


def c64_state_smem(warps: int) -> int:
    """Dynamic shared memory of the chunk64 state kernel: two records' heads and the CTA's U^T rows."""
    return 2 * (C64_REC_HEAD + 16 * warps * 72 * 4) + 128


@register_op("kda_prefill")
@dataclass(frozen=True, kw_only=True)
class KdaPrefillSpec(KdaState, OpSpec):
    heads: int
    gate: GateKind = GateKind.BOUNDED
    ssm: SsmDtype = SsmDtype.FP32
    fb_weight: FbWeight = FbWeight.BF16
    algo: PrefillAlgo = PrefillAlgo.AUTO
    threads: int = 256     # prep and emit CTAs (the state pass takes 32 x its warps)
    # prep runs one CTA per SM (220 KB of shared memory each).
    min_blocks: int = 1

    variant_field: ClassVar[str] = "algo"

    def resolve(self) -> None:
        # The variants read these fields: reject a bad value by its own name first.
        check_enum_fields(self, (("gate", GateKind), ("ssm", SsmDtype), ("fb_weight", FbWeight), ("algo", PrefillAlgo)))
        check_ssm_on_target(self)

    def validate(self) -> None:
        check_heads(self.heads, 1 << 20, "heads are grid.x")
        if self.threads != 256:
            raise SpecError("threads", self.threads, [256], "prep's 8 warps: a warp per 16-token block pair")
        if self.min_blocks != 1:
            raise SpecError("min_blocks", self.min_blocks, [1], "prep takes 220 KB of shared memory: one CTA per SM")

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the first kernel launched (prep)."""
        return C64_PREP_SMEM

    par_item = PAR_ITEM

    def workspace_items(self, tokens: int, batch: int) -> int:
        """Work items of the prep / emit grids: sequence b owns items cu[b] // 64 + b onward."""
        return tokens // PAR_ITEM + batch

    @property
    def rec_bytes(self) -> int:
        """One chunk's record in the workspace: the layout the algo's state pass reads."""
        return C64TC_REC_BYTES if self.algo is PrefillAlgo.CHUNK64_TC else C64_REC_BYTES

    def workspace_bytes(self, tokens: int, batch: int) -> int:
        """One record per item and head, then the raw FP32 outputs [N, H, 128]."""
        tiles = self.workspace_items(tokens, batch) * self.heads * self.rec_bytes
        return tiles + tokens * self.heads * KDA_DV * int(FP32.bytes)  # dtype sizes are floats (FP4: 0.5)

    def slug(self) -> str:
        s = f"h{self.heads}-{self.gate.value}-{self.ssm.value}-{self.algo.value}"
        if self.min_blocks != 1:
            s += f"-mb{self.min_blocks}"
        return s

    def bytes_moved(self):
        """Fewest bytes for B sequences of N tokens in all (sympy over B, N), every sequence
        resuming: state and window read and written once, token rows read, outputs written."""
        B, N = sym("B"), sym("N")
        H, D = self.heads, self.d
        state = 2 * B * H * self.state_bytes_per_head
        conv = 2 * B * 3 * D * (CONV_TAPS - 1) * BF16.bytes
        acts = N * (4 * D + KDA_DK + H) * BF16.bytes + B * 3 * INT32.bytes
        out = N * D * BF16.bytes
        weights = (3 * D * CONV_TAPS + D * KDA_DK) * BF16.bytes + (D + H + KDA_DV) * FP32.bytes
        return state + conv + acts + out + weights

    def flops(self):
        return sym("N") * self.heads * FLOPS_PER_TOKEN_HEAD
