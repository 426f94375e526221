"""Launcher of mla_vb_gate (ABI: template.cu.j2; contract: spec.py)."""
from __future__ import annotations

import ctypes

from k3gen.errors import SpecError
from k3gen.ir.layouts import MLA_LATENT
from k3gen.ops.mla_vb_gate.spec import THREADS, V_HEAD
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.loader import I32, PTR
from k3gen.runtime.checks import check_one_device, check_tensor

I64 = ctypes.c_longlong


def check_head_weights(name, w, heads: int, rows: int) -> None:
    """[H, rows, 512] BF16 with unit inner strides (any head stride, 16-byte aligned rows)."""
    import torch
    ok = (w.dtype == torch.bfloat16 and w.dim() == 3 and tuple(w.shape) == (heads, rows, MLA_LATENT)
          and w.stride(2) == 1 and w.stride(1) == MLA_LATENT and w.stride(0) % 8 == 0 and w.data_ptr() % 16 == 0)
    if not ok:
        raise SpecError(name, (tuple(w.shape), str(w.dtype).replace("torch.", "")),
                        [f"bf16 [{heads}, {rows}, {MLA_LATENT}], rows contiguous, 16-byte aligned"])


class MlaVbGate(Launcher):
    def __call__(self, o_lat, w_uv, gate, out):
        """out[B, H, 128] = (o_lat[B, H, 512] @ w_uv[h]^T) * sigmoid(gate[B, h*128 + d]); returns out."""
        import torch
        H = self.spec.heads
        b = o_lat.shape[0] if o_lat.dim() == 3 else -1
        check_tensor("o_lat", o_lat, torch.bfloat16, (b, H, MLA_LATENT), align=16)
        check_head_weights("w_uv", w_uv, H, V_HEAD)
        if gate.dtype != torch.bfloat16 or gate.dim() != 2 or gate.shape[0] != b or gate.shape[1] < H * V_HEAD \
                or gate.stride(1) != 1:
            raise SpecError("gate", (tuple(gate.shape), str(gate.dtype)), [f"bf16 [{b}, >= {H * V_HEAD}], unit inner stride"])
        check_tensor("out", out, torch.bfloat16, (b, H, V_HEAD))
        check_one_device(out, o_lat, w_uv, gate)
        if b == 0:
            return out
        if -(-b // 8) > 65535:
            raise SpecError("B", b, "<= 524280", "grid.y")
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        args = (o_lat.data_ptr(), w_uv.data_ptr(), w_uv.stride(0), gate.data_ptr(), gate.stride(0), out.data_ptr(), b)
        types = (PTR, PTR, I64, PTR, I64, PTR, I32)
        self.kernel.launch(self.spec.grid(b), (THREADS, 1, 1), args, types, dev,
                           torch.cuda.current_stream(out.device).cuda_stream)
        return out
