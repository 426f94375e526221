"""The kernels that implement mla_prefill, in the order `auto` tries them (the spec's `kernel`
field carries the choice), and each one's launch plan (threads, dynamic shared memory).

- `tcgen05` (targets with the tcgen05 feature: sm103/sm107; include/k3gen/mla/prefill_tc.cuh), first
  so that `auto` picks it wherever it can implement: 128 query rows on the MMA M side, S = Q K^T
  (kind::f16, BF16 Q and K from shared memory) into a TMEM ping-pong, the online softmax by 4 warps
  with one row per thread (the SM90 kernel's rules), P through shared memory into O += P V with O
  in TMEM; K by TMA into a 2-stage ring and V into one stage from two producer warps, one MMA-issuer
  warp. The work item, the varlen/prefix offsets, the fault reports, the TMA boxes and the tail
  tile's V copy are the SM90 kernel's C++ (mla/prefill_common.cuh). Proven by compile, SASS and
  CPU replay only (tests/nogpu/ops/test_mla_prefill_tcgen05.py): no Blackwell GPU has run it.
- `wgmma_pp` is the sm_90a default since 2026-12-07: on an H100 (one call, three legs each, BF16 out)
  with the row sums on the tensor core it was the fastest or within 3% of it at every bench shape
  (H12 T4096 129.4 us vs wgmma 136.0 and SDPA 154.3; H96 T4096 ~956 vs ~976; 8 x 1024: 100.0 vs 105.6
  at H12, 668 vs 704 at H96; bench/notes/mla_prefill.md). On the H200 (2026-12-03) all four wgmma
  variants passed tests/gpu/test_mla_prefill.py and TMA halved wgmma_cp's time.
  All are sm_90a FA3-style warp specialization (include/k3gen/mla/prefill.cuh): Q and K from shared
  memory through descriptors, P from registers for PV and for the row sums' m64n8k16 wgmmas, V as the
  N-major B operand. `wgmma_cp` copies K/V with cp.async, `wgmma` by TMA, `wgmma_ov` adds FA3's
  intra-warpgroup overlap, `wgmma_pp` its pingpong of the two consumers.
- `wgmma_ps` and `wgmma_pf` (include/k3gen/mla/prefill_ps.cuh, 2026-12-08) are `wgmma_pp` persistent:
  one CTA per SM draws work items (head x q-block x sequence, long first) from a device counter that
  the last CTA resets, Q comes by TMA, and the next item's Q and first tiles load under the current
  item's last tile; `wgmma_pf` also joins an item's last PV and the next item's first QK in one turn.
  Why: by the 2026-12-07 H100 times a tile cost 3.15 us at H96 8 x 1024 (4.5 tiles per CTA) against
  2.37 us at T4096, the difference being each CTA's prologue and epilogue. Compiled (no spills, no serialized wgmmas)
  and CPU-tested only: no GPU has run them yet, so `auto` stays `wgmma_pp` until they are measured.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from k3gen.arch.sm100 import idesc_f16, umma_desc
from k3gen.arch.sm90 import SW128_KMAJOR, sw128_mnmajor
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.mla_prefill.spec import BLOCK_M, BLOCK_N, QK_HEAD, SMEM_BYTES, THREADS, V_HEAD, MlaPrefillSpec

SMEM_LIMIT = 232448       # opt-in dynamic shared memory per block, SM90 and the SM100 family

_WGMMA = (lambda s: s.target.mma == "wgmma", "needs wgmma (sm_90a); this target has none")
_TCGEN05 = (lambda s: s.target.mma == "tcgen05", "needs tcgen05 (the sm_100a family); this target has none")


@dataclass(frozen=True)
class Plan:
    threads: int
    smem_bytes: int
    smem: dict = field(default_factory=dict)   # region -> byte offset from the 1024-aligned base


# -- tcgen05 (prefill_tc.cuh): the shared-memory plan and the index math its CPU tests replay --------
TC_THREADS = 224          # softmax warps 0-3, K producer 4, V producer 5, MMA issuer 6
TC_K_STAGES = 2
BLK = BLOCK_N * 128       # one [128][64] BF16 SW128 block (a TMA box of K or V, a Q or P block)
TC_TMEM_COLS = 512        # allocated; S at 0 / 128, O at 256
TC_S_COL, TC_O_COL = 0, 2 * BLOCK_N
TC_BARS = 10              # K-full x 2, K-empty x 2, V-full, V-empty, S-full x 2, P-full, O-done


def tc_smem() -> dict:
    """Regions of prefill_tc.cuh from the aligned base: Q (3 blocks: dims 0-63, 64-127, rope), the K
    ring (2 x 3 blocks), V (2 blocks), P (2 blocks of [128 rows][64 keys]), the barriers, the TMEM
    address slot; `total` adds the 1024 bytes that align the base."""
    plan, off = {}, 0
    for name, size in (("q", 3 * BLK), ("k", TC_K_STAGES * 3 * BLK), ("v", 2 * BLK), ("p", 2 * BLK),
                       ("bars", 8 * TC_BARS), ("tmem", 16)):
        plan[name] = off
        off += size
    plan["end"] = off
    plan["total"] = off + 1024
    return plan


def sw128(r: int, c: int) -> int:
    """prefill_common.cuh sw128: 16-byte chunk c of row r of an SW128 block."""
    return (r >> 3) * 1024 + (r & 7) * 128 + ((c ^ (r & 7)) << 4)


def tc_q_off(r: int, c: int) -> int:
    """The Q loader's destination of 16-byte chunk c (of 24) of CTA row r."""
    return tc_smem()["q"] + (c >> 3) * BLK + sw128(r, c & 7)


