"""Launcher of kda_verify (ABI: template.cu.j2; contract: spec.py; schedule bands: variants.py).

CUDA-graph safe like kda_decode: metadata checks only, grid from the batch size, no allocation.
`commit` (k3gen.ops.kda_verify.reference.commit) is the host step after sampling.
"""
from __future__ import annotations

import ctypes

from k3gen.config import settings
from k3gen.errors import SpecError
from k3gen.ir.layouts import CONV_TAPS, KDA_DK, KDA_DV
from k3gen.ops.kda_verify.variants import PERSISTENT_MAX_DRAFTS, SCHEDULE_BANDS, SCHEDULES
from k3gen.runtime import faults
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.checks import check_kda_rows, check_kda_ssm, check_kda_weights, check_one_device, check_tensor
from k3gen.runtime.loader import I32, PTR
from k3gen.ops.kda_decode.launcher import MAX_GRID_Z, KdaDecode

I64 = ctypes.c_longlong

PREFETCH_ENTRY = "k3gen_kda_verify_prefetch"
SPLIT_ENTRY = "k3gen_kda_verify_split"
SPLIT_PER_SM = (2, 3, 4)  # CTAs per SM the split schedule may be launched with (its occupancy is 4)
# Dynamic shared memory that leaves room for one prefetch CTA per SM (2 x (116 + 1) KB > 228 KB):
# with a grid of at most one CTA per SM the block scheduler otherwise packs two CTAs onto some SMs
# and leaves others idle.
SPREAD_SMEM = 116 * 1024


def has_prefetch(spec) -> bool:
    """Whether the cubin carries the prefetch and split schedules (variants.VerifyKernel.schedules)."""
    return "prefetch" in spec.impl.schedules(spec)


