"""model/soak.py on the kernel path (issue 27): the small config on the H200, the same properties as
tests/nogpu/modeling/test_soak.py (accounting after every step, reproducible, a NaN request isolated:
here through the generated kernels, moe_route and moe_experts on its NaN rows included), eager and
on CUDA graphs (the padded rows of a replay use the cache's padding slot: they must not touch a
request's pages or state). `python tools/soak.py --path kernel --device cuda --graphs --steps 20000`
is the long run."""
from __future__ import annotations

import pytest

from model.generate import Generator, build_model
from model.soak import soak

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kv,ssm", [("nvfp4", "bf16"), ("bf16", "fp32")])
def test_soak_kernel_path(kv, ssm, graphs):
    m = build_model("small", "sm90", kv, ssm, 3, "kernel", None, 0, "cuda", 256, 8,
                    graph_batch_sizes=(1, 2, 4, 8) if graphs else None)
    core = Generator(m, graphs=True).step if graphs else None
    clean = soak(m, 200, 0, core=core)
    again = soak(m, 200, 0, core=core)
    poisoned = soak(m, 200, 0, poison_first=True, core=core)
    print(f"\n[{kv} KV, {ssm} SSM, {'graphs' if graphs else 'eager'}] {clean.steps} steps ({clean.verify_steps} "
          f"verify), {clean.row_steps} sequence-steps, {clean.admitted} admitted, up to {clean.max_live} live")
    assert clean.tokens == again.tokens
    assert poisoned.victim_nonfinite
    others = [i for i in clean.tokens if i != poisoned.victim]
    assert all(poisoned.tokens[i] == clean.tokens[i] for i in others), \
        [i for i in others if poisoned.tokens[i] != clean.tokens[i]]
