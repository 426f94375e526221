"""Address math of 128B-swizzled K-major shared-memory tiles on SM90 (TMA writes, wgmma reads).

Pure Python, shared by the fp8_block_gemm spec (which emits the descriptor fields and a probe value
the kernel's encoder must reproduce, see templates/fp8_block_gemm.cu.j2) and the CPU tests, which
replay both sides element by element:

- what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B: a box of 128-byte rows lands row after row, and
  inside each 1024-byte span the 16-byte chunk index (address bits 4-6) is XORed with the 128-byte
  row index (bits 7-9);
- what wgmma reads through a descriptor: the PTX canonical K-major layout for the 128B swizzle,
  ((8, m), (T, 2k)) : ((8T, SBO), (1, T)) in elements with T = 16 bytes / element size, after which
  the same XOR is applied to the address.
"""
from __future__ import annotations

from typing import NamedTuple

ROW_BYTES = 128        # one swizzle atom row: 128 bytes of K
ATOM_ROWS = 8          # rows per swizzle atom (1024 bytes)
LAYOUT_SW128 = 1       # descriptor bits 62-63: 0 none, 1 128B, 2 64B, 3 32B


class DescFields(NamedTuple):
    lbo: int      # leading (K) byte offset: unused by swizzled K-major layouts, encoded as 16 (1)
    sbo: int      # stride byte offset: distance between 8-row groups
    layout: int


SW128_KMAJOR = DescFields(lbo=16, sbo=ATOM_ROWS * ROW_BYTES, layout=LAYOUT_SW128)


def swizzle128(addr: int) -> int:
    """The 128B swizzle on a shared-memory byte address: bits [4, 7) ^= bits [7, 10)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def tma_sw128_offset(row: int, kbyte: int) -> int:
    """Byte offset, from a 1024-byte-aligned box base, where TMA puts byte `kbyte` of box row `row`
    (box inner extent 128 bytes, SWIZZLE_128B)."""
    assert 0 <= kbyte < ROW_BYTES
    return swizzle128(row * ROW_BYTES + kbyte)


def blocked_sw128_offset(rows: int, row: int, chunk: int) -> int:
    """Byte offset of 16-byte chunk `chunk` of `row` in a [rows][K] operand stored as consecutive SW128
    K-major blocks of [rows][128 bytes] (mla_decode's Q, P and KV tiles: the templates' sw_off)."""
    return (chunk >> 3) * rows * ROW_BYTES + swizzle128(row * ROW_BYTES + (chunk & 7) * 16)


def encode_desc(addr: int, f: DescFields = SW128_KMAJOR) -> int:
    """The 64-bit wgmma matrix descriptor (PTX: start >> 4 in bits 0-13, LBO >> 4 in 16-29,
    SBO >> 4 in 32-45, base offset in 49-51 (0 here), layout type in 62-63)."""
    return (((addr & 0x3FFFF) >> 4) | (((f.lbo & 0x3FFFF) >> 4) << 16) | (((f.sbo & 0x3FFFF) >> 4) << 32)
            | ((f.layout & 3) << 62))


def decode_desc(d: int) -> tuple[int, int, int, int, int]:
    """(start byte address, LBO bytes, SBO bytes, base offset, layout) of a descriptor."""
    return ((d & 0x3FFF) << 4, ((d >> 16) & 0x3FFF) << 4, ((d >> 32) & 0x3FFF) << 4, (d >> 49) & 7, (d >> 62) & 3)


def wgmma_read_addr(desc: int, row: int, k: int, elem_bytes: int = 1) -> int:
    """Shared address wgmma reads for element (row, k) of the operand a descriptor describes, per the
    canonical K-major layouts of the PTX ISA (only the 128B-swizzle one is modelled)."""
    start, _lbo, sbo, base_off, layout = decode_desc(desc)
    if layout != LAYOUT_SW128 or base_off != 0:
        raise ValueError("only the 128B-swizzled K-major layout with base offset 0 is modelled")
    t = 16 // elem_bytes                                  # elements per 16-byte chunk
    kb = k * elem_bytes
    if not 0 <= kb < ROW_BYTES:
        raise ValueError("K beyond one swizzle atom row")
    # ((8, m), (T, 2k)) : ((8T, SBO), (1, T)) elements -> bytes, then the address swizzle.
    lin = start + (row % ATOM_ROWS) * 8 * t * elem_bytes + (row // ATOM_ROWS) * sbo + kb
    return swizzle128(lin)


# MN-major operands (16-bit types only: wgmma's transpose flag). The canonical SW128 MN-major layout
# in elements, T = 16 bytes / element size: ((T, 8, m), (8, k)) : ((1, T, LBO), (8T, SBO)) - one
# 128-byte row holds 8T consecutive M (or N) elements of one K index, 8 K rows make a 1024-byte
# atom, LBO steps between 8T-element M blocks and SBO between 8-row K groups. mla_decode's wgmma
# schedule reads M = 64 BF16 = exactly one M block, so LBO is never applied; it encodes LBO = SBO =
# 1024 so either reading of the two fields gives the same addresses.
SW128_MNMAJOR_1BLOCK = DescFields(lbo=ATOM_ROWS * ROW_BYTES, sbo=ATOM_ROWS * ROW_BYTES, layout=LAYOUT_SW128)


def sw128_mnmajor(block_stride: int) -> DescFields:
    """MN-major SW128 operand wider than one 64-element block (PTX: LBO = the offset between
    (swizzle bytes / 16)-row groups of the MN dimension, SBO = between 8-column K groups):
    mla_decode's wgmma_qm schedule reads 128 V dims as two [64 tok][64 dims] blocks of the stage."""
    return DescFields(lbo=block_stride, sbo=ATOM_ROWS * ROW_BYTES, layout=LAYOUT_SW128)


def wgmma_read_addr_mn(desc: int, mn: int, k: int, elem_bytes: int = 2) -> int:
    """Shared address wgmma reads for element (mn, k) of an MN-major operand (SW128, base offset 0)."""
    start, lbo, sbo, base_off, layout = decode_desc(desc)
    if layout != LAYOUT_SW128 or base_off != 0:
        raise ValueError("only the 128B-swizzled MN-major layout with base offset 0 is modelled")
    if elem_bytes != 2:
        raise ValueError("wgmma transposes 16-bit operands only")
    per_row = ROW_BYTES // elem_bytes                     # 8T elements of M per 128-byte row
    lin = (start + (mn % per_row) * elem_bytes + (mn // per_row) * lbo
           + (k % ATOM_ROWS) * ROW_BYTES + (k // ATOM_ROWS) * sbo)
    return swizzle128(lin)
