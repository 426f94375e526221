"""The model's kernel path (model/ops.py KernelOps over the `k3gen::` ops; on the CPU each op runs
its FP32 reference) under torch.compile: the tiny model's decode and verify steps trace as one graph
with no break (torch._dynamo.explain), a compiled greedy decode gives the eager tokens without
recompiling per step, and the kernel path's tokens equal the reference path's (issue 24).
The H200 twin (mode="reduce-overhead", the small model, timings) is tests/gpu/test_library.py."""
from __future__ import annotations

import pytest
import torch

from model.cache import HybridCache
from model.config import TargetConfig, tiny_config
from model.generate import Generator, Request
from model.model import K3Model
from model.weights import load_weights

CFG = tiny_config()
KERNEL_OPS = ("act_quant_fp8", "fp8_block_gemm", "kda_decode", "kv_cache_write", "mla_decode", "mla_q_absorb",
              "mla_vb_gate")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from model.checkpoint import write_random_checkpoint
    d = tmp_path_factory.mktemp("tiny-ckpt")
    write_random_checkpoint(CFG, d, seed=3)
    return load_weights(d, CFG)


def make(weights, path="kernel", kv="nvfp4", ssm="bf16", drafts=3):
    t = TargetConfig(kv=kv, ssm=ssm, max_drafts=drafts, path=path)
    m = K3Model(weights, t, HybridCache(CFG, t, num_slots=4, num_pages=16, max_seq_len=96, device="cpu"))
    m.load_kernels()
    return m


def _called(ex) -> set[str]:
    return {str(n.target) for g in ex.graphs for n in g.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("T", [1, 4], ids=["decode", "verify"])
def test_step_traces_as_one_graph(weights, T):
    m = make(weights)
    B = 2
    tok = torch.zeros(B * T, dtype=torch.long)
    slots = torch.full((B,), m.cache.pad_slot, dtype=torch.int32)   # padding rows: explain runs the step
    torch._dynamo.reset()
    ex = torch._dynamo.explain(lambda a, b, c: m.step_core(a, b, c, T))(tok, slots, torch.zeros(B, dtype=torch.int32))
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    called = _called(ex)
    want = [op for op in KERNEL_OPS if not (T > 1 and op == "kda_decode")] + (["kda_verify"] if T > 1 else [])
    for op in want:
        assert any(f"k3gen.{op}" in c for c in called), (op, sorted(c for c in called if "k3gen" in c))


def _greedy(m, step, prompts, n):
    ids = list(range(len(prompts)))
    out = [[int(lg.argmax())] for lg in m.prefill(ids, prompts)]
    try:
        for _ in range(n - 1):
            slots, start = m.prepare(ids, 1)
            lg = step(torch.tensor([o[-1] for o in out]), slots, start)
            for o, row in zip(out, lg):
                o.append(int(row.argmax()))
    finally:
        m.release(ids)
    return out


def test_compiled_decode_equals_eager_without_recompiling(weights, request):
    ps = [[1, 2, 3, 4, 5, 6], [9, 8, 7]]
    m = make(weights)
    torch._dynamo.reset()
    # config.patch, not monkeypatch.setattr: its undo deletes the config entry (a later compile in
    # the session then fails with "recompile_limit does not exist")
    limit = torch._dynamo.config.patch(recompile_limit=1)
    limit.__enter__()    # a per-step guard fails here
    request.addfinalizer(lambda: limit.__exit__(None, None, None))
    step = torch.compile(lambda a, b, c: m.step_core(a, b, c, 1), fullgraph=True, backend="aot_eager",
                         dynamic=False)
    got = _greedy(m, step, ps, 6)
    eager = [r.out for r in Generator(make(weights)).generate([Request(p, 6) for p in ps])]
    ref = [r.out for r in Generator(make(weights, path="reference")).generate([Request(p, 6) for p in ps])]
    assert got == eager == ref


def test_kernel_path_runs_the_ops_and_counts_eagerly(weights):
    m = make(weights, kv="bf16", ssm="fp32", drafts=0)
    Generator(m).generate([Request([3, 1, 4, 1, 5], 3)])
    ran = {k for k, v in m.ops.ran.items() if v}
    assert {"kernel:kda_decode", "kernel:mla_decode", "kernel:fp8_linear", "kernel:kv_cache_write"} <= ran
    assert not {k for k in ran if k.startswith("ref:")}
