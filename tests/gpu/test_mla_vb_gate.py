"""mla_vb_gate on the H200 against the FP32 reference: B in {1, 2, 7, 8, 33, 128}, W_UV as a view of
kv_b (head stride 256 rows), the gate as a slice of a wider A-projection row, graph replay."""
from __future__ import annotations

import pytest
import torch

from k3gen.ops.mla_vb_gate.spec import MlaVbGateSpec
from k3gen.ops.mla_vb_gate.reference import mla_vb_gate
from k3gen.runtime.graphs import capture
from k3gen.ops.mla_vb_gate.launcher import MlaVbGate
from k3gen.targets import TARGETS
from numerics import rel_rms

pytestmark = pytest.mark.gpu
SPECS = {h: MlaVbGateSpec(target=TARGETS["sm90"], heads=h) for h in (12, 96)}


def _inputs(B, H, seed):
    g = torch.Generator().manual_seed(seed)
    o_lat = torch.randn(B, H, 512, generator=g).to(torch.bfloat16).cuda()
    kv_b = (torch.randn(H * 256, 512, generator=g) * 0.05).to(torch.bfloat16).cuda()
    w_uv = kv_b.view(H, 256, 512)[:, 128:]
    row = torch.randn(B, 1536 + 512 + 64 + H * 128, generator=g).to(torch.bfloat16).cuda()
    gate = row[:, 1536 + 512 + 64:]
    return o_lat, w_uv, gate


@pytest.mark.parametrize("H", [12, 96])
@pytest.mark.parametrize("B", [1, 2, 7, 8, 33, 128])
def test_matches_reference(B, H):
    op = MlaVbGate(SPECS[H]).load()
    o_lat, w_uv, gate = _inputs(B, H, seed=B * 100 + H)
    out = torch.full((B, H, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    op(o_lat, w_uv, gate, out)
    torch.cuda.synchronize()
    ref = mla_vb_gate(o_lat.cpu(), w_uv.cpu(), gate.cpu())
    assert not torch.isnan(out).any()
    assert rel_rms(out.cpu(), ref) <= 1e-2


def test_graph_replay_and_sanitize_small():
    op = MlaVbGate(SPECS[12]).load()
    o_lat, w_uv, gate = _inputs(3, 12, seed=1)
    out = torch.full((3, 12, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    op(o_lat, w_uv, gate, out)
    torch.cuda.synchronize()
    eager = out.clone()
    graph = capture(lambda: op(o_lat, w_uv, gate, out))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
