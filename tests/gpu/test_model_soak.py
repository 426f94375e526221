"""model/soak.py on the kernel path (issue 27): the small config on the H200, the same properties as
tests/nogpu/modeling/test_soak.py (accounting after every step, reproducible, a NaN request isolated:
here through the generated kernels, moe_route and moe_experts on its NaN rows included).
`python tools/soak.py --config small --path kernel --device cuda --steps 2500` is the long run."""
from __future__ import annotations

import pytest

from model.generate import build_model
from model.soak import soak

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv,ssm", [("nvfp4", "bf16"), ("bf16", "fp32")])
def test_soak_kernel_path(kv, ssm):
    m = build_model("small", "sm90", kv, ssm, 3, "kernel", None, 0, "cuda", 256, 8)
    clean = soak(m, 200, 0)
    again = soak(m, 200, 0)
    poisoned = soak(m, 200, 0, poison_first=True)
    print(f"\n[{kv} KV, {ssm} SSM] {clean.steps} steps ({clean.verify_steps} verify), {clean.row_steps} "
          f"sequence-steps, {clean.admitted} admitted, up to {clean.max_live} live")
    assert clean.tokens == again.tokens
    assert poisoned.victim_nonfinite
    others = [i for i in clean.tokens if i != poisoned.victim]
    assert all(poisoned.tokens[i] == clean.tokens[i] for i in others), \
        [i for i in others if poisoned.tokens[i] != clean.tokens[i]]
