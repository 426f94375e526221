"""Launcher of kda_decode (ABI: template.cu.j2; contract: spec.py; schedule bands: variants.py).

Launches are CUDA-graph safe: the checks read tensor metadata only (no sync, no allocation), the
grid and cluster size depend on the batch size alone, and nothing is compiled after `load()`.
"""
from __future__ import annotations

import ctypes

from k3gen.config import settings
from k3gen.errors import PageIndexError, SpecError
from k3gen.ir.dtypes import SsmDtype
from k3gen.ir.layouts import CONV_TAPS, KDA_DV
from k3gen.ops.kda_decode.spec import SPLITS
from k3gen.ops.kda_decode.variants import SCHEDULE_BANDS
from k3gen.runtime import faults
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.checks import check_kda_rows, check_kda_ssm, check_kda_weights, check_one_device, check_tensor
from k3gen.runtime.loader import I32, PTR

I64 = ctypes.c_longlong
MAX_GRID_Z = 65535


def choose_split(batch: int, heads: int, sms: int, max_split: int = 8, pdl: bool = True) -> int:
    """CTAs per (sequence, head): split a head's rows over a cluster while the grid stays small
    (the largest split with pairs x split <= the band's SMs); without PDL the cluster exchange
    costs more than the shorter per-CTA chain saves sooner."""
    bound = (SCHEDULE_BANDS.split_pairs_per_sm_pdl if pdl else SCHEDULE_BANDS.split_pairs_per_sm_plain) * sms
    s = 1
    while s < max_split and batch * heads * 2 * s <= bound:
        s *= 2
    return s


SCHEDULES = ("rows", "stream")
STREAM_ENTRY = "k3gen_kda_decode_stream"


def choose_schedule(batch: int, heads: int, sms: int, aligned: bool, bf16_state: bool) -> str:
    """"stream" for BF16 state from the band's items per SM up, where the q|k|v|g rows are
    bulk-copyable; else "rows". The stream kernel's per-item rate is higher (its next state lands
    under the current item's update) but it pays a larger fixed cost (the first item's load is
    not hidden) that only many items amortize; with FP32 state the two run level."""
    aligned_bf16 = aligned and bf16_state
    return "stream" if aligned_bf16 and batch * heads >= SCHEDULE_BANDS.stream_min_items_per_sm * sms else "rows"


def choose_warming(ctas: int, resident: int, pdl: bool, warm: bool | None = None,
                   ahead: bool | None = None) -> tuple[int, int]:
    """(warm, ahead) arguments of the row kernel (kda/decode.cuh warm_cta): how many CTAs prefetch
    their own state into L2 before griddepcontrol.wait, and the CTA distance (one wave) at which
    every CTA prefetches a later CTA's state once its own loads are in flight. Same bits either way.
    Warming before the wait pays only where it runs in the previous kernel's tail (small grids,
    with PDL); warming ahead only on many waves."""
    if warm is None:
        warm = pdl and ctas <= SCHEDULE_BANDS.warm_max_waves * resident
    if ahead is None:
        ahead = ctas >= SCHEDULE_BANDS.ahead_min_waves * resident
    return (min(ctas, resident) if warm else 0), (resident if ahead else 0)


