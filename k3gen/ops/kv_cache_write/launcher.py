"""Launcher of kv_cache_write (ABI: template.cu.j2)."""
from __future__ import annotations

from k3gen.config import settings
from k3gen.errors import PageIndexError, SpecError
from k3gen.ir.dtypes import KvDtype
from k3gen.ir.layouts import MLA_ROW, NVFP4_TILE_TOKENS
from k3gen.runtime import faults
from k3gen.runtime.checks import check_one_device, kv_cache_wants
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.loader import F32, I32, PTR, ptr


def tiles_for(max_rows_per_seq: int) -> int:
    """16-token tiles a run of n rows may touch, wherever it starts."""
    return 0 if max_rows_per_seq <= 0 else (max_rows_per_seq + NVFP4_TILE_TOKENS - 2) // NVFP4_TILE_TOKENS + 1


class KvCacheWrite(Launcher):
    def load(self):
        super().load()
        if not self.spec.target.frozen:
            faults.buffer()   # allocated outside any capture (graphs keep its address)
        return self

    def check_cache(self, cache: dict) -> tuple[int, int]:
        """Validate names, dtypes and shapes of the cache tensors; return (num_pages, num_slots)."""
        num_pages, num_slots, wants = kv_cache_wants(self.spec.layout, cache)
        for name, (dt, want) in wants.items():
            t = cache[name]
            if tuple(t.shape) != want or t.dtype != dt or not t.is_contiguous():
                raise SpecError(f"cache[{name!r}]", (tuple(t.shape), str(t.dtype)), [(want, str(dt))],
                                "contiguous")
        return num_pages, num_slots

    def __call__(self, rows, cu_rows, start_pos, block_table, cache: dict, *, ring_slot=None,
                 scale: float = 1.0, max_rows_per_seq: int | None = None) -> None:
        """Append rows. Graph-safe when `max_rows_per_seq` is given (else it syncs to find it)."""
        import torch
        num_pages, num_slots = self.check_cache(cache)
        num_seqs = start_pos.shape[0]
        if rows.dtype != torch.bfloat16 or rows.dim() != 2 or rows.shape[1] != MLA_ROW or not rows.is_contiguous():
            raise SpecError("rows", (tuple(rows.shape), str(rows.dtype)), f"contiguous bf16 [N, {MLA_ROW}]")
        for name, t, n in (("cu_rows", cu_rows, num_seqs + 1), ("start_pos", start_pos, num_seqs)):
            if t.dtype != torch.int32 or t.shape != (n,):
                raise SpecError(name, (tuple(t.shape), str(t.dtype)), f"int32 [{n}]")
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] < num_seqs \
                or block_table.stride(1) != 1:
            raise SpecError("block_table", (tuple(block_table.shape), str(block_table.dtype)),
                            f"int32 [>= {num_seqs}, pages], unit stride along pages")
        nvfp4 = self.spec.kv is KvDtype.NVFP4
        if nvfp4 and (ring_slot is None or ring_slot.dtype != torch.int32 or ring_slot.shape != (num_seqs,)):
            raise SpecError("ring_slot", None if ring_slot is None else tuple(ring_slot.shape),
                            f"int32 [{num_seqs}] (NVFP4 KV keeps an HP tail ring per sequence)")
        # Before the sync below and the launch: a host tensor's pointer would reach the kernel.
        check_one_device(rows, cu_rows, start_pos, block_table, *cache.values(),
                         *(() if ring_slot is None else (ring_slot,)))
        if max_rows_per_seq is None:
            max_rows_per_seq = int((cu_rows[1:] - cu_rows[:-1]).max().item()) if num_seqs else 0
        if settings().validate:
            self.validate_inputs(cu_rows, start_pos, block_table, num_pages, ring_slot, num_slots,
                                 max_rows_per_seq)
        ty = tiles_for(max_rows_per_seq)
        if num_seqs == 0 or ty == 0:
            return
        names = list(self.spec.layout.tensors())
        cptr = [ptr(cache[n]) for n in names] + [0] * (4 - len(names))
        args = (rows.data_ptr(), cu_rows.data_ptr(), start_pos.data_ptr(), block_table.data_ptr(),
                block_table.stride(0), num_pages, ptr(ring_slot), *cptr, float(scale), num_seqs)
        types = (PTR, PTR, PTR, PTR, I32, I32, PTR, PTR, PTR, PTR, PTR, F32, I32)
        dev = rows.device.index if rows.device.index is not None else torch.cuda.current_device()
        if not self.spec.target.frozen:   # the frozen sources predate the error word
            args += (rows.shape[0], block_table.shape[1], num_slots, faults.word("kv_cache_write", rows.device))
            types += (I32, I32, I32, PTR)
        self.kernel.launch((num_seqs, ty, 1), (self.spec.threads, 1, 1), args, types, dev,
                           torch.cuda.current_stream(rows.device).cuda_stream)

    def validate_inputs(self, cu_rows, start_pos, block_table, num_pages, ring_slot, num_slots,
                        max_rows_per_seq) -> None:
        """Host-side checks (they synchronize): page ids in range for every row written."""
        cu = cu_rows.cpu().tolist()
        sp = start_pos.cpu().tolist()
        bt = block_table.cpu()
        rs = ring_slot.cpu().tolist() if ring_slot is not None else None
        page = self.spec.page
        for b in range(len(sp)):
            n = cu[b + 1] - cu[b]
            if n < 0 or n > max_rows_per_seq:
                raise SpecError(f"cu_rows[{b}:{b + 2}]", (cu[b], cu[b + 1]), f"0..{max_rows_per_seq} rows")
            if n == 0:
                continue
            first = sp[b] // page
            if self.spec.kv is KvDtype.NVFP4:
                first = (sp[b] // NVFP4_TILE_TOKENS * NVFP4_TILE_TOKENS) // page
            last = (sp[b] + n - 1) // page
            if last >= bt.shape[1]:
                raise PageIndexError(f"sequence {b}: position {sp[b] + n - 1} needs page slot {last}, "
                                     f"block table has {bt.shape[1]}")
            ids = bt[b, first:last + 1]
            bad = ((ids < 0) | (ids >= num_pages)).nonzero()
            if len(bad):
                j = int(bad[0, 0]) + first
                raise PageIndexError(f"sequence {b}: block_table[{b}, {j}] = {int(bt[b, j])} is outside "
                                     f"[0, {num_pages})")
            if rs is not None:
                r = rs[b]
                if not 0 <= r < num_slots:
                    raise PageIndexError(f"sequence {b}: ring_slot {r} outside [0, {num_slots})")
