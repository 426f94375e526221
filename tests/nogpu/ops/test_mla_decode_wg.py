"""mla_decode, what the sm_90a wgmma kernels share (mla/decode_wg.cuh), on the CPU: the SW128 K-major
layout of sw_off against the PTX/TMA picture of k3gen.arch.sm90, the MN-major reading the FP8 and
NVFP4 PV operands rely on (LBO never applied for one 64-element block), and the m64nNk16 accumulator
fragment naming of the column reductions (col_max8 / col_sum8) and the epilogue. The kernels' own
maps: test_mla_decode_wg8.py, test_mla_decode_wg4.py, test_mla_decode_wgq.py."""
from __future__ import annotations

import pytest

from k3gen.arch.sm90 import SW128_MNMAJOR_1BLOCK, blocked_sw128_offset, encode_desc, swizzle128, wgmma_read_addr_mn


def elem(rows: int, row: int, d: int) -> int:
    """Byte of BF16/f16 element d (of 576) of `row`, as the kernels' stores place it (wg::sw_off)."""
    return blocked_sw128_offset(rows, row, d // 8) + (d % 8) * 2


def test_sw_off_is_the_sw128_kmajor_layout():
    # Each block is the TMA/PTX SW128 picture of [rows][64 elements]: swizzle128 of the linear offset.
    for rows in (16, 32, 64):
        seen = set()
        for r in range(rows):
            for d in range(576):
                blk, kb = divmod(d * 2, 128)
                lin = blk * rows * 128 + r * 128 + kb
                assert elem(rows, r, d) == swizzle128(lin)
                seen.add(elem(rows, r, d))
        assert seen == set(range(0, rows * 1152, 2))


def test_mn_major_reading_does_not_depend_on_lbo():
    # M = 64 16-bit elements is one 128-byte row: the M-block stride (LBO) is never applied, so the
    # K-major high descriptor word (wg::kDescHi, LBO 16) reads the same addresses as LBO = 1024.
    want = [wgmma_read_addr_mn(encode_desc(4096, SW128_MNMAJOR_1BLOCK), m, k) for m in range(64) for k in range(16)]
    for lbo in (16, 1024, 8192):
        d = encode_desc(4096, SW128_MNMAJOR_1BLOCK._replace(lbo=lbo))
        assert [wgmma_read_addr_mn(d, m, k) for m in range(64) for k in range(16)] == want


@pytest.mark.parametrize("n", [16, 32])
def test_fragment_mappings(n):
    """PTX m64nNk16 F32 accumulator: register i of thread (warp, lane) is row 16 warp + lane / 4 +
    8 ((i % 4) / 2), column 8 (i / 4) + 2 (lane % 4) + i % 2. The softmax names sc[4 j + e] as token
    16 warp + lane / 4, column 8 j + 2 (lane % 4) + e (and sc[4 j + 2 + e] eight tokens down); the
    epilogue names o[mb][i] dim 64 mb + row. Every element exactly once; the 8 lanes sharing a
    column are the shuffle group xor 4, 8, 16 (col_max8, col_sum8); lanes 0..3 hold every column."""
    seen_s, seen_o = set(), set()
    for w in range(4):
        for lane in range(32):
            for i in range(n // 2):
                row = 16 * w + lane // 4 + 8 * ((i % 4) // 2)
                col = 8 * (i // 4) + 2 * (lane % 4) + i % 2
                j, e, hi = i // 4, i % 2, (i % 4) // 2
                assert (16 * w + lane // 4 + 8 * hi, 8 * j + 2 * (lane % 4) + e) == (row, col)
                seen_s.add((row, col))
                for mb in range(8):
                    seen_o.add((64 * mb + row, col))
            group = {lane ^ x for x in (0, 4, 8, 12, 16, 20, 24, 28)}
            assert {g % 4 for g in group} == {lane % 4} and len(group) == 8
    assert len(seen_s) == 64 * n and len(seen_o) == 512 * n
    assert {8 * j + 2 * lane + e for j in range(n // 8) for lane in range(4) for e in range(2)} == set(range(n))