class KdaDecode(Launcher):
    _stream = None

    def load(self):
        """Idempotent (`kernel` calls it on every launch): the stream entry is set up once."""
        super().load()
        if self._stream is None:
            self.sm_count  # noqa: B018  (queried once, outside any graph capture)
            dev = self.device_index
            stream = self._kernel.sibling(STREAM_ENTRY)
            self._stream_smem = stream.read_i32(STREAM_ENTRY + "_smem", dev)
            self._stream_ctas = stream.read_i32(STREAM_ENTRY + "_ctas", dev)
            stream.set_max_dynamic_smem(self._stream_smem, dev)
            stream.prefer_max_smem(dev)
            self._stream = stream
            faults.buffer()   # allocated outside any capture (graphs keep its address)
        return self

    def split_for(self, batch: int, pdl: bool | None = None) -> int:
        pdl = settings().pdl if pdl is None else pdl
        return choose_split(batch, self.spec.heads, self.sm_count, self.spec.max_split, pdl)

    def schedule_for(self, batch: int, qkvg, conv) -> str:
        return choose_schedule(batch, self.spec.heads, self.sm_count, _bulk_aligned(qkvg, conv),
                               self.spec.ssm is SsmDtype.BF16)

    # -- checks -------------------------------------------------------------------------------
    def check(self, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w,
              out) -> tuple[int, int]:
        """Validate every tensor against the contract; return (batch, num_slots)."""
        import torch
        H, D = self.spec.heads, self.spec.d
        bf16 = torch.bfloat16
        B = slots.shape[0] if slots.dim() == 1 else -1
        check_tensor("slots", slots, torch.int32, (None,))
        check_kda_rows(H, B, qkvg, fa, beta_logit)
        num_slots = check_kda_ssm(self.spec, ssm)
        check_tensor("conv", conv, bf16, (num_slots, 3 * D, CONV_TAPS - 1))
        check_kda_weights(H, conv_w, fb_w, dt_bias, a_log, norm_w)
        check_tensor("out", out, bf16, (B, H, KDA_DV))
        check_one_device(out, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w)
        if B > MAX_GRID_Z:
            raise SpecError("batch", B, f"<= {MAX_GRID_Z}", "sequences are grid.z")
        if num_slots >= 2**31:
            raise SpecError("num_slots", num_slots, "< 2^31")
        return B, num_slots

    # -- launch -------------------------------------------------------------------------------
    def __call__(self, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w, out, *,
                 split: int | None = None, schedule: str | None = None, pdl: bool | None = None,
                 warm: bool | None = None, ahead: bool | None = None):
        """One decode step for `slots.shape[0]` sequences; returns `out`.

        qkvg [B, >= 4D] BF16 (row stride free, unit inner stride), fa [B, 128] BF16 and
        beta_logit [B, H] BF16 (views of one [f_a | b] row are fine), ssm [S, H, 128, 128]
        (spec.ssm) and conv [S, 3D, 3] BF16 updated in place at slots [B] int32 (-1:
        padded row, zeros out), weights conv_w [3D, 4] BF16, fb_w [D, 128] BF16, dt_bias [D],
        a_log [H], norm_w [128] FP32; out [B, H, 128] BF16. `split` overrides the CTAs per
        (sequence, head) (1, 2, 4, 8 up to spec.max_split); by default it depends on B only.
        `schedule` forces "rows" or "stream" (both give the same bits); by default it depends on
        B and on whether the q|k|v|g rows are 16-byte aligned (the stream kernel bulk-copies them).
        `pdl` (default: setting K3GEN_PDL, on) launches either schedule with programmatic
        dependent launch: the row schedule's weight loads (and, for one-wave grids, L2
        prefetches of its state) overlap the previous kernel's tail. `warm` and `ahead` (row
        schedule; defaults: choose_warming, overrides for measurement) prefetch state into L2
        before the PDL wait and one wave ahead: same bits.
        """
        import torch
        if split is not None and (split not in SPLITS or split > self.spec.max_split):
            raise SpecError("split", split, [s for s in SPLITS if s <= self.spec.max_split])
        if schedule is not None and schedule not in SCHEDULES:
            raise SpecError("schedule", schedule, list(SCHEDULES))
        if schedule == "stream" and split not in (None, 1):
            raise SpecError("split", split, [1], "the stream schedule runs whole heads")
        B, num_slots = self.check(qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w, out)
        if B == 0:
            return out
        if settings().validate:
            self.validate_slots(slots, num_slots, pad_only=True)
        if schedule is None:
            schedule = "rows" if split not in (None, 1) else self.schedule_for(B, qkvg, conv)
        elif schedule == "stream":
            if not _bulk_aligned(qkvg, conv):
                raise SpecError("qkvg/conv", (qkvg.data_ptr() % 16, qkvg.stride(0), conv.data_ptr() % 16),
                                "16-byte aligned bases and qkvg row stride a multiple of 8",
                                "the stream schedule bulk-copies them")
        pdl = settings().pdl if pdl is None else pdl
        if schedule == "stream":
            return self._launch_stream(qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log,
                                       norm_w, out, B, num_slots, pdl)
        if split is None:
            split = self.split_for(B, pdl)
        args = (qkvg.data_ptr(), qkvg.stride(0), fa.data_ptr(), fa.stride(0), beta_logit.data_ptr(),
                beta_logit.stride(0), slots.data_ptr(), ssm.data_ptr(), conv.data_ptr(), num_slots,
                conv_w.data_ptr(), fb_w.data_ptr(), dt_bias.data_ptr(), a_log.data_ptr(), norm_w.data_ptr(),
                out.data_ptr(), split,
                *choose_warming(split * self.spec.heads * B, self.spec.min_blocks * self.sm_count, pdl, warm, ahead),
                faults.word("kda_decode", out.device))
        types = (PTR, I64, PTR, I64, PTR, I64, PTR, PTR, PTR, I32, PTR, PTR, PTR, PTR, PTR, PTR, I32, I32, I32, PTR)
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(out.device).cuda_stream
        grid, block = (split, self.spec.heads, B), (self.spec.threads, 1, 1)
        self.kernel.launch_ex(grid, block, (split, 1, 1) if split > 1 else None, args, types, dev, stream,
                                   pdl=pdl)
        return out

    def _launch_stream(self, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w, out,
                       B: int, num_slots: int, pdl: bool):
        import torch
        self.load()
        args = (qkvg.data_ptr(), qkvg.stride(0), fa.data_ptr(), fa.stride(0), beta_logit.data_ptr(),
                beta_logit.stride(0), slots.data_ptr(), ssm.data_ptr(), conv.data_ptr(), num_slots,
                conv_w.data_ptr(), fb_w.data_ptr(), dt_bias.data_ptr(), a_log.data_ptr(), norm_w.data_ptr(),
                out.data_ptr(), B, faults.word("kda_decode", out.device))
        types = (PTR, I64, PTR, I64, PTR, I64, PTR, PTR, PTR, I32, PTR, PTR, PTR, PTR, PTR, PTR, I32, PTR)
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(out.device).cuda_stream
        grid = (min(B * self.spec.heads, self._stream_ctas * self.sm_count), 1, 1)
        self._stream.launch_ex(grid, (self.spec.threads, 1, 1), None, args, types, dev, stream,
                               smem=self._stream_smem, pdl=pdl)
        return out

    @staticmethod
    def validate_slots(slots, num_slots: int, pad_only: bool = False) -> None:
        """Host-side check (it synchronizes): live slots in range and not shared by two rows; with
        `pad_only` (kda_decode, kda_verify) -1 is the only padding slot, as their kernels' error word has it."""
        all_ = [int(x) for x in slots.cpu().tolist()]
        live = [x for x in all_ if x >= 0]
        bad = [x for x in all_ if x >= num_slots or (pad_only and x < -1)]
        if bad:
            raise PageIndexError(f"slot {bad[0]} outside [0, {num_slots})")
        if len(set(live)) != len(live):
            raise SpecError("slots", sorted(x for x in set(live) if live.count(x) > 1), "distinct live slots",
                            "two rows would update one state in place")


def _bulk_aligned(qkvg, conv) -> bool:
    return qkvg.data_ptr() % 16 == 0 and qkvg.stride(0) % 8 == 0 and conv.data_ptr() % 16 == 0
