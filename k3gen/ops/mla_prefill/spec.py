"""mla_prefill: causal flash attention of MLA prefill in the unabsorbed form (SPEC.md section 4,
"Prefill uses the unabsorbed form").

Kernel contract (shared by the template, the reference and the launcher). Per head h of `heads`:

    s[i, j] = ([q_nope | q_pe][i, h] . [k_nope[j, h] | k_pe[j]]) * 1/sqrt(192)
    o[i, h] = sum_j softmax_j(s[i, :])[j] * v[j, h]       (FP32 softmax and sums)

- `q[Nq, H, 192]` BF16 (per head `[q_nope 128 | q_pe 64]`: the Q-B projection output as it comes),
  `k_nope[Nk, H, 128]`, `v[Nk, H, 128]` BF16 (any token and head strides, unit inner stride, 16-byte
  aligned rows: e.g. the two halves of one kv_b expansion [Nk, H, 256]), `k_pe[Nk, 64]` BF16 (one
  rope key shared by all heads; any row stride, e.g. columns 512.. of the cache rows).
- `cu_seqlens_q[B + 1]`, `cu_seqlens_k[B + 1]` int32, non-decreasing from 0 to Nq / Nk. Sequence b
  owns query rows cu_q[b] .. cu_q[b+1] - 1 and keys cu_k[b] .. cu_k[b+1] - 1, len_k >= len_q; its
  prefix p = len_k - len_q (keys already in the cache, expanded by the caller): query row i (0-based
  in the sequence) sees keys 0 .. p + i (bottom-right causal; p = 0 is plain causal prefill).
- `out[Nq, H, 128]` contiguous, `out_dtype` (FP32: what the model multiplies by sigmoid(gate); BF16).
- `max_seqlen_q`: a host int >= every len_q, which sizes the grid (a graph replays for any
  lengths up to it). cu_seqlens are clamped on the device to [0, Nq] / [0, Nk], so bad offsets
  never address outside the tensors; the launcher checks them on the host when validating.

Bad indices (k3gen/runtime/faults.py, the op's error word): offsets outside [0, Nq] / [0, Nk] or
decreasing are clamped (the sequence covers what is left, maybe nothing), and query rows past
`max_seqlen_q`'s grid are left unwritten: fault `rows`; len_k < len_q (a negative prefix: the first
rows see no key and are written as zeros): fault `length`.

Launch (every variant: sm_90a `wgmma`, `wgmma_ov`, `wgmma_pp`, `wgmma_cp`, include/k3gen/mla/prefill.cuh;
SM100-family `tcgen05`, include/k3gen/mla/prefill_tc.cuh): grid (H, ceil(max_seqlen_q / 128), B),
or (ceil(max_seqlen_q / 128), H, B) when the K/V of all heads outgrow L2 (`heads_fast`), `threads`
threads (the variant's plan: 384 for wgmma, 224 for tcgen05), `smem_bytes` of dynamic shared memory,
one CTA per SM; TMA maps (k_nope, k_pe, v; q for `wgmma_ps`) encoded per call on the host. `wgmma_ps` is
persistent: grid (min(H x q_blocks x B, SMs), 1, 1), the items drawn from a 2-int counter of the
launcher's (per device) that the kernel leaves at zero, so it is graph-capturable too; two launches of
one MlaPrefill on one device must not run concurrently (one stream).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from k3gen.errors import SpecError
from k3gen.ir.checks import check_enum_fields, check_heads
from k3gen.ir.dims import sym
from k3gen.ir.spec import OpSpec, register_op

NOPE, ROPE, QK_HEAD, V_HEAD = 128, 64, 192, 128
SOFTMAX_SCALE = QK_HEAD ** -0.5
BLOCK_M = 128        # query rows per CTA
BLOCK_N = 128        # keys per tile
THREADS = 384       # the wgmma variants' block (tcgen05: its plan, variants.py)
# wgmma variants: Q (2 x 3 SW128 blocks of [64][64]) + 2 stages of K (3 x [128][64]) and V (2 x [128][64]) + 8
# barriers (128 bytes) + 512 bytes of BF16 ones (the row sums' wgmma operand) + 1024 bytes to align the base
# (the template static_asserts the header agrees).
SMEM_BYTES = 2 * 3 * 64 * 128 + 2 * (5 * BLOCK_N * 128) + 128 + 512 + 1024
MAX_GRID_YZ = 65535
L2_KV_BYTES = 32 << 20


class OutDtype(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value


class PrefillKernel(str, enum.Enum):
    AUTO = "auto"
    WGMMA_CP = "wgmma_cp"    # K/V by cp.async from the producer warpgroup; QK, softmax, PV in sequence
    WGMMA = "wgmma"          # K/V by TMA, the same consumers (the other warpgroup fills the gaps)
    WGMMA_OV = "wgmma_ov"    # FA3's overlap: QK of tile i and PV of tile i - 1 in flight, softmax under the PV
    WGMMA_PP = "wgmma_pp"    # wgmma_ov with the two consumers taking turns at issuing their wgmmas (FA3's pingpong)
    WGMMA_PS = "wgmma_ps"    # wgmma_pp persistent: one CTA per SM over the work items
    WGMMA_PF = "wgmma_pf"    # wgmma_ps with one pipeline across items (last PV + next first QK in one turn)
    TCGEN05 = "tcgen05"      # SM100 family: tcgen05 MMAs, S and O in TMEM, warp-specialized (variants.py)

    def __str__(self) -> str:
        return self.value


@register_op("mla_prefill")
@dataclass(frozen=True, kw_only=True)
class MlaPrefillSpec(OpSpec):
    heads: int                              # per rank: 6 .. 96 (K3 TP16 .. TP1); grid.x
    out_dtype: OutDtype = OutDtype.FP32
    kernel: PrefillKernel = PrefillKernel.AUTO

    variant_field: ClassVar[str] = "kernel"

    def resolve(self) -> None:
        check_heads(self.heads, 128, "heads are grid.x (K3 has 96 per rank at most)")
        check_enum_fields(self, (("out_dtype", OutDtype), ("kernel", PrefillKernel)))

    @property
    def softmax_scale(self) -> float:
        return SOFTMAX_SCALE

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of a launch: the variant's plan (variants.py)."""
        return self.impl.plan(self).smem_bytes

    @property
    def threads(self) -> int:
        return self.impl.plan(self).threads

    def q_blocks(self, max_seqlen_q: int) -> int:
        return -(-max_seqlen_q // BLOCK_M)

    def grid(self, batch: int, max_seqlen_q: int, heads_fast: bool = True, sms: int = 0) -> tuple[int, int, int]:
        """The launch grid; a persistent variant's is one CTA per SM (`sms`), at most one per work item."""
        qb = self.q_blocks(max_seqlen_q)
        if self.impl.persistent:
            if sms < 1:
                raise SpecError("sms", sms, ">= 1", "a persistent variant's grid is one CTA per SM")
            return (min(self.heads * qb * batch, sms), 1, 1)
        return (self.heads, qb, batch) if heads_fast else (qb, self.heads, batch)

    def heads_fast(self, nk: int) -> bool:
        """Grid order: heads fastest (every head's largest q-block in the first wave) while the K/V
        rows of all heads fit in about half the H200's 60 MB L2 (H12 T4096: 26 MB); beyond it a head's q-blocks run
        together so its K/V is read from DRAM about once."""
        return nk * (self.heads * (NOPE + V_HEAD) + ROPE) * 2 <= L2_KV_BYTES

    def slug(self) -> str:
        tag = {PrefillKernel.WGMMA_OV: "-ov", PrefillKernel.WGMMA_PP: "-pp", PrefillKernel.WGMMA_CP: "-cp",
               PrefillKernel.WGMMA_PS: "-ps", PrefillKernel.WGMMA_PF: "-pf",
               PrefillKernel.TCGEN05: "-tcgen05"}.get(self.kernel, "")
        return f"h{self.heads}-{self.out_dtype.value}{tag}"

    # -- estimates (sympy over N tokens in one sequence, no prefix) ------------------------------
    def bytes_moved(self):
        N = sym("N")
        H = self.heads
        out = 4 if self.out_dtype is OutDtype.FP32 else 2
        return N * H * (QK_HEAD + NOPE + V_HEAD) * 2 + N * ROPE * 2 + N * H * V_HEAD * out

    def flops(self):
        """Useful FLOPs of one causal sequence of N tokens: QK (192) and PV (128) over the N (N + 1) / 2
        visible pairs (what SDPA's peers count as N^2 / 2)."""
        N = sym("N")
        return 2 * self.heads * (QK_HEAD + V_HEAD) * N * (N + 1) / 2

