"""FP32 reference of mla_vb_gate (contract: ops/mla_vb_gate/spec.py).

Row-invariant: the products in FP64 rounded to FP32 and the sigmoid in FP64 rounded to FP32. An
FP32 einsum's reduction order, and whether torch's CPU sigmoid takes its vector or its scalar
tail loop, depend on the row count, so a verify row (B * T rows) could differ in its last bit
from the same decode row (B rows); the model's reference path needs them equal (speculative ==
greedy bit for bit, tests/nogpu/ops/test_kda_verify_lossless.py)."""
from __future__ import annotations

import torch

V_HEAD = 128


def mla_vb_gate(o_lat: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o_lat [B, H, 512], w_uv [H, 128, 512], gate [B, >= H*128] -> [B, H, 128] FP32 (not rounded)."""
    b, h, _ = o_lat.shape
    y = torch.einsum("bhc,hdc->bhd", o_lat.double(), w_uv.double()).float()
    g = gate[:, : h * V_HEAD].double().view(b, h, V_HEAD)
    return y * torch.sigmoid(g).float()
