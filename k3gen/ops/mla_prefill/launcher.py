"""Launcher of mla_prefill (ABI: template.cu.j2; contract: spec.py).

Graph-safe: the launch reads tensor metadata and the host int `max_seqlen_q` only; the sequence
offsets are read (and clamped) on the device, so a captured graph replays for any cu_seqlens whose
query lengths stay within max_seqlen_q. With K3GEN_VALIDATE the offsets are checked on the host
first (that synchronizes)."""
from __future__ import annotations

import ctypes

from k3gen.config import settings
from k3gen.errors import SpecError
from k3gen.ops.mla_prefill.spec import BLOCK_M, BLOCK_N, MAX_GRID_YZ, NOPE, QK_HEAD, ROPE, V_HEAD, OutDtype
from k3gen.runtime import faults
from k3gen.runtime.checks import check_one_device, check_tensor
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.loader import I32, PTR, ArgPack
from k3gen.runtime.tma import encode_tma

I64 = ctypes.c_longlong


def _rows(name, t, rows, heads, width) -> None:
    """BF16 [rows, heads, width] (or [rows, width] when heads is None) with unit inner stride,
    16-byte aligned rows and heads (any token / head strides)."""
    import torch
    shape = (rows, width) if heads is None else (rows, heads, width)
    check_tensor(name, t, torch.bfloat16, shape, contiguous=False, inner_unit=True)
    outer = [st for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1]
    if t.stride(-1) != 1 or any(st % 8 or st < width for st in outer) or t.data_ptr() % 16:
        raise SpecError(name, (tuple(t.shape), t.stride()), [f"bf16 {list(shape)}"],
                        f"unit inner stride, 16-byte aligned rows, token / head strides multiples of 8 and >= {width}")


def check_offsets(name: str, cu: list[int], rows: int) -> None:
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > rows:
        raise SpecError(name, cu[:8] + (["..."] if len(cu) > 8 else []),
                        f"non-decreasing offsets from 0 to at most {rows}")


def head_map(t) -> bytes:
    """k_nope / v [rows, H, 128] BF16: box [128 rows][1 head][128 bytes] (one SW128 block)."""
    rows, heads = t.shape[0], t.shape[1]
    head_stride = t.stride(1) * 2 if heads > 1 else 256
    return encode_tma(t.data_ptr(), (256, heads, max(rows, 1)), (head_stride, max(t.stride(0) * 2, 16)),
                         (128, 1, BLOCK_N))


