"""The hybrid cache manager: one owner for everything a sequence holds.

Per sequence: one state slot (its row in every KDA layer's recurrent-state pools, conv window,
FP32 draft records, conv_ext and `pending`, and its HP tail ring in every MLA layer) and a list
of KV pages (the same page ids index the pool of every MLA layer). Slot `num_slots` and page
`num_pages` are reserved for CUDA-graph padding rows: they are never handed to a sequence, so a
padded row may write there without touching anyone's data.

Operations: `admit` (slot + pages for the prompt), `reserve` / `unreserve` (pages ahead of the
length: a continued prefill's, given back when its batch is refused), `extend` (tokens written:
pages when a sequence crosses a page boundary), `rewind` (rejected drafts: the length goes back, whole pages
past the new end are freed; no partial page reuse), `free`. Capacity comes from a memory budget
through the IR's byte expressions (k3gen/ir/layouts.py); a request that cannot fit raises
`CacheCapacityError` naming what is short.

Under tensor parallelism (model/dist.py) each rank holds its own HybridCache of `TargetConfig(tp=world)`:
the KDA pools of its heads (H / world per slot), and the full MLA latent rows (576 per token, shared by every
head, so not split by heads: each rank's MLA heads read all of them), i.e. the same pages as TP1. Every rank
runs the same host bookkeeping on the same requests, so slots, pages and block tables agree across ranks
without communication. `cache_bytes` / `plan_capacity` (plan-memory) count exactly these per-rank pools.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3gen.errors import K3genError, SpecError
from k3gen.ir.dims import evaluate
from k3gen.ir.dtypes import KvDtype
from k3gen.ops.kda_verify.reference import start_of as kda_verify_start
from k3gen.ops.kv_cache_write.reference import alloc_cache

from model.config import ModelConfig, TargetConfig


class CacheCapacityError(K3genError):
    """A request does not fit the cache (slots or pages), or a plan fits nothing."""


class CacheStateError(K3genError):
    """An operation on a sequence the manager does not hold, or a length out of range."""


@dataclass
class SeqEntry:
    seq_id: int
    slot: int
    pages: list[int]
    length: int = 0       # tokens written to the cache (committed + not yet rewound)
    kda_mode: str | None = None   # the step kind that last wrote its KDA pools: None (prefill), "decode", "verify"


class CacheManager:
    """Bookkeeping of slots and pages (no tensors): what the randomized tests exercise."""

    def __init__(self, num_slots: int, num_pages: int, page: int, max_pages_per_seq: int,
                 max_rewind: int | None = None):
        if num_slots < 1 or num_pages < 1:
            raise CacheCapacityError(f"a cache needs >= 1 slot and page (got {num_slots}, {num_pages})")
        self.num_slots, self.num_pages, self.page = num_slots, num_pages, page
        self.max_pages_per_seq = max_pages_per_seq
        self.max_rewind = max_rewind
        self.pad_slot, self.pad_page = num_slots, num_pages      # reserved, never allocated
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self.seqs: dict[int, SeqEntry] = {}

    # -- queries ----------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page)

    def entry(self, seq_id: int) -> SeqEntry:
        if seq_id not in self.seqs:
            raise CacheStateError(f"sequence {seq_id} is not in the cache")
        return self.seqs[seq_id]

    def can_admit(self, tokens: int) -> bool:
        return bool(self._free_slots) and self.pages_for(tokens) <= self.free_pages \
            and self.pages_for(tokens) <= self.max_pages_per_seq

    # -- operations -------------------------------------------------------------------------------
    def admit(self, seq_id: int, tokens: int) -> SeqEntry:
        """A slot and pages for `tokens` positions (the prompt); the length starts at 0."""
        if seq_id in self.seqs:
            raise CacheStateError(f"sequence {seq_id} is already in the cache")
        if tokens < 0:
            raise CacheStateError(f"sequence {seq_id}: {tokens} tokens")
        need = self.pages_for(tokens)
        if need > self.max_pages_per_seq:
            raise CacheCapacityError(f"sequence {seq_id}: {tokens} tokens need {need} pages, a sequence holds at "
                                     f"most {self.max_pages_per_seq} ({self.max_pages_per_seq * self.page} tokens)")
        if not self._free_slots:
            raise CacheCapacityError(f"sequence {seq_id}: no free state slot (all {self.num_slots} in use)")
        if need > self.free_pages:
            raise CacheCapacityError(f"sequence {seq_id}: {tokens} tokens need {need} KV pages, {self.free_pages} "
                                     f"of {self.num_pages} free")
        e = SeqEntry(seq_id, self._free_slots.pop(), [self._free_pages.pop() for _ in range(need)])
        self.seqs[seq_id] = e
        return e

    def reserve(self, seq_id: int, tokens: int) -> None:
        """Make sure pages cover positions < tokens (all or nothing)."""
        e = self.entry(seq_id)
        need = self.pages_for(tokens) - len(e.pages)
        if need <= 0:
            return
        if len(e.pages) + need > self.max_pages_per_seq:
            raise CacheCapacityError(f"sequence {seq_id}: {tokens} tokens exceed {self.max_pages_per_seq} pages")
        if need > self.free_pages:
            raise CacheCapacityError(f"sequence {seq_id}: needs {need} more KV pages, {self.free_pages} free")
        e.pages += [self._free_pages.pop() for _ in range(need)]

    def unreserve(self, seq_id: int, pages: int) -> None:
        """Undo `reserve`: give back the pages past the first `pages` (never below what the length
        needs), in the order `reserve` took them, so the free list is as it was before."""
        e = self.entry(seq_id)
        if not self.pages_for(e.length) <= pages <= len(e.pages):
            raise CacheStateError(f"sequence {seq_id}: keep {pages} of {len(e.pages)} pages at length {e.length}")
        while len(e.pages) > pages:
            self._free_pages.append(e.pages.pop())

    def extend(self, seq_id: int, n: int) -> SeqEntry:
        """`n` more tokens are written: pages for them, then the length moves on."""
        e = self.entry(seq_id)
        if n < 0:
            raise CacheStateError(f"extend by {n}")
        self.reserve(seq_id, e.length + n)
        e.length += n
        return e

    def rewind(self, seq_id: int, n: int) -> SeqEntry:
        """Drop the last `n` tokens (rejected drafts); free whole pages past the new end."""
        e = self.entry(seq_id)
        if not 0 <= n <= e.length:
            raise CacheStateError(f"sequence {seq_id}: rewind {n} of {e.length} tokens")
        if self.max_rewind is not None and n > self.max_rewind:
            raise CacheStateError(f"sequence {seq_id}: rewind {n} > {self.max_rewind} (the HP tail ring keeps "
                                  "16 + max_drafts rows)")
        e.length -= n
        keep = max(self.pages_for(e.length), 0)
        while len(e.pages) > keep:
            self._free_pages.append(e.pages.pop())
        return e

    def free(self, seq_id: int) -> None:
        e = self.seqs.pop(seq_id, None)
        if e is None:
            raise CacheStateError(f"sequence {seq_id} is not in the cache")
        self._free_pages.extend(reversed(e.pages))
        self._free_slots.append(e.slot)

    def check_invariants(self) -> None:
        """No page or slot owned twice or both owned and free; counts add up."""
        owned_pages = [p for e in self.seqs.values() for p in e.pages]
        owned_slots = [e.slot for e in self.seqs.values()]
        for what, owned, free, total in (("page", owned_pages, self._free_pages, self.num_pages),
                                         ("slot", owned_slots, self._free_slots, self.num_slots)):
            allv = owned + free
            if len(set(allv)) != len(allv):
                raise CacheStateError(f"a {what} is owned twice or both owned and free")
            if sorted(allv) != list(range(total)):
                raise CacheStateError(f"{what}s leaked or invented: {len(allv)} accounted of {total}")
        for e in self.seqs.values():
            if len(e.pages) < self.pages_for(e.length) or len(e.pages) > self.max_pages_per_seq:
                raise CacheStateError(f"sequence {e.seq_id}: {len(e.pages)} pages for {e.length} tokens")


# -- sizes and planning ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheBytes:
    per_page: int          # one page in every MLA layer
    per_slot: int          # one state slot in every KDA layer + one HP tail per MLA layer
    page: int

    def per_seq(self, tokens: int) -> int:
        return self.per_slot + -(-tokens // self.page) * self.per_page


def cache_bytes(cfg: ModelConfig, tcfg: TargetConfig) -> CacheBytes:
    shape = cfg.for_tp(tcfg.tp)
    lay = tcfg.kv_layout()
    nm, nk = len(cfg.mla_layer_ids), len(cfg.kda_layer_ids)
    per_page = nm * evaluate(lay.bytes_per_page)
    per_slot = nk * evaluate(tcfg.state_layout(shape.kda_heads).bytes_per_slot) + nm * evaluate(lay.bytes_per_seq_fixed)
    return CacheBytes(per_page=per_page, per_slot=per_slot, page=lay.page)


def plan_capacity(cfg: ModelConfig, tcfg: TargetConfig, budget_bytes: int, max_seq_len: int) -> tuple[int, int]:
    """(num_slots, num_pages) filling `budget_bytes` with sequences of up to `max_seq_len`
    tokens (+ drafts); the padding slot and page are included in the budget."""
    b = cache_bytes(cfg, tcfg)
    per = b.per_seq(max_seq_len + tcfg.max_drafts + 1)
    seqs = (budget_bytes - b.per_slot - b.per_page) // per
    if seqs < 1:
        raise CacheCapacityError(f"{budget_bytes / 2**30:.2f} GiB holds no sequence of {max_seq_len} tokens "
                                 f"({per / 2**30:.3f} GiB each with kv={tcfg.kv.value}, ssm={tcfg.ssm.value})")
    return int(seqs), int(seqs * -(-(max_seq_len + tcfg.max_drafts + 1) // b.page))


# -- the pools -------------------------------------------------------------------------------------
class HybridCache:
    """The tensors of every layer plus the manager and a block table indexed by slot."""

    def __init__(self, cfg: ModelConfig, tcfg: TargetConfig, num_slots: int, num_pages: int, max_seq_len: int,
                 device="cpu"):
        self.cfg, self.tcfg, self.device = cfg, tcfg, torch.device(device)
        self.layout = tcfg.kv_layout()
        shape = cfg.for_tp(tcfg.tp)
        self.kda_heads, self.mla_heads = shape.kda_heads, shape.mla_heads
        self.max_pages_per_seq = -(-(max_seq_len + tcfg.max_drafts + 1) // self.layout.page)
        rew = tcfg.max_drafts + 1 if tcfg.kv is KvDtype.NVFP4 else None
        self.mgr = CacheManager(num_slots, num_pages, self.layout.page, self.max_pages_per_seq, max_rewind=rew)
        S, P = num_slots + 1, num_pages + 1        # + the padding slot / page
        self.kv = {i: alloc_cache(self.layout, P, S, device) for i in cfg.mla_layer_ids}
        # Cache tensors indexed by slot (the NVFP4 HP tail ring) rather than by page.
        self._slot_tensors = {n for n, ts in self.layout.tensors().items()
                              if ts.concrete_shape(num_pages=2, num_slots=3)[0] == 3}
        sl = tcfg.state_layout(self.kda_heads)
        self.state = {}
        for i in cfg.kda_layer_ids:
            pools = {}
            for name, ts in sl.tensors().items():
                dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "int32": torch.int32}[ts.dtype.name]
                pools[name] = torch.zeros(ts.concrete_shape(num_slots=S), dtype=dt, device=device)
            self.state[i] = pools
        self.block_table = torch.full((S, self.max_pages_per_seq), self.mgr.pad_page, dtype=torch.int32,
                                      device=device)
        # Static per-layer NVFP4 global scale G (latent values above 6 * 448 / G clip; SPEC.md section 5):
        # TensorRT-LLM's KV choice, 2688 / 30 for values up to 30 after the kv_a RMSNorm.
        self.kv_scale = {i: 2688.0 / 30.0 if tcfg.kv is KvDtype.NVFP4 else 1.0 for i in cfg.mla_layer_ids}

    @property
    def pad_slot(self) -> int:
        return self.mgr.pad_slot

    def _sync_row(self, e: SeqEntry) -> None:
        row = torch.full((self.max_pages_per_seq,), self.mgr.pad_page, dtype=torch.int32)
        row[: len(e.pages)] = torch.tensor(e.pages, dtype=torch.int32)
        self.block_table[e.slot].copy_(row.to(self.device))

    def admit(self, seq_id: int, tokens: int) -> SeqEntry:
        e = self.mgr.admit(seq_id, tokens)
        for pools in self.state.values():
            if "pending" in pools:
                pools["pending"][e.slot] = 0
        self._sync_row(e)
        return e

    def extend(self, seq_id: int, n: int) -> SeqEntry:
        before = len(self.mgr.entry(seq_id).pages)
        e = self.mgr.extend(seq_id, n)
        if len(e.pages) != before:
            self._sync_row(e)
        return e

    def reserve(self, seq_id: int, tokens: int) -> None:
        before = len(self.mgr.entry(seq_id).pages)
        self.mgr.reserve(seq_id, tokens)
        e = self.mgr.entry(seq_id)
        if len(e.pages) != before:
            self._sync_row(e)

    def unreserve(self, seq_id: int, pages: int) -> None:
        """Give back the pages a `reserve` took (never written: they hold zeros, as free pages do)."""
        before = len(self.mgr.entry(seq_id).pages)
        self.mgr.unreserve(seq_id, pages)
        if pages != before:
            self._sync_row(self.mgr.entry(seq_id))

    def rewind(self, seq_id: int, n: int) -> SeqEntry:
        before = list(self.mgr.entry(seq_id).pages)
        e = self.mgr.rewind(seq_id, n)
        self._scrub(before[len(e.pages):], None)
        self._sync_row(e)
        return e

    def _scrub(self, pages: list[int], slot: int | None) -> None:
        """Zero the KV pages (every MLA layer) and the HP tail ring of `slot` a sequence gives back,
        so a free page or ring holds zeros. The attention kernels read whole tiles and weight the
        rows past a sequence's length by p = 0, and 0 x NaN is NaN: a finished request whose rows
        went non-finite would otherwise poison the next owner of its pages (model/soak.py found
        it: 2 of 13 requests changed their tokens after a NaN request's pages were reused)."""
        if not pages and slot is None:
            return
        pidx = torch.tensor(pages, dtype=torch.long, device=self.device) if pages else None
        for cache in self.kv.values():
            for name, t in cache.items():
                if name in self._slot_tensors:
                    if slot is not None:
                        t[slot].zero_()
                elif pidx is not None:
                    t.index_fill_(0, pidx, 0)

    def sync_kda(self, seq_ids: list[int], T: int) -> None:
        """Before a step of T tokens per sequence: bring each sequence's KDA pools to the view that
        step reads, when its last step was the other kind. Decode (T = 1) reads ssm and the BF16
        conv window; verify reads ssm or the draft record `pending` names and the FP32 window in
        conv_ext at column `pending` (a commit only sets `pending`; the next verify folds it). So a
        decode after a commit first folds: ssm = the committed record (stored rounded as decode
        rounds it: exact), conv = conv_ext's window, pending = 0; a verify after a decode first
        copies the decode-updated conv into conv_ext's columns 0..2. Prefill writes both views.
        A sequence that stays on one kind (the Generator's loops) costs nothing here."""
        entries = [self.mgr.entry(s) for s in seq_ids]
        fold = [e.slot for e in entries if T == 1 and e.kda_mode == "verify"]
        ext = [e.slot for e in entries if T > 1 and e.kda_mode == "decode"]
        for pools in self.state.values():
            if "pending" not in pools or not (fold or ext):
                continue
            if fold:
                # The state and window the next verify would start from (kda_verify's own rule).
                idx = torch.tensor(fold, dtype=torch.long, device=self.device)
                state, window = kda_verify_start(pools["ssm"], pools["draft_rec"], pools["conv_ext"],
                                                 pools["pending"], idx)
                pools["ssm"][idx] = state.to(pools["ssm"].dtype)
                pools["conv"][idx] = window.to(pools["conv"].dtype)
                pools["pending"][idx] = 0
            if ext:
                idx = torch.tensor(ext, dtype=torch.long, device=self.device)
                pools["conv_ext"][idx, :, :3] = pools["conv"][idx].to(pools["conv_ext"].dtype)
        for e in entries:
            e.kda_mode = "decode" if T == 1 else "verify"

    def free(self, seq_id: int) -> None:
        e = self.mgr.entry(seq_id)
        self.mgr.free(seq_id)
        self._scrub(e.pages, e.slot)
        self.block_table[e.slot].fill_(self.mgr.pad_page)

    def nbytes(self) -> int:
        tensors = [t for d in self.kv.values() for t in d.values()] + \
                  [t for d in self.state.values() for t in d.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @classmethod
    def from_budget(cls, cfg, tcfg, budget_bytes: int, max_seq_len: int, device="cpu", max_slots: int | None = None):
        slots, pages = plan_capacity(cfg, tcfg, budget_bytes, max_seq_len)
        if max_slots is not None and slots > max_slots:
            pages = math.ceil(pages * max_slots / slots)
            slots = max_slots
        return cls(cfg, tcfg, slots, pages, max_seq_len, device)


def check_dtypes(cache: HybridCache) -> None:
    """Raise SpecError unless every pool has the dtype the target asks for (the GPU tests call it)."""
    want_ssm = torch.float32 if cache.tcfg.ssm.value == "fp32" else torch.bfloat16
    for i, pools in cache.state.items():
        if pools["ssm"].dtype != want_ssm:
            raise SpecError(f"state[{i}].ssm", str(pools["ssm"].dtype), [str(want_ssm)])
        if pools["conv"].dtype != torch.bfloat16:
            raise SpecError(f"state[{i}].conv", str(pools["conv"].dtype), ["torch.bfloat16"])
        for n in ("draft_rec", "conv_ext"):
            if n in pools and pools[n].dtype != torch.float32:
                raise SpecError(f"state[{i}].{n}", str(pools[n].dtype), ["torch.float32"])
    want_kv = {KvDtype.BF16: ("kv", torch.bfloat16), KvDtype.FP8: ("kv_codes", torch.uint8),
               KvDtype.NVFP4: ("kv_codes", torch.uint8)}[cache.tcfg.kv]
    for i, d in cache.kv.items():
        name, dt = want_kv
        if name not in d or d[name].dtype != dt:
            raise SpecError(f"kv[{i}]", sorted(d), [f"{name}: {dt}"])
        if cache.tcfg.kv is KvDtype.NVFP4 and (d["hp_tail"].dtype != torch.bfloat16
                                               or d["kv_codes"].shape[-1] != 288 or d["kv_codes"].shape[1] != 128):
            raise SpecError(f"kv[{i}]", {k: tuple(v.shape) for k, v in d.items()}, ["128-token NVFP4 pages + BF16 tail"])
