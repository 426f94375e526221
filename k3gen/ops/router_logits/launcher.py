"""Launcher of router_logits (ABI: template.cu.j2; contract: spec.py). One launch on torch's stream, no
allocation, no host sync: graph-safe."""
from __future__ import annotations

from k3gen.config import settings
from k3gen.errors import SpecError
from k3gen.ops.router_logits.spec import MAX_ELEMENTS, THREADS, RouterWeight
from k3gen.runtime.checks import check_one_device, check_tensor
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.loader import I32, PTR


class RouterLogits(Launcher):
    def __call__(self, x, w, out):
        """x [M, H] BF16, w [E, H] BF16 or FP32 (the spec's `weight`; contiguous) -> out [M, E] FP32,
        written in place; returns out."""
        import torch
        s = self.spec
        M = x.shape[0] if x.dim() == 2 else -1
        check_tensor("x", x, torch.bfloat16, (M, s.hidden), align=16)
        wdt = torch.bfloat16 if s.weight is RouterWeight.BF16 else torch.float32
        check_tensor("w", w, wdt, (s.experts, s.hidden), align=16)
        check_tensor("out", out, torch.float32, (M, s.experts))
        if M * s.experts >= MAX_ELEMENTS:
            raise SpecError("x", tuple(x.shape), f"M * {s.experts} < 2^31", "32-bit output indices")
        check_one_device(x, w, out)
        if M == 0:
            return out
        dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
        self.kernel.launch_ex(s.grid(M), (THREADS, 1, 1), None,
                              (x.data_ptr(), w.data_ptr(), out.data_ptr(), M), (PTR, PTR, PTR, I32), dev,
                              torch.cuda.current_stream(x.device).cuda_stream, pdl=settings().pdl)
        return out
