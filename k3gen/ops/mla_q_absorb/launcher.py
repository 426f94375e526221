"""Launcher of mla_q_absorb (ABI: template.cu.j2; contract: spec.py).

First version: three launches on torch's stream (norm + quantize, the Q-B fp8_block_gemm, absorb).
Intermediates live in a caller-owned workspace (`workspace(max_batch)`), so a call allocates
nothing and can be captured in a CUDA graph.
"""
from __future__ import annotations

import ctypes

from k3gen.errors import SpecError
from k3gen.ops.mla_q_absorb.spec import BATCH_TILE, NOPE, OUT_HEAD, Q_LORA, QK_HEAD
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.loader import I32, PTR, CudaKernel
from k3gen.runtime.checks import check_one_device, check_tensor
from k3gen.ops.fp8_block_gemm.launcher import Fp8BlockGemm, scale_torch_dtype
from k3gen.ops.mla_vb_gate.launcher import check_head_weights

I64 = ctypes.c_longlong
NORM_THREADS = Q_LORA // 8
ABSORB_THREADS = 256


class MlaQAbsorb(Launcher):
    def __init__(self, spec):
        super().__init__(spec)
        self.gemm = Fp8BlockGemm(spec.gemm_spec)
        self._norm = None

    def load(self):
        if self._kernel is None:
            from k3gen.runtime.resolve import resolve
            cubin, self.meta = resolve(self.spec)
            self._kernel = CudaKernel(cubin, self.meta["entry"])
            self._norm = CudaKernel(cubin, "k3gen_mla_q_norm_quant")
        self.gemm.load()
        return self

    def workspace(self, max_batch: int, device="cuda") -> dict:
        """Buffers for up to max_batch tokens: FP8 codes + scales of the normed q_a, and q."""
        import torch
        s = self.spec
        return {"codes": torch.empty(max_batch, Q_LORA, dtype=torch.uint8, device=device),
                "scales": torch.empty(max_batch, s.k_blocks, dtype=scale_torch_dtype(s.recipe), device=device),
                "q": torch.empty(max_batch, s.heads * QK_HEAD, dtype=torch.bfloat16, device=device)}

    def __call__(self, q_a, norm_w, wqb_codes, wqb_scales, w_uk, out, *, workspace: dict):
        """q_a [B, >= 1536] BF16 (unit inner stride, 16-byte aligned rows), norm_w [1536] BF16,
        Q-B codes/scales (fp8_block_gemm layout, this spec's recipe), w_uk [H, 128, 512] BF16,
        out [B, H, 576] BF16. Returns out."""
        import torch
        H = self.spec.heads
        b = q_a.shape[0] if q_a.dim() == 2 else -1
        if q_a.dtype != torch.bfloat16 or q_a.dim() != 2 or q_a.shape[1] < Q_LORA or q_a.stride(1) != 1 \
                or q_a.stride(0) % 8 or q_a.data_ptr() % 16:
            raise SpecError("q_a", (tuple(q_a.shape), str(q_a.dtype)),
                            [f"bf16 [B, >= {Q_LORA}], unit inner stride, 16-byte aligned rows"])
        check_tensor("norm_w", norm_w, torch.bfloat16, (Q_LORA,), align=16)
        check_head_weights("w_uk", w_uk, H, NOPE)
        check_tensor("out", out, torch.bfloat16, (b, H, OUT_HEAD))
        if not isinstance(workspace, dict) or any(k not in workspace for k in ("codes", "scales", "q")):
            raise SpecError("workspace", sorted(workspace) if isinstance(workspace, dict) else type(workspace).__name__,
                            ["codes", "scales", "q"], "from workspace(max_batch)")
        if any(workspace[k].dim() < 1 or workspace[k].shape[0] < b for k in ("codes", "scales", "q")):
            raise SpecError("workspace", {k: tuple(v.shape) for k, v in workspace.items()}, f">= {b} rows")
        ws = {k: workspace[k][:b] for k in ("codes", "scales", "q")}
        # Named here: the GEMM's own check would call them x_codes / x_scales / out / w_codes / w_scales.
        g = self.gemm.spec
        check_tensor("wqb_codes", wqb_codes, torch.uint8, (g.n, g.k), align=16)
        check_tensor("wqb_scales", wqb_scales, scale_torch_dtype(g.recipe), (g.n_blocks, g.k_blocks))
        check_tensor("workspace['codes']", ws["codes"], torch.uint8, (b, Q_LORA), align=16)
        check_tensor("workspace['scales']", ws["scales"], scale_torch_dtype(self.spec.recipe), (b, self.spec.k_blocks))
        check_tensor("workspace['q']", ws["q"], torch.bfloat16, (b, H * QK_HEAD), align=16)
        self.gemm.check(ws["codes"], ws["scales"], wqb_codes, wqb_scales, ws["q"])
        check_one_device(out, q_a, norm_w, w_uk, ws["codes"])
        if b == 0:
            return out
        if -(-b // BATCH_TILE) > 65535:
            raise SpecError("B", b, f"<= {65535 * BATCH_TILE}", "grid.y")
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(out.device).cuda_stream
        self.load()
        self._norm.launch((b, 1, 1), (NORM_THREADS, 1, 1),
                          (q_a.data_ptr(), q_a.stride(0), norm_w.data_ptr(), ws["codes"].data_ptr(),
                           ws["scales"].data_ptr()), (PTR, I64, PTR, PTR, PTR), dev, stream)
        self.gemm(ws["codes"], ws["scales"], wqb_codes, wqb_scales, ws["q"])
        self.kernel.launch((H, -(-b // BATCH_TILE), 1), (ABSORB_THREADS, 1, 1),
                           (ws["q"].data_ptr(), w_uk.data_ptr(), w_uk.stride(0), out.data_ptr(), b),
                           (PTR, PTR, I64, PTR, I32), dev, stream)
        return out