def split_clusters(batch: int, heads: int, sms: int, per_sm: int) -> int:
    """Persistent 2-CTA clusters of the split schedule: per_sm CTAs per SM, at most one cluster per
    (head, sequence) item."""
    return max(1, min(batch * heads, per_sm * sms // 2))


def choose_schedule(batch: int, heads: int, sms: int, available: bool) -> str:
    """The fastest schedule measured at this many (head, sequence) items per SM (SCHEDULE_BANDS);
    the row kernel where the cubin has no other (M > 3, or the original variant)."""
    if not available:
        return "rows"
    items = batch * heads
    return next(name for bound, name in SCHEDULE_BANDS if items <= bound * sms)


class KdaVerify(Launcher):
    _prefetch = None

    def load(self):
        """Also loads the prefetch entry once (the `kernel` property calls load() on every launch,
        and the shared-memory constant is read with a synchronous copy, never inside a capture)."""
        super().load()
        if self._prefetch is None and has_prefetch(self.spec):
            self.sm_count  # noqa: B018  (queried once, outside any graph capture)
            dev = self.device_index
            self._prefetch = self._kernel.sibling(PREFETCH_ENTRY)
            self._prefetch_smem = self._prefetch.read_i32(PREFETCH_ENTRY + "_smem", dev)
            self._prefetch.set_max_dynamic_smem(max(self._prefetch_smem, SPREAD_SMEM), dev)
            self._prefetch.prefer_max_smem(dev)
            self._split = self._kernel.sibling(SPLIT_ENTRY)
            self._split_smem = self._split.read_i32(SPLIT_ENTRY + "_smem", dev)
            self._split.set_max_dynamic_smem(self._split_smem, dev)
            self._split.prefer_max_smem(dev)
        if not self.spec.target.frozen:
            faults.buffer()   # allocated outside any capture (graphs keep its address)
        return self

    def schedule_for(self, batch: int) -> str:
        return choose_schedule(batch, self.spec.heads, self.sm_count, has_prefetch(self.spec))

    def check(self, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, conv_w, fb_w, dt_bias, a_log,
              norm_w, out) -> tuple[int, int]:
        """Validate every tensor against the contract; return (batch, num_slots)."""
        import torch
        H, D, M, T = self.spec.heads, self.spec.d, self.spec.drafts, self.spec.tokens
        bf16 = torch.bfloat16
        check_tensor("slots", slots, torch.int32, (None,))
        B = slots.shape[0]
        check_kda_rows(H, B * T, qkvg, fa, beta_logit)
        S = check_kda_ssm(self.spec, ssm)
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
                 a_log, norm_w, out, *, schedule: str | None = None, pdl: bool | None = None,
                 warm: bool | None = None, per_sm: int | None = None):
        """One verify step of 1 + M tokens for `slots.shape[0]` sequences; returns `out`
        [B, 1 + M, H, 128]. Token t of sequence b is row b * (1 + M) + t of qkvg / fa / beta_logit.
        `schedule` forces "rows", "prefetch" or "split" (the last two: NVFP4 variant, M <= 3; all
        three give the same bits); by default it depends on B only (choose_schedule). The split
        schedule runs each item's 128 state rows on the two CTAs of a cluster, `per_sm` (2..4,
        default 4) CTAs per SM. The prefetch schedule runs one CTA per SM when its grid fits one
        wave (SPREAD_SMEM) and launches with programmatic dependent launch when `pdl` (default:
        setting K3GEN_PDL, on); then, unless `warm` is False, each CTA warms L2 with its first item
        before its griddepcontrol.wait. The split schedule also honours `pdl`; the row schedule
        (shared with the frozen original kernel) launches plainly."""
        import torch
        if schedule is not None and schedule not in SCHEDULES:
            raise SpecError("schedule", schedule, list(SCHEDULES))
        if schedule in ("prefetch", "split") and not has_prefetch(self.spec):
            raise SpecError("schedule", schedule, ["rows"],
                            f"the {schedule} kernel needs variant nvfp4 and M <= {PERSISTENT_MAX_DRAFTS}")
        if per_sm is not None and per_sm not in SPLIT_PER_SM:
            raise SpecError("per_sm", per_sm, list(SPLIT_PER_SM), "CTAs per SM of the split schedule")
        B, S = self.check(qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, conv_w, fb_w, dt_bias,
                          a_log, norm_w, out)
        if B == 0:
            return out
        if settings().validate:
            KdaDecode.validate_slots(slots, S, pad_only=True)
            bad = [p for p in pending.cpu().tolist() if not 0 <= p <= self.spec.drafts]
            if bad:
                raise SpecError("pending", bad[0], f"0..{self.spec.drafts}")
        args = (qkvg.data_ptr(), qkvg.stride(0), fa.data_ptr(), fa.stride(0), beta_logit.data_ptr(),
                beta_logit.stride(0), slots.data_ptr(), pending.data_ptr(), ssm.data_ptr(), draft_rec.data_ptr(),
                conv_ext.data_ptr(), S, conv_w.data_ptr(), fb_w.data_ptr(), dt_bias.data_ptr(), a_log.data_ptr(),
                norm_w.data_ptr(), out.data_ptr())
        types = (PTR, I64, PTR, I64, PTR, I64, PTR, PTR, PTR, PTR, PTR, I32, PTR, PTR, PTR, PTR, PTR, PTR)
        err = () if self.spec.target.frozen else (faults.word("kda_verify", out.device),)   # frozen: no word
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(out.device).cuda_stream
        if schedule is None:
            schedule = self.schedule_for(B)
        if schedule == "prefetch":
            self.load()
            grid = (min(B * self.spec.heads, 2 * self.sm_count), 1, 1)
            smem = max(self._prefetch_smem, SPREAD_SMEM) if grid[0] <= self.sm_count else self._prefetch_smem
            pdl = settings().pdl if pdl is None else pdl
            warm = pdl if warm is None else warm
            self._prefetch.launch_ex(grid, (self.spec.threads, 1, 1), None, args + (B, int(warm)) + err,
                                     types + (I32, I32) + (PTR,) * len(err), dev, stream, smem=smem, pdl=pdl)
            return out
        if schedule == "split":
            if B * self.spec.heads >= 2**31:
                raise SpecError("batch", B, f"< 2^31 / {self.spec.heads}", "the split kernel counts items in 32 bits")
            self.load()
            n_cl = split_clusters(B, self.spec.heads, self.sm_count, per_sm or SPLIT_PER_SM[-1])
            pdl = settings().pdl if pdl is None else pdl
            self._split.launch_ex((2 * n_cl, 1, 1), (128, 1, 1), (2, 1, 1), args + (B,) + err,
                                  types + (I32,) + (PTR,) * len(err), dev,
                                  stream, smem=self._split_smem, pdl=pdl)
            return out
        self.kernel.launch((self.spec.heads, B, 1), (self.spec.threads, 1, 1), args + err,
                           types + (PTR,) * len(err), dev, stream)
        return out
