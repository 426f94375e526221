"""tcgen05 (SM100 family: sm_100a, sm_103a, sm_107a) facts the variants, templates and CPU tests share.

- The shared-memory matrix descriptor is SM90's (start, LBO, SBO, base offset, the 128B swizzle at
  bits 62..63, which is tcgen05's 3-bit swizzle field 61..63 holding 2) plus a fixed version field
  (bits 46..48 = 1). The operand layouts it describes are the same canonical K-major / MN-major
  SW128 layouts (k3gen.arch.sm90 models them), so a tile TMA writes for wgmma is read unchanged.
- The kind::f16 instruction descriptor: D format (bits 4-5, 1 = F32), A / B format (bits 7-9 /
  10-12: 0 F16, 1 BF16), A / B major (bits 15 / 16: 1 = MN-major), N >> 3 (bits 17-22), M >> 4
  (bits 24-28).
- TMEM data path layout F (M = 64, cta_group::1, not .ws): accumulator row r in TMEM lane
  32 (r // 16) + r % 16, column n in column n; a warp reads the 32 lanes of its quarter with
  tcgen05.ld.32x32b, so lanes 0..15 of warp w hold rows 16 w .. 16 w + 15.
- TMEM data path layout D (M = 128, cta_group::1): accumulator row r in TMEM lane r, column n in
  column n; warp w (of a warpgroup) may access lanes 32 w .. 32 w + 31 only, so with 32x32b loads
  thread t of the warpgroup holds row t (mla_prefill's tcgen05 softmax).
- A TMEM address is (lane << 16) | column.
"""
from __future__ import annotations

from k3gen.arch.sm90 import DescFields, encode_desc

DESC_VERSION = 1 << 46


def umma_desc(addr: int, f: DescFields) -> int:
    return encode_desc(addr, f) | DESC_VERSION


def idesc_f16(*, bf16: bool, m: int, n: int, a_mn: bool = False, b_mn: bool = False) -> int:
    """kind::f16 instruction descriptor with an F32 accumulator."""
    if m not in (64, 128) or n % (8 if m == 64 else 16) or not 8 <= n <= 256:
        raise ValueError(f"no kind::f16 cta_group::1 shape m{m}n{n}")
    fmt = 1 if bf16 else 0
    return (1 << 4) | (fmt << 7) | (fmt << 10) | (int(a_mn) << 15) | (int(b_mn) << 16) | ((n >> 3) << 17) | \
        ((m >> 4) << 24)


def tmem_lane_m64(row: int) -> int:
    """TMEM lane of accumulator row `row` of an M = 64 MMA (layout F)."""
    if not 0 <= row < 64:
        raise ValueError("M = 64 has rows 0..63")
    return 32 * (row // 16) + row % 16


def tmem_lane_m128(row: int) -> int:
    """TMEM lane of accumulator row `row` of an M = 128 cta_group::1 MMA (layout D)."""
    if not 0 <= row < 128:
        raise ValueError("M = 128 has rows 0..127")
    return row


def tmem_addr(lane: int, col: int) -> int:
    """The 32-bit TMEM address of (lane, column) relative to an allocation at lane 0, column 0."""
    if not (0 <= lane < 128 and 0 <= col < 512):
        raise ValueError("TMEM has 128 lanes x 512 columns")
    return (lane << 16) | col
