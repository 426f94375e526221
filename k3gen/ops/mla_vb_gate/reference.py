"""FP32 reference of mla_vb_gate (contract: ops/mla_vb_gate/spec.py)."""
from __future__ import annotations

import torch

V_HEAD = 128


def mla_vb_gate(o_lat: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o_lat [B, H, 512], w_uv [H, 128, 512], gate [B, >= H*128] -> [B, H, 128] FP32 (not rounded)."""
    b, h, _ = o_lat.shape
    y = torch.einsum("bhc,hdc->bhd", o_lat.float(), w_uv.float())
    g = gate[:, : h * V_HEAD].float().view(b, h, V_HEAD)
    return y * torch.sigmoid(g)
