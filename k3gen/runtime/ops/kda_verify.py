"""Launcher of kda_verify (ABI: templates/kda_verify.cu.j2; contract: ir/ops/kda_verify.py).

CUDA-graph safe like kda_decode: metadata checks only, grid from the batch size, no allocation.
`commit` (k3gen.reference.kda_verify.commit) is the host step after sampling.
"""
from __future__ import annotations

import ctypes

from ...config import settings
from ...errors import SpecError
from ...ir.dtypes import SsmDtype
from ...ir.layouts import CONV_TAPS, KDA_DK, KDA_DV
from ..bind import Launcher
from ..checks import check_kda_weights, check_one_device, check_tensor
from ..loader import I32, PTR
from .kda_decode import MAX_GRID_Z, KdaDecode

I64 = ctypes.c_longlong


class KdaVerify(Launcher):

    def check(self, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, conv_w, fb_w, dt_bias, a_log,
              norm_w, out) -> tuple[int, int]:
        """Validate every tensor against the contract; return (batch, num_slots)."""
        import torch
        H, D, M, T = self.spec.heads, self.spec.d, self.spec.drafts, self.spec.tokens
        bf16 = torch.bfloat16
        check_tensor("slots", slots, torch.int32, (None,))
        B = slots.shape[0]
        check_tensor("qkvg", qkvg, bf16, (B * T, None), contiguous=False, inner_unit=True)
        if qkvg.shape[1] < 4 * D:
            raise SpecError("qkvg", tuple(qkvg.shape), f"[{B * T}, >= {4 * D}]", "one row [q | k | v | g_out]")
        check_tensor("fa", fa, bf16, (B * T, KDA_DK), contiguous=False, inner_unit=True)
        check_tensor("beta_logit", beta_logit, bf16, (B * T, H), contiguous=False, inner_unit=True)
        sdt = torch.float32 if self.spec.ssm is SsmDtype.FP32 else bf16
        check_tensor("ssm", ssm, sdt, (None, H, KDA_DV, KDA_DK), align=16)
        S = ssm.shape[0]
        check_tensor("draft_rec", draft_rec, torch.float32, (S, M, H, KDA_DV, KDA_DK), align=16)
        check_tensor("conv_ext", conv_ext, torch.float32, (S, 3 * D, CONV_TAPS - 1 + M))
        check_tensor("pending", pending, torch.int32, (S,))
        check_kda_weights(H, conv_w, fb_w, dt_bias, a_log, norm_w)
        check_tensor("out", out, bf16, (B, T, H, KDA_DV), align=8)
        check_one_device(out, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots,
                         conv_w, fb_w, dt_bias, a_log, norm_w)
        if B > MAX_GRID_Z:
            raise SpecError("batch", B, f"<= {MAX_GRID_Z}", "sequences are grid.y")
        if S >= 2**31:
            raise SpecError("num_slots", S, "< 2^31")
        return B, S

    def __call__(self, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, conv_w, fb_w, dt_bias,
                 a_log, norm_w, out):
        """One verify step of 1 + M tokens for `slots.shape[0]` sequences; returns `out`
        [B, 1 + M, H, 128]. Token t of sequence b is row b * (1 + M) + t of qkvg / fa / beta_logit."""
        import torch
        B, S = self.check(qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, conv_w, fb_w, dt_bias,
                          a_log, norm_w, out)
        if B == 0:
            return out
        if settings().validate:
            KdaDecode.validate_slots(slots, S)
            bad = [p for p in pending.cpu().tolist() if not 0 <= p <= self.spec.drafts]
            if bad:
                raise SpecError("pending", bad[0], f"0..{self.spec.drafts}")
        args = (qkvg.data_ptr(), qkvg.stride(0), fa.data_ptr(), fa.stride(0), beta_logit.data_ptr(),
                beta_logit.stride(0), slots.data_ptr(), pending.data_ptr(), ssm.data_ptr(), draft_rec.data_ptr(),
                conv_ext.data_ptr(), S, conv_w.data_ptr(), fb_w.data_ptr(), dt_bias.data_ptr(), a_log.data_ptr(),
                norm_w.data_ptr(), out.data_ptr())
        types = (PTR, I64, PTR, I64, PTR, I64, PTR, PTR, PTR, PTR, PTR, I32, PTR, PTR, PTR, PTR, PTR, PTR)
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(out.device).cuda_stream
        self.kernel.launch((self.spec.heads, B, 1), (self.spec.threads, 1, 1), args, types, dev, stream)
        return out
