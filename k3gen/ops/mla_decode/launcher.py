"""Launcher of mla_decode (ABI: ops/mla_decode/template.cu.j2; contract: ops/mla_decode/spec.py;
geometry: the variant's plan, ops/mla_decode/variants.py).

Graph-safe use: `plan = op.plan(batch, max_len)` once (it picks the split count from the batch
shape and allocates the split workspace), then `op(..., plan=plan)` per step. The launch reads
tensor metadata only; lengths and block tables are read on the device, so a captured graph
replays correctly with changed lengths up to the planned maximum (longer ones stay correct,
with fewer CTAs than ideal). Without a plan the call plans itself (it syncs and allocates).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from k3gen.config import settings
from k3gen.errors import PageIndexError, SpecError
from k3gen.ir.dtypes import KvDtype
from k3gen.ir.layouts import MLA_LATENT, MLA_ROW
from k3gen.ops.mla_decode.spec import TILE_TOKENS, choose_splits
from k3gen.runtime import faults
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.checks import check_one_device, check_tensor, kv_cache_wants
from k3gen.runtime.loader import F32, I32, PTR, ArgPack, ptr
from k3gen.runtime.tma import MapCache

I64 = ctypes.c_longlong
MAX_GRID_YZ = 65535
TMA_MAPS = 16        # encoded KV maps kept per launcher (a serving process has one cache per layer)


@dataclass
class SplitPlan:
    """Split count and its FP32 workspace (None when one split needs no combine)."""
    batch: int
    max_len: int
    splits: int
    part_o: object = None     # [batch, splits, T*H, 512] FP32
    part_lse: object = None   # [batch, splits, T*H] FP32


class MlaDecode(Launcher):
    def __init__(self, spec):
        super().__init__(spec)
        self.geo = spec.impl.plan(spec)   # the chosen kernel's geometry
        self._smem_set: set[int] = set()
        self._combine = None
        self._maps = MapCache(TMA_MAPS)   # the KV maps, for a kernel that takes one

    def load(self):
        if self._kernel is None:
            super().load()
            from k3gen.runtime.loader import CudaKernel
            self._combine = CudaKernel(self._kernel.cubin, "k3gen_mla_decode_combine")
        self.sm_count  # noqa: B018  (queried once, outside any graph capture)
        self._allow_smem(self.device_index)
        faults.buffer()   # allocated outside any capture (graphs keep its address)
        return self

    def _allow_smem(self, device: int) -> None:
        if device in self._smem_set:
            return
        self._kernel.set_max_dynamic_smem(self.geo.smem_bytes, device)
        if self.geo.ctas_per_sm > 1:
            self._kernel.prefer_max_smem(device)
        self._smem_set.add(device)

    def _kv_map(self, kv, num_pages: int) -> bytes:
        """TMA map of the BF16 KV pages (plan.kv_map): [pages * page rows][1152 bytes] as uint8, box
        [64 rows][128 bytes] = one SW128 block of a tile; rows past the end read as zeros (bad page ids
        point there)."""
        row = MLA_ROW * 2
        return self._maps.get(kv, (row, num_pages * self.spec.page), (row,), (128, TILE_TOKENS))

    # -- planning (outside graphs) ---------------------------------------------------------------
    def splits_for(self, batch: int, max_len: int) -> int:
        s, g = self.spec, self.geo
        return choose_splits(batch, max_len, s.heads, self.sm_count * g.ctas_per_sm, s.tokens, g.rows)

    def plan(self, batch: int, max_len: int, *, splits: int | None = None, device=None) -> SplitPlan:
        """Choose the split count for `batch` sequences of up to `max_len` tokens and allocate
        the workspace the combine step needs. `splits` overrides the choice (tests, benchmarks)."""
        import torch
        self.load()
        n = self.splits_for(batch, max_len) if splits is None else splits
        if not 1 <= n <= MAX_GRID_YZ:
            raise SpecError("splits", n, f"1..{MAX_GRID_YZ}")
        plan = SplitPlan(batch, max_len, n)
        if n > 1:
            dev = device if device is not None else torch.device("cuda", self.device_index)
            ht = self.spec.heads * self.spec.tokens
            plan.part_o = torch.empty(batch, n, ht, MLA_LATENT, dtype=torch.float32, device=dev)
            plan.part_lse = torch.empty(batch, n, ht, dtype=torch.float32, device=dev)
        return plan

    # -- checks ----------------------------------------------------------------------------------
    def check_cache(self, cache: dict) -> tuple[int, int]:
        """Names, dtypes and shapes of the cache tensors; returns (num_pages, num_slots)."""
        num_pages, num_slots, wants = kv_cache_wants(self.spec.layout, cache)
        for name, (dt, want) in wants.items():
            check_tensor(f"cache[{name!r}]", cache[name], dt, want, align=16)
        return num_pages, num_slots

    def check(self, q, cache, block_table, lengths, out, ring_slot) -> tuple[int, int, int]:
        import torch
        s = self.spec
        B = lengths.shape[0] if lengths.dim() == 1 else -1
        check_tensor("lengths", lengths, torch.int32, (None,))
        check_tensor("q", q, torch.bfloat16, (B, s.tokens, s.heads, MLA_ROW), align=16)
        check_tensor("out", out, torch.bfloat16, (B, s.tokens, s.heads, MLA_LATENT), align=16)
        check_tensor("block_table", block_table, torch.int32, (None, None), contiguous=False, inner_unit=True)
        if block_table.shape[0] < B:
            raise SpecError("block_table", tuple(block_table.shape), f"[>= {B}, pages]", "one row per sequence")
        num_pages, num_slots = self.check_cache(cache)
        tensors = [q, block_table, lengths, *cache.values()]
        if s.kv is KvDtype.NVFP4:
            if ring_slot is None:
                raise SpecError("ring_slot", None, f"int32 [{B}]", "NVFP4 KV reads the HP tail ring")
            check_tensor("ring_slot", ring_slot, torch.int32, (B,))
            tensors.append(ring_slot)
        check_one_device(out, *tensors)
        if B > MAX_GRID_YZ:
            raise SpecError("batch", B, f"<= {MAX_GRID_YZ}", "sequences are grid.z")
        return B, num_pages, num_slots

    def validate_inputs(self, block_table, lengths, num_pages, ring_slot, num_slots) -> None:
        """Host-side checks (they synchronize): lengths and every page id a sequence reads."""
        page, T = self.spec.page, self.spec.tokens
        lens = lengths.cpu().tolist()
        bt = block_table.cpu()
        for b, L in enumerate(lens):
            if L < T:
                raise SpecError(f"lengths[{b}]", L, f">= {T}", "the T query tokens are in the cache")
            need = -(-L // page)
            if need > bt.shape[1]:
                raise PageIndexError(f"sequence {b}: length {L} needs {need} pages, block table has {bt.shape[1]}")
            ids = bt[b, :need]
            bad = ((ids < 0) | (ids >= num_pages)).nonzero()
            if len(bad):
                j = int(bad[0, 0])
                raise PageIndexError(f"sequence {b}: block_table[{b}, {j}] = {int(bt[b, j])} is outside "
                                     f"[0, {num_pages})")
        if ring_slot is not None:
            for b, r in enumerate(ring_slot.cpu().tolist()):
                if not 0 <= r < num_slots:
                    raise PageIndexError(f"sequence {b}: ring_slot {r} outside [0, {num_slots})")

    # -- launch ----------------------------------------------------------------------------------
    def __call__(self, q, cache: dict, block_table, lengths, out, *, ring_slot=None, scale: float = 1.0,
                 plan: SplitPlan | None = None):
        """o_lat for `lengths.shape[0]` sequences; returns `out`.

        q [B, T, H, 576] BF16, cache: the KvLayout tensors by name, block_table [>= B, pages]
        int32 (unit inner stride), lengths [B] int32 (>= T), out [B, T, H, 512] BF16,
        ring_slot [B] int32 (NVFP4), scale: the FP8 per-tensor scale or the NVFP4 global G.
        """
        import torch
        B, num_pages, num_slots = self.check(q, cache, block_table, lengths, out, ring_slot)
        if B == 0:
            return out
        if settings().validate:
            self.validate_inputs(block_table, lengths, num_pages, ring_slot, num_slots)
        if plan is None:
            plan = self.plan(B, int(lengths.max().item()), device=out.device)
        if plan.batch < B:
            raise SpecError("plan.batch", plan.batch, f">= {B}", "plan for the largest batch")
        names = list(self.spec.layout.tensors())
        cptr = [ptr(cache[n]) for n in names] + [0] * (4 - len(names))
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        self.load()._allow_smem(dev)
        stream = torch.cuda.current_stream(out.device).cuda_stream
        n = plan.splits
        args = (q.data_ptr(), lengths.data_ptr(), block_table.data_ptr(), block_table.stride(0),
                block_table.shape[1], num_pages, ptr(ring_slot), num_slots, *cptr, float(scale), out.data_ptr(),
                ptr(plan.part_o), ptr(plan.part_lse), n, faults.word("mla_decode", out.device))
        types = (PTR, PTR, PTR, I64, I32, I32, PTR, I32, PTR, PTR, PTR, PTR, F32, PTR, PTR, PTR, I32, PTR)
        geo = self.geo
        grid, block = (geo.groups, n, B), (geo.threads, 1, 1)
        if geo.kv_map:
            pack = ArgPack()
            for v, t in zip(args, types):
                pack.add(t(v))
            pack.add(self._kv_map(cache["kv"], num_pages))
            self.kernel.launch_ex(grid, block, None, pack.address(), None, dev, stream, geo.smem_bytes)
        else:
            self.kernel.launch(grid, block, args, types, dev, stream, geo.smem_bytes)
        if n > 1:
            # The workspace rows are [plan.batch, n, T*H]: the combine indexes them with the
            # plan's split count, sequences 0..B-1.
            # With programmatic dependent launch (K3GEN_PDL, default on) the combine's CTAs are
            # resident and waiting (griddepcontrol.wait) when the split kernel's last CTA ends:
            # its launch latency leaves the critical path of small batches.
            self._combine.launch_ex((self.spec.heads * self.spec.tokens, B, 1), (geo.combine_threads, 1, 1), None,
                                    (plan.part_o.data_ptr(), plan.part_lse.data_ptr(), out.data_ptr(), n),
                                    (PTR, PTR, PTR, I32), dev, stream, pdl=settings().pdl)
        return out
