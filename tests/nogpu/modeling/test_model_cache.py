"""The hybrid cache manager under randomized admit/extend/rewind/free (hypothesis), capacity
planning from the IR byte expressions, the pools' dtypes, and TargetConfig validation."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3gen.errors import SpecError, TargetError
from k3gen.ir.dims import evaluate
from model.cache import (CacheCapacityError, CacheManager, CacheStateError, HybridCache, cache_bytes,
                         check_dtypes, plan_capacity)
from model.config import TargetConfig, k3_config, tiny_config

OPS = st.lists(st.tuples(st.sampled_from(["admit", "extend", "rewind", "free"]), st.integers(0, 7),
                         st.integers(0, 300)), min_size=1, max_size=80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, slots=st.integers(1, 5), pages=st.integers(1, 24), page=st.sampled_from([64, 128]),
       max_rewind=st.sampled_from([None, 4]))
def test_manager_never_leaks_or_double_allocates(ops, slots, pages, page, max_rewind):
    m = CacheManager(slots, pages, page, max_pages_per_seq=6, max_rewind=max_rewind)
    lengths: dict[int, int] = {}
    for op, sid, n in ops:
        before = (m.free_pages, m.free_slots, {k: (list(v.pages), v.length) for k, v in m.seqs.items()})
        try:
            if op == "admit":
                m.admit(sid, n)
                lengths[sid] = 0
            elif op == "extend":
                m.extend(sid, n % 40)
                lengths[sid] += n % 40
            elif op == "rewind":
                m.rewind(sid, n % 9)
                lengths[sid] -= n % 9
            else:
                m.free(sid)
                del lengths[sid]
        except (CacheCapacityError, CacheStateError):
            # a refused operation changes nothing
            assert before == (m.free_pages, m.free_slots, {k: (list(v.pages), v.length) for k, v in m.seqs.items()})
        m.check_invariants()
        assert {k: v.length for k, v in m.seqs.items()} == lengths
        for e in m.seqs.values():
            assert len(e.pages) == m.pages_for(e.length) or op == "admit" or len(e.pages) >= m.pages_for(e.length)
            assert m.pad_page not in e.pages and e.slot != m.pad_slot
        assert m.free_pages + sum(len(e.pages) for e in m.seqs.values()) == pages
    for sid in list(m.seqs):
        m.free(sid)
    assert m.free_pages == pages and m.free_slots == slots
    m.check_invariants()


def test_rewind_frees_whole_pages_and_respects_the_ring():
    m = CacheManager(2, 8, 128, 8, max_rewind=4)
    m.admit(1, 1)
    m.extend(1, 130)
    assert len(m.entry(1).pages) == 2
    m.rewind(1, 3)
    assert len(m.entry(1).pages) == 1 and m.entry(1).length == 127
    with pytest.raises(CacheStateError, match="16 \\+ max_drafts"):
        m.rewind(1, 5)
    with pytest.raises(CacheCapacityError, match="no free state slot"):
        m.admit(2, 1), m.admit(3, 1)
    with pytest.raises(CacheCapacityError, match="KV pages"):
        m.extend(2, 8 * 128)


def test_capacity_plan_uses_the_ir_byte_expressions():
    cfg = k3_config()
    t = TargetConfig(kv="nvfp4", ssm="bf16", tp=8, max_drafts=3)
    b = cache_bytes(cfg, t)
    lay = t.kv_layout()
    assert b.per_page == 24 * evaluate(lay.bytes_per_page)
    assert b.per_slot == 69 * evaluate(t.state_layout(12).bytes_per_slot) + 24 * evaluate(lay.bytes_per_seq_fixed)
    slots, pages = plan_capacity(cfg, t, 40 * 2**30, 32768)
    assert slots * b.per_seq(32768 + 4) + b.per_slot + b.per_page <= 40 * 2**30
    assert (slots + 1) * b.per_seq(32768 + 4) + b.per_slot + b.per_page > 40 * 2**30
    with pytest.raises(CacheCapacityError, match="holds no sequence"):
        plan_capacity(cfg, t, 2**30, 131072)


@pytest.mark.parametrize("kv,ssm,drafts", [("nvfp4", "bf16", 3), ("bf16", "fp32", 0), ("fp8", "fp32", 3)])
def test_pools_have_the_target_dtypes(kv, ssm, drafts):
    t = TargetConfig(kv=kv, ssm=ssm, max_drafts=drafts)
    c = HybridCache(tiny_config(), t, num_slots=3, num_pages=5, max_seq_len=200)
    check_dtypes(c)
    assert c.block_table.shape[0] == 4 and (c.block_table == c.mgr.pad_page).all()
    e = c.admit(9, 150)
    assert c.block_table[e.slot, :len(e.pages)].tolist() == e.pages
    c.state[0]["ssm"] = c.state[0]["ssm"].to(torch.float16)
    with pytest.raises(SpecError, match="ssm"):
        check_dtypes(c)


def test_target_config_rejects_invalid_combinations():
    with pytest.raises(TargetError, match="kv='nvfp4'"):
        TargetConfig(arch="sm100", kv="nvfp4")
    with pytest.raises(TargetError, match="ssm='bf16'"):
        TargetConfig(arch="sm100", kv="bf16", ssm="bf16")
    with pytest.raises(SpecError, match="max_drafts"):
        TargetConfig(kv="bf16", max_drafts=9)
    with pytest.raises(SpecError, match="recipe"):
        TargetConfig(arch="sm103", kv="nvfp4", recipe="fp32")
    with pytest.raises(SpecError, match="graph_batch_sizes"):
        TargetConfig(graph_batch_sizes=(4, 2))
    t = TargetConfig(kv="nvfp4", ssm="bf16", max_drafts=3)
    assert t.kv_layout().page == 128 and t.kv_layout().ring == 19
    assert [t.graph_size_for(b) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(SpecError, match="batch"):
        t.graph_size_for(9)


def test_prefill_that_does_not_fit_leaves_the_cache_unchanged():
    from model.model import K3Model
    t = TargetConfig(kv="bf16", ssm="fp32")
    c = HybridCache(tiny_config(), t, num_slots=2, num_pages=4, max_seq_len=100)
    m = K3Model.__new__(K3Model)
    m.cache, m.tcfg, m.device = c, t, c.device
    with pytest.raises(CacheCapacityError, match="no free state slot"):
        m.prefill([1, 2, 3], [[1], [2], [3]])
    assert c.mgr.free_slots == 2 and c.mgr.free_pages == 4 and not c.mgr.seqs