def tc_p_off(r: int, ch: int) -> int:
    """The softmax thread of row r: chunk ch (keys 8 ch .. 8 ch + 7) of P."""
    return tc_smem()["p"] + (ch >> 3) * BLK + sw128(r, ch & 7)


def tc_qk_a(ks: int) -> int:
    return tc_smem()["q"] + (ks >> 2) * BLK + (ks & 3) * 32


def tc_qk_b(st: int, ks: int) -> int:
    return tc_smem()["k"] + st * 3 * BLK + (ks >> 2) * BLK + (ks & 3) * 32


def tc_pv_a(ks: int) -> int:
    return tc_smem()["p"] + (ks >> 2) * BLK + (ks & 3) * 32


def tc_pv_b(ks: int) -> int:
    return tc_smem()["v"] + ks * 2048


def fingerprint(f, n0: int, n1: int) -> int:
    """prefill_tc.cuh fingerprint: h = h * 31 + f(i, j) over i < n0, j < n1, mod 2^32."""
    h = 0
    for i in range(n0):
        for j in range(n1):
            h = (h * 31 + f(i, j)) & 0xFFFFFFFF
    return h


def tc_probes() -> list[tuple[str, str]]:
    """(condition, message) static_asserts tying prefill_tc.cuh to this module: the shared-memory
    offsets, every index function over its whole domain, and the descriptor encoders of
    k3gen.arch.sm100 at the last K16 step of each operand."""
    ns = "k3gen::mla::prefill::tc"
    sm = tc_smem()
    nk, nv = QK_HEAD // 16, BLOCK_N // 16
    offs = " && ".join(f"{ns}::k{n}Off == {sm[k]}" for n, k in
                       (("Q", "q"), ("K", "k"), ("V", "v"), ("P", "p"), ("Bar", "bars"), ("Tmem", "tmem")))
    fps = [("QOff", fingerprint(tc_q_off, BLOCK_M, QK_HEAD // 8), BLOCK_M, QK_HEAD // 8),
           ("POff", fingerprint(tc_p_off, BLOCK_M, BLOCK_N // 8), BLOCK_M, BLOCK_N // 8),
           ("QkA", fingerprint(lambda _, k: tc_qk_a(k), 1, nk), 1, nk),
           ("QkB", fingerprint(tc_qk_b, TC_K_STAGES, nk), TC_K_STAGES, nk),
           ("PvA", fingerprint(lambda _, k: tc_pv_a(k), 1, nv), 1, nv),
           ("PvB", fingerprint(lambda _, k: tc_pv_b(k), 1, nv), 1, nv)]
    a_k, a_v = tc_qk_b(1, nk - 1), tc_pv_b(nv - 1)
    return [
        (offs, "shared memory offsets differ from the tcgen05 variant's plan"),
        (f"{ns}::kTmemCols == {TC_TMEM_COLS} && {ns}::kSCol == {TC_S_COL} && {ns}::kOCol == {TC_O_COL}",
         "TMEM columns differ from the tcgen05 variant's plan"),
        *[(f"{ns}::fingerprint({ns}::{f}{{}}, {a}, {b}) == {v}u",
           f"{f}: the header's index math differs from variants.py's model") for f, v, a, b in fps],
        (f"k3gen::sm100::desc<16, 1024>({a_k}u) == {umma_desc(a_k, SW128_KMAJOR)}ull && "
         f"k3gen::sm100::desc<{BLK}, 1024>({a_v}u) == {umma_desc(a_v, sw128_mnmajor(BLK))}ull",
         "tcgen05 shared-memory descriptor differs from k3gen.arch.sm100.umma_desc"),
        (f"k3gen::sm100::idesc<true, false, 128, 128>() == {idesc_f16(bf16=True, m=BLOCK_M, n=BLOCK_N)}u && "
         f"k3gen::sm100::idesc<true, true, 128, 128>() == "
         f"{idesc_f16(bf16=True, m=BLOCK_M, n=V_HEAD, b_mn=True)}u",
         "tcgen05 instruction descriptor differs from k3gen.arch.sm100.idesc_f16"),
    ]


@dataclass(frozen=True)
class PrefillVariant(Variant):
    header: str = ""
    overlap: bool = False
    pingpong: bool = False    # with overlap: the consumers take turns at issuing their wgmmas
    tma: bool = True          # K/V tiles by TMA boxes (else cp.async from the producer warpgroup)
    persistent: bool = False  # one CTA per SM over the work items (prefill_ps.cuh run_persistent)
    flat: bool = False        # persistent: one pipeline across items (prefill_ps.cuh consume_flat)
    ns: str = "k3gen::mla::prefill"   # the header's namespace (kSmem, kThreads, run)

    def plan(self, spec) -> Plan:
        return Plan(threads=THREADS, smem_bytes=SMEM_BYTES)

    def asserts(self, spec) -> str:
        return ""

    def inputs(self, spec) -> dict:
        return {"header": self.header, "doc": self.doc, "overlap": "true" if self.overlap else "false",
                "pingpong": "true" if self.pingpong else "false",
                "persistent": "true" if self.persistent else "false",
                "run": ("run_persistent_flat" if self.flat else "run_persistent") if self.persistent else "run",
                "tma": "true" if self.tma else "false", "ns": self.ns, "threads": self.plan(spec).threads,
                "asserts": self.asserts(spec),
                "out_f32": "true" if spec.out_dtype.value == "fp32" else "false"}


@dataclass(frozen=True)
class TcPrefillVariant(PrefillVariant):
    def plan(self, spec) -> Plan:
        sm = tc_smem()
        return Plan(threads=TC_THREADS, smem_bytes=sm["total"], smem=sm)

    def asserts(self, spec) -> str:
        # Appended to the template's last static_assert line, so the wgmma variants' sources keep
        # their bytes.
        return "".join(f'\nstatic_assert({c},\n              "{m}");' for c, m in tc_probes())


VARIANTS = VariantTable("mla_prefill", (
    TcPrefillVariant("tcgen05", lowering="nvrtc", header="k3gen/mla/prefill_tc.cuh", ns="k3gen::mla::prefill::tc",
                     doc="tcgen05 M128 MMAs, S and O in TMEM, one softmax row per thread, TMA K ring "
                         "and V stage from two producer warps",
                     checks=(_TCGEN05,)),
    PrefillVariant("wgmma_pp", lowering="nvrtc", header="k3gen/mla/prefill.cuh", overlap=True, pingpong=True,
                   doc="wgmma_ov with FA3's pingpong: the two consumers take turns at issuing their wgmmas",
                   checks=(_WGMMA,)),
    PrefillVariant("wgmma_ps", lowering="nvrtc", header="k3gen/mla/prefill_ps.cuh", overlap=True, pingpong=True,
                   persistent=True,
                   doc="wgmma_pp in one CTA per SM over the work items (drawn from a counter): the next "
                       "item's Q and first tiles load under the current one's last tile and stores",
                   checks=(_WGMMA,)),
    PrefillVariant("wgmma_pf", lowering="nvrtc", header="k3gen/mla/prefill_ps.cuh", overlap=True, pingpong=True,
                   persistent=True, flat=True,
                   doc="wgmma_ps with one pipeline across items: an item's last PV and the next one's "
                       "first QK in the same turn, its rows stored under that QK's softmax",
                   checks=(_WGMMA,)),
    PrefillVariant("wgmma", lowering="nvrtc", header="k3gen/mla/prefill.cuh",
                   doc="wgmma_cp's consumers, K/V tiles by TMA from one producer thread",
                   checks=(_WGMMA,)),
    PrefillVariant("wgmma_cp", lowering="nvrtc", header="k3gen/mla/prefill.cuh", tma=False,
                   doc="two consumer warpgroups of 64 rows (QK^T m64n128k16 from shared memory, PV "
                       "m64n128k16 with P in registers), K/V by cp.async from the producer warpgroup",
                   checks=(_WGMMA,)),
    PrefillVariant("wgmma_ov", lowering="nvrtc", header="k3gen/mla/prefill.cuh", overlap=True,
                   doc="wgmma with FA3's intra-warpgroup overlap: QK of tile i issued before "
                       "PV of tile i - 1, the softmax of tile i under that PV",
                   checks=(_WGMMA,)),
))
MlaPrefillSpec.variants = VARIANTS
