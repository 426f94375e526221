"""Launcher of act_quant_fp8 (CuTe DSL cubin; ABI recorded at build time)."""
from __future__ import annotations

from k3gen.errors import SpecError
from k3gen.ops.act_quant_fp8.spec import MAX_ELEMENTS
from k3gen.runtime.launcher import Launcher


class ActQuantFp8(Launcher):
    def load(self):
        if self._kernel is None:
            from k3gen.runtime.resolve import resolve
            from k3gen.runtime.cute_launch import load_cute_kernel
            cubin, self.meta = resolve(self.spec)
            self._kernel = load_cute_kernel(cubin, self.meta).load()
        return self

    def __call__(self, x, codes, scales) -> None:
        """x[M, K] BF16 -> codes[M, K] E4M3 (uint8), scales[M, K/128] (FP32, or UE8M0 bytes)."""
        m = x.shape[0] if x.dim() == 2 else -1
        if x.dim() != 2 or x.shape[1] != self.spec.k:
            raise SpecError("x.shape", tuple(x.shape), f"[M, {self.spec.k}]")
        if m * self.spec.k >= MAX_ELEMENTS:
            raise SpecError("M", m, f"M * {self.spec.k} < 2^31", "32-bit index math")
        self.kernel.launch(self.spec.grid(m), x, codes, scales)
