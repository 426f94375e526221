"""Launcher of glu_act (ABI: template.cu.j2; contract: spec.py). One launch on torch's stream, no
allocation, no host sync: graph-safe."""
from __future__ import annotations

from k3gen.config import settings
from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.glu_act.spec import MAX_ELEMENTS, THREADS
from k3gen.runtime.checks import check_one_device, check_tensor
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.loader import I32, PTR


class GluAct(Launcher):
    def __call__(self, gu, codes, scales):
        """gu [M, 2I] BF16 (contiguous) -> codes [M, I] uint8 and scales [M, I/128] (FP32, or uint8
        UE8M0 bytes), written in place; returns (codes, scales)."""
        import torch
        s = self.spec
        M = gu.shape[0] if gu.dim() == 2 else -1
        check_tensor("gu", gu, torch.bfloat16, (M, 2 * s.inter), align=16)
        check_tensor("codes", codes, torch.uint8, (M, s.inter), align=16)
        sdt = torch.float32 if s.recipe is ScaleRecipe.FP32 else torch.uint8
        check_tensor("scales", scales, sdt, (M, s.groups))
        if M * s.inter >= MAX_ELEMENTS:
            raise SpecError("gu", tuple(gu.shape), f"M * {s.inter} < 2^31", "32-bit group indices")
        check_one_device(gu, codes, scales)
        if M == 0:
            return codes, scales
        dev = gu.device.index if gu.device.index is not None else torch.cuda.current_device()
        self.kernel.launch_ex(s.grid(M), (THREADS, 1, 1), None,
                              (gu.data_ptr(), codes.data_ptr(), scales.data_ptr(), M), (PTR, PTR, PTR, I32), dev,
                              torch.cuda.current_stream(gu.device).cuda_stream, pdl=settings().pdl)
        return codes, scales
