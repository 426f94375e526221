"""kda_prefill: the prompt tokens of a varlen batch through the fused KDA step (SPEC.md section 2),
writing every token's output, the final state into the pool slot and the last three raw inputs
into the conv window; a sequence may continue from the state already in its slot (chunked
continuation). Two algorithms (`algo`), one CTA per (sequence, head) each: `chunk16`, the chunked
WY form on tensor cores (3xTF32 mma.sync, FP32 recurrence, 16-token chunks, state in registers;
include/k3gen/kda/prefill_chunk.cuh) is the default; `token`, the token-sequential first version
(include/k3gen/kda/prefill_token.cuh), stays as the simple cross-check.

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

Launch: grid (H, B), 256 threads; `chunk16` takes `smem_bytes` of dynamic shared memory.

`chunkpar` (include/k3gen/kda/prefill_par.cuh) runs chunk16's arithmetic as three kernels so that
long prompts fill the GPU: `prep` (grid (H, N / 64 + B), one 64-token item each: conv, norms,
gates, A, P and the forward substitution, none of which reads the state) saves the prepared
16-token tiles to a workspace; `state` (grid (H, B, 2), 128 threads, half of the V rows each: the
rows of S^T are independent) runs the 3xTF32 recurrence over them and writes raw outputs;
`emit` (grid (H, N / 64 + B)) applies the gated RMSNorm. The launcher sizes the workspace from N,
B and H (`workspace_bytes`), so the launches stay graph-safe.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from k3gen.errors import SpecError, TargetError
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import BF16, FP32, INT32, GateKind, SsmDtype
from k3gen.ir.layouts import CONV_TAPS, KDA_DK, KDA_DV, StatePoolLayout
from k3gen.ir.spec import OpSpec, register_op
from k3gen.ops.kda_decode.spec import FbWeight


class PrefillAlgo(str, enum.Enum):
    CHUNK16 = "chunk16"   # chunked WY form, tensor cores, one CTA per (sequence, head)
    CHUNKPAR = "chunkpar"  # chunk16's algebra in three kernels: parallel prep / emit, sequential state pass
    TOKEN = "token"       # token-sequential, CUDA cores (first version)

    def __str__(self) -> str:
        return self.value


# Dynamic shared memory of the chunk kernel (its template static_asserts sizeof(Smem) fits).
CHUNK_SMEM_BYTES = 88 * 1024
# chunkpar: tokens per prep / emit work item, and bytes of one prepared 16-token tile set
# (par::Tiles: four [16][136] FP32 tiles, P [16][17], e^(G_C) [128]; the template static_asserts it).
PAR_ITEM = 64
PAR_TILE_BYTES = (4 * 16 * (KDA_DK + 8) + 16 * 17 + KDA_DK) * 4


@register_op("kda_prefill")
@dataclass(frozen=True, kw_only=True)
class KdaPrefillSpec(OpSpec):
    heads: int
    gate: GateKind = GateKind.BOUNDED
    ssm: SsmDtype = SsmDtype.FP32
    fb_weight: FbWeight = FbWeight.BF16
    algo: PrefillAlgo = PrefillAlgo.CHUNK16
    threads: int = 256
    # One CTA per SM: prefill grids (B x H) rarely fill more than a wave, the token loop is
    # latency-bound, and staging the next chunk next to the 64 register rows needs > 128 registers.
    min_blocks: int = 1

    def validate(self) -> None:
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads < 1:
            raise SpecError("heads", self.heads, "a positive head count (K3: 96, 48, 24, 12, 6)")
        if self.heads > 1 << 20:
            raise SpecError("heads", self.heads, f"<= {1 << 20}", "heads are grid.x")
        for f, enum_t in (("gate", GateKind), ("ssm", SsmDtype), ("fb_weight", FbWeight), ("algo", PrefillAlgo)):
            if not isinstance(getattr(self, f), enum_t):
                raise SpecError(f, getattr(self, f), [e.value for e in enum_t])
        if self.ssm not in self.target.ssm_dtypes:
            raise TargetError("ssm", self.ssm.value, [s.value for s in self.target.ssm_dtypes],
                              f"target {self.target.name}")
        if self.threads != 256:
            raise SpecError("threads", self.threads, [256], "8 state rows per half-warp")
        if self.min_blocks not in (1, 2):
            raise SpecError("min_blocks", self.min_blocks, [1, 2])
        if self.algo is not PrefillAlgo.TOKEN and self.min_blocks != 1:
            raise SpecError("min_blocks", self.min_blocks, [1], "the chunk kernel keeps 64 state words and "
                            "the chunk's V_new / O tiles in registers (up to 255)")

    @property
    def d(self) -> int:
        return self.heads * KDA_DK

    @property
    def pool(self) -> StatePoolLayout:
        return StatePoolLayout(heads=self.heads, ssm=self.ssm)

    @property
    def state_bytes_per_head(self) -> int:
        return KDA_DV * KDA_DK * (4 if self.ssm is SsmDtype.FP32 else 2)

    @property
    def smem_bytes(self) -> int:
        return 0 if self.algo is PrefillAlgo.TOKEN else CHUNK_SMEM_BYTES

    par_item = PAR_ITEM
    par_tile_bytes = PAR_TILE_BYTES

    def workspace_items(self, tokens: int, batch: int) -> int:
        """Work items of `chunkpar`'s prep / emit grids: sequence b owns items cu[b] // 64 + b onward."""
        return tokens // PAR_ITEM + batch

    def workspace_bytes(self, tokens: int, batch: int) -> int:
        """`chunkpar` workspace: prepared tiles of every 16-token sub-chunk slot, then the raw FP32
        outputs [N, H, 128]; 0 for the single-kernel algos."""
        if self.algo is not PrefillAlgo.CHUNKPAR:
            return 0
        tiles = self.workspace_items(tokens, batch) * (PAR_ITEM // 16) * self.heads * PAR_TILE_BYTES
        return tiles + tokens * self.heads * KDA_DV * int(FP32.bytes)  # dtype sizes are floats (FP4: 0.5)

    def slug(self) -> str:
        s = f"h{self.heads}-{self.gate.value}-{self.ssm.value}"
        if self.algo is not PrefillAlgo.CHUNK16:
            s += f"-{self.algo.value}"
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
        N = sym("N")
        per_head = (3 * KDA_DK * CONV_TAPS * 2 + KDA_DK * KDA_DK * 2 + KDA_DV * KDA_DK * 7
                    + KDA_DV * 8 + KDA_DK * 8)
        return N * self.heads * per_head
