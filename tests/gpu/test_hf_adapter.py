"""k3gen.api.hf on the H200: transformers' tiny Kimi-Linear (tests/hf_tiny.py, FP32 weights, its own
PyTorch KDA path as the oracle: FLA hidden) with k3gen's KDA (kda_prefill through k3gen.api.fla),
MLA decode (kv_cache_write + mla_decode, absorbed) and MoE routing (moe_route) kernels swapped in.

- Teacher-forced logits (prefill + cached decode steps) within 2x transformers' own BF16-input floor
  (tests/nogpu/library/test_hf_adapter_spec._bf16_floor: the adapter's input roundings) plus the tolerance
  table's BF16 relative RMS (the kernels' own arithmetic: BF16 tensor-core operands, FP32 sums).
- `generate` greedy tokens equal transformers' own, except after a BF16 tie: the first differing
  token must be one where transformers' top-2 margin is within 6x that step's RMS logit error."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from numerics import rel_rms, tolerance

pytestmark = pytest.mark.gpu
NEW = 24


@pytest.mark.parametrize("case", sorted(hf_tiny.CASES))
def test_adapter_on_the_kernels_matches_transformers(case):
    import k3gen.api.hf as k3hf
    from tests.nogpu.library.test_hf_adapter_spec import _bf16_floor
    m = hf_tiny.build(hf_tiny.CASES[case], hf_tiny.SEEDS[case]).cuda()
    toks = hf_tiny.tokens(hf_tiny.SEEDS[case]).cuda()
    want = hf_tiny.hf_logits(m, toks)
    floor = [rel_rms(f, w) for f, w in zip(_bf16_floor(m, toks), want)]
    with k3hf.install(m) as a:
        got = hf_tiny.hf_logits(m, toks)
        with torch.no_grad():
            ids = m.generate(toks[None, :hf_tiny.PROMPT], max_new_tokens=NEW, do_sample=False)
        ran = dict(a.ran)
    with torch.no_grad():
        own = m.generate(toks[None, :hf_tiny.PROMPT], max_new_tokens=NEW, do_sample=False)
    errs = [rel_rms(g, w) for g, w in zip(got, want)]
    bf = tolerance(torch.bfloat16).rel_rms
    print(f"\n{case}: adapter vs transformers {['%.4f' % e for e in errs]}, floor {['%.4f' % f for f in floor]}, "
          f"ran {ran}")
    assert all(torch.isfinite(g).all() for g in got)
    assert ran["kda_chunk"] >= 4 and ran["kda_recurrent"] >= 4 * hf_tiny.DECODE and ran["mla_decode"] >= hf_tiny.DECODE
    assert ran["moe_route"] >= 4 * (1 + hf_tiny.DECODE)
    for step, (e, f) in enumerate(zip(errs, floor)):
        assert e <= 2 * f + bf, (step, e, f)
    a_ids, o_ids = ids[0, hf_tiny.PROMPT:].tolist(), own[0, hf_tiny.PROMPT:].tolist()
    print(f"{case}: greedy adapter {a_ids}\n{case}: greedy own     {o_ids}")
    if a_ids != o_ids:
        j = next(i for i, (x, y) in enumerate(zip(a_ids, o_ids)) if x != y)
        seq = own[0, :hf_tiny.PROMPT + j]
        with torch.no_grad():
            lo = m(input_ids=seq[None]).logits[0, -1].float()
        with k3hf.install(m), torch.no_grad():
            la = m(input_ids=seq[None]).logits[0, -1].float()
        top = lo.topk(2).values
        err = float((la - lo).square().mean().sqrt())
        print(f"{case}: first difference at new token {j}: margin {float(top[0] - top[1]):.4f}, rms error {err:.4f}")
        assert float(top[0] - top[1]) <= 6 * err, "greedy tokens differ away from a tie"