def q_map(t) -> bytes:
    """q [rows, H, 192] BF16: box [64 rows][1 head][128 bytes] (one consumer's SW128 Q block)."""
    rows, heads = t.shape[0], t.shape[1]
    head_stride = t.stride(1) * 2 if heads > 1 else 2 * QK_HEAD
    return encode_tma(t.data_ptr(), (2 * QK_HEAD, heads, max(rows, 1)), (head_stride, max(t.stride(0) * 2, 16)),
                      (128, 1, BLOCK_M // 2))


def rope_map(t) -> bytes:
    """k_pe [rows, 64] BF16: box [128 rows][128 bytes]."""
    return encode_tma(t.data_ptr(), (128, max(t.shape[0], 1)), (max(t.stride(0) * 2, 16),), (128, BLOCK_N))


class MlaPrefill(Launcher):
    def __init__(self, spec):
        super().__init__(spec)
        self._smem_set: set[int] = set()
        self._tma = spec.impl.tma   # the variant reads K/V through tensor maps (encoded per launch)
        self._persistent = spec.impl.persistent
        self._sched: dict[int, object] = {}   # device -> int32[2] work counters (persistent variant)
        self._sms: dict[int, int] = {}

    def load(self):
        if self._kernel is None:
            super().load()
            faults.buffer()   # allocated outside any capture (graphs keep its address)
            if self._persistent:
                import torch
                self._counters(torch.cuda.current_device())
        return self

    def _counters(self, device: int):
        """The persistent kernel's work counters on `device`: zeroed once, left at zero by every launch."""
        import torch
        buf = self._sched.get(device)
        if buf is None:
            if torch.cuda.is_current_stream_capturing():
                raise SpecError("mla_prefill counters", device, "allocated before capture",
                                "load() the kernel (or run it once) on this device before a CUDA-graph capture")
            buf = self._sched[device] = torch.zeros(2, dtype=torch.int32, device=f"cuda:{device}")
            self._sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return buf

    def _allow_smem(self, device: int) -> None:
        if device not in self._smem_set:
            self._kernel.set_max_dynamic_smem(self.spec.smem_bytes, device)
            self._smem_set.add(device)

    def check(self, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, out, max_seqlen_q) -> tuple[int, int, int]:
        import torch
        H = self.spec.heads
        nq = q.shape[0] if q.dim() == 3 else -1
        nk = k_nope.shape[0] if k_nope.dim() == 3 else -1
        _rows("q", q, nq, H, QK_HEAD)
        _rows("k_nope", k_nope, nk, H, NOPE)
        _rows("k_pe", k_pe, nk, None, ROPE)
        _rows("v", v, nk, H, V_HEAD)
        check_tensor("cu_seqlens_q", cu_seqlens_q, torch.int32, (None,))
        B = cu_seqlens_q.shape[0] - 1
        check_tensor("cu_seqlens_k", cu_seqlens_k, torch.int32, (B + 1,))
        odt = torch.float32 if self.spec.out_dtype is OutDtype.FP32 else torch.bfloat16
        check_tensor("out", out, odt, (nq, H, V_HEAD), align=16)
        if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
            raise SpecError("max_seqlen_q", max_seqlen_q, "a host int >= every query length")
        if B < 0 or B > MAX_GRID_YZ:
            raise SpecError("batch", B, f"0..{MAX_GRID_YZ}", "sequences are grid.z")
        if self.spec.q_blocks(max_seqlen_q) > MAX_GRID_YZ:
            raise SpecError("max_seqlen_q", max_seqlen_q, f"<= {MAX_GRID_YZ * 128}", "q-blocks are grid.y")
        if max(nq, nk) >= 2 ** 31:
            raise SpecError("rows", (nq, nk), "< 2^31", "row indices are int on the device")
        check_one_device(out, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k)
        return B, nq, nk

    def validate_inputs(self, cu_seqlens_q, cu_seqlens_k, nq: int, nk: int, max_seqlen_q: int) -> None:
        """Host-side checks (they synchronize): offsets in range, len_k >= len_q, len_q <= max_seqlen_q."""
        cq, ck = cu_seqlens_q.cpu().tolist(), cu_seqlens_k.cpu().tolist()
        check_offsets("cu_seqlens_q", cq, nq)
        check_offsets("cu_seqlens_k", ck, nk)
        for b in range(len(cq) - 1):
            lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            if lk < lq:
                raise SpecError(f"sequence {b} lengths", (lq, lk), "len_k >= len_q", "the new rows are keys too")
            if lq > max_seqlen_q:
                raise SpecError("max_seqlen_q", max_seqlen_q, f">= {lq}", f"sequence {b} has {lq} query rows")

    def __call__(self, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, out, max_seqlen_q: int,
                 heads_fast: bool | None = None):
        """out[Nq, H, 128] = causal attention of each sequence (spec.py); returns out. `heads_fast`
        overrides the grid order (None: spec.heads_fast(Nk); benchmarks compare both)."""
        import torch
        B, nq, nk = self.check(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, out, max_seqlen_q)
        if settings().validate:
            self.validate_inputs(cu_seqlens_q, cu_seqlens_k, nq, nk, max_seqlen_q)
        if B == 0 or nq == 0 or max_seqlen_q == 0:
            return out
        if nk == 0:   # no key anywhere: every row is zero (and an empty tensor has no address to map)
            return out.zero_()
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        qb = self.spec.q_blocks(max_seqlen_q)
        fast = self.spec.heads_fast(nk) if heads_fast is None else bool(heads_fast)
        args = (q.data_ptr(), q.stride(0), q.stride(1), k_nope.data_ptr(), k_nope.stride(0), k_nope.stride(1),
                k_pe.data_ptr(), k_pe.stride(0), v.data_ptr(), v.stride(0), v.stride(1),
                cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), out.data_ptr(), nq, nk, qb, int(fast),
                faults.word("mla_prefill", out.device), B,
                self._counters(dev).data_ptr() if self._persistent else 0)
        types = (PTR, I64, I64, PTR, I64, I64, PTR, I64, PTR, I64, I64, PTR, PTR, PTR, I32, I32, I32, I32, PTR,
                 I32, PTR)
        pack = ArgPack()
        for val, t in zip(args, types):
            pack.add(t(val))
        maps = (head_map(k_nope), rope_map(k_pe), head_map(v)) if self._tma else (bytes(128),) * 3
        maps += (q_map(q) if self._persistent else bytes(128),)
        for raw in maps:
            pack.add(raw)
        self.load()._allow_smem(dev)
        grid = self.spec.grid(B, max_seqlen_q, fast, self._sms.get(dev, 0))
        self.kernel.launch_ex(grid, (self.spec.threads, 1, 1), None, pack.address(), None, dev,
                              torch.cuda.current_stream(out.device).cuda_stream, self.spec.smem_bytes)
        return out
