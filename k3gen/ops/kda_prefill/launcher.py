"""Launcher of kda_prefill (ABI: template.cu.j2; contract: spec.py).

CUDA-graph safe: metadata checks only; three kernels (prep, state, emit) over a workspace sized
from (N, B, H) only, taken from torch's caching allocator on the launch stream (inside a capture:
the graph's private pool); the kernels read cu_seqlens on the device. The state pass's entries,
grids and shared memory come from the variant's plan (variants.py): chunk64 carries three (W = 2, 4,
8 warps, chosen here per launch), chunk64_tc one (grid (H, B), TMEM).
"""
from __future__ import annotations

import ctypes

from k3gen.config import settings
from k3gen.errors import SpecError
from k3gen.ir.layouts import CONV_TAPS, KDA_DV
from k3gen.ops.kda_prefill.spec import C64_STATE_WARPS
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.checks import check_kda_rows, check_kda_ssm, check_kda_weights, check_one_device, check_tensor
from k3gen.runtime.loader import I32, PTR, _check
from k3gen.ops.kda_decode.launcher import MAX_GRID_Z, KdaDecode

I64 = ctypes.c_longlong
EMIT_ENTRY = "k3gen_kda_prefill_emit"


def c64_state_warps(heads: int, batch: int, sms: int) -> int:
    """The state pass: the fewest warps per CTA (more CTAs per head, one warp per SM
    sub-partition) whose (H, B, 8 / W) grid still fits one CTA per SM; 8 when none does. The
    pass is a sequential chain per warp, so a second wave would double its time."""
    for w in C64_STATE_WARPS:
        if heads * batch * (8 // w) <= sms:
            return w
    return C64_STATE_WARPS[-1]


class KdaPrefill(Launcher):
    def __init__(self, spec):
        super().__init__(spec)
        self._smem_set: set[int] = set()
        self.state_warps: int | None = None  # chunk64's state pass: None = c64_state_warps; tests force each
        self.plan = spec.impl.plan(spec)
        self._state: dict = {}

    def load(self):
        super().load()
        if not self._state:
            self._state = {key: self._kernel.sibling(st.entry) for key, st in self.plan.states.items()}
            self._emit = self._kernel.sibling(EMIT_ENTRY)
            self._sms = self.sm_count
        self._allow_smem(self.device_index)
        return self

    def state_key(self, batch: int):
        """The state-pass entry of this launch: the plan's only one, or chunk64's warps per CTA."""
        if len(self.plan.states) == 1:
            return next(iter(self.plan.states))
        return self.state_warps or c64_state_warps(self.spec.heads, batch, self._sms)

    def _smem_needs(self) -> list:
        """(kernel, dynamic shared memory bytes) of every kernel above the 48 KB default."""
        return [(self._kernel, self.spec.smem_bytes)] + [(self._state[k], st.smem_bytes)
                                                         for k, st in self.plan.states.items()]

    def _allow_smem(self, device: int) -> None:
        """The kernels' dynamic shared memory is above the 48 KB default: raise the limit once per
        device, at load() (outside any graph capture)."""
        if device in self._smem_set:
            return
        from cuda.bindings import driver
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        for k, nbytes in self._smem_needs():
            _check(driver.cuFuncSetAttribute(k.function(device), attr, nbytes), "cuFuncSetAttribute")
        self._smem_set.add(device)

    def check(self, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, conv_w, fb_w, dt_bias, a_log,
              norm_w, out) -> tuple[int, int]:
        """Validate every tensor against the contract; return (batch, num_slots)."""
        import torch
        H, D = self.spec.heads, self.spec.d
        bf16 = torch.bfloat16
        check_tensor("slots", slots, torch.int32, (None,))
        B = slots.shape[0]
        check_tensor("cu_seqlens", cu_seqlens, torch.int32, (B + 1,))
        check_tensor("resume", resume, torch.int32, (B,))
        N = qkvg.shape[0] if qkvg.dim() == 2 else -1
        check_kda_rows(H, N, qkvg, fa, beta_logit, rows_label="N")
        S = check_kda_ssm(self.spec, ssm)
        check_tensor("conv", conv, bf16, (S, 3 * D, CONV_TAPS - 1))
        check_kda_weights(H, conv_w, fb_w, dt_bias, a_log, norm_w)
        check_tensor("out", out, bf16, (N, H, KDA_DV), align=8)
        check_one_device(out, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv,
                         conv_w, fb_w, dt_bias, a_log, norm_w)
        if B > MAX_GRID_Z:
            raise SpecError("batch", B, f"<= {MAX_GRID_Z}", "sequences are grid.y")
        if N >= 2**31 or S >= 2**31:
            raise SpecError("tokens", N, "< 2^31 tokens and slots")
        if self.spec.workspace_items(N, B) > MAX_GRID_Z:
            raise SpecError("tokens", N, f"N / 64 + B <= {MAX_GRID_Z}", f"{self.spec.algo} work items are grid.y")
        return B, S

    def __call__(self, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, conv_w, fb_w, dt_bias, a_log,
                 norm_w, out):
        """Prefill the sequences of `cu_seqlens` [B + 1] into slots [B]; resume [B] int32 non-zero
        continues from the slot's state and window. Returns `out` [N, H, 128]."""
        import torch
        B, S = self.check(qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, conv_w, fb_w, dt_bias, a_log,
                          norm_w, out)
        if B == 0:
            return out
        if settings().validate:
            KdaDecode.validate_slots(slots, S)
            cu = cu_seqlens.cpu().tolist()
            if cu[0] != 0 or cu[-1] != qkvg.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
                raise SpecError("cu_seqlens", cu[:8], f"non-decreasing from 0 to {qkvg.shape[0]}")
        args = (qkvg.data_ptr(), qkvg.stride(0), fa.data_ptr(), fa.stride(0), beta_logit.data_ptr(),
                beta_logit.stride(0), cu_seqlens.data_ptr(), slots.data_ptr(), resume.data_ptr(), ssm.data_ptr(),
                conv.data_ptr(), S, conv_w.data_ptr(), fb_w.data_ptr(), dt_bias.data_ptr(), a_log.data_ptr(),
                norm_w.data_ptr(), out.data_ptr())
        types = (PTR, I64, PTR, I64, PTR, I64, PTR, PTR, PTR, PTR, PTR, I32, PTR, PTR, PTR, PTR, PTR, PTR)
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(out.device).cuda_stream
        self.load()._allow_smem(dev)
        return self._launch_c64(qkvg.shape[0], B, args, types, dev, stream, out)

    def _launch_c64(self, N, B, args, types, dev, stream, out):
        """prep (H, J) -> state (H, B, grid z of the plan's entry) -> emit (H, J), on one stream over one
        workspace."""
        import torch
        H = self.spec.heads
        nbytes = self.spec.workspace_bytes(N, B)
        ws = torch.empty(nbytes, dtype=torch.uint8, device=out.device)
        args += (ws.data_ptr(), ws.data_ptr() + nbytes - N * H * KDA_DV * 4, B)
        types += (PTR, PTR, I32)
        items = self.spec.workspace_items(N, B)
        key = self.state_key(B)
        st = self.plan.states[key]
        self._kernel.launch((H, items, 1), (self.spec.threads, 1, 1), args, types, dev, stream, self.spec.smem_bytes)
        self._state[key].launch((H, B, st.grid_z), (st.threads, 1, 1), args, types, dev, stream, st.smem_bytes)
        self._emit.launch((H, items, 1), (self.spec.threads, 1, 1), args, types, dev, stream, 0)
        return out
