"""`k3gen::kda_decode[_out]`, `k3gen::kda_prefill[_out]`, `k3gen::kda_verify[_out]` (contracts: the
ops' spec.py). The state pools are declared mutated: ssm and conv (decode, prefill), ssm,
draft_rec and conv_ext (verify); `pending` is read only (the host-free commit writes it).

CUDA tensors launch the generated kernel of the handle's spec; CPU tensors run the FP32 reference.
"""
from __future__ import annotations

import torch

from k3gen.ir.dtypes import SsmDtype
from k3gen.ir.layouts import CONV_TAPS, KDA_DK, KDA_DV
from k3gen.library.meta import same_device, want
from k3gen.library.table import launcher, spec_of

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
WEIGHTS = ("conv_w", "fb_w", "dt_bias", "a_log", "norm_w")


def _rows(spec, rows, qkvg, fa, beta_logit) -> None:
    H, D = spec.heads, spec.d
    want("qkvg", qkvg, BF16, (rows, None), contiguous=False, inner_unit=True)
    if qkvg.shape[1] < 4 * D:
        from k3gen.errors import SpecError
        raise SpecError("qkvg", tuple(qkvg.shape), f"[{rows}, >= {4 * D}]", "one row [q | k | v | g_out]")
    want("fa", fa, BF16, (rows, KDA_DK), contiguous=False, inner_unit=True)
    want("beta_logit", beta_logit, BF16, (rows, H), contiguous=False, inner_unit=True)


def _weights(spec, conv_w, fb_w, dt_bias, a_log, norm_w) -> None:
    H, D = spec.heads, spec.d
    want("conv_w", conv_w, BF16, (3 * D, CONV_TAPS))
    want("fb_w", fb_w, BF16, (D, KDA_DK))
    want("dt_bias", dt_bias, F32, (D,))
    want("a_log", a_log, F32, (H,))
    want("norm_w", norm_w, F32, (KDA_DV,))


def _ssm(spec, ssm):
    want("ssm", ssm, F32 if spec.ssm is SsmDtype.FP32 else BF16, (None, spec.heads, KDA_DV, KDA_DK))
    return ssm.shape[0]


def _device(named: dict) -> None:
    same_device(*[(k, v) for k, v in named.items()])


def _weights_of(w):
    from k3gen.ops.kda_decode.reference import KdaWeights
    return KdaWeights(*w)


# -- kda_decode ------------------------------------------------------------------------------------
def check_decode(spec, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w, out=None):
    want("slots", slots, I32, (None,))
    B = slots.shape[0]
    _rows(spec, B, qkvg, fa, beta_logit)
    S = _ssm(spec, ssm)
    want("conv", conv, BF16, (S, 3 * spec.d, CONV_TAPS - 1))
    _weights(spec, conv_w, fb_w, dt_bias, a_log, norm_w)
    if out is not None:
        want("out", out, BF16, (B, spec.heads, KDA_DV))
    _device(dict(qkvg=qkvg, fa=fa, beta_logit=beta_logit, ssm=ssm, conv=conv, slots=slots, conv_w=conv_w,
                 fb_w=fb_w, dt_bias=dt_bias, a_log=a_log, norm_w=norm_w, out=out))
    return B


def _decode(handle, spec, qkvg, fa, beta_logit, ssm, conv, slots, w, out) -> None:
    if out.device.type == "cuda":
        launcher(handle, "kda_decode")(qkvg, fa, beta_logit, ssm, conv, slots, *w, out)
        return
    from k3gen.ops.kda_decode.reference import kda_decode as ref
    ref(qkvg, fa, beta_logit, ssm, conv, slots, _weights_of(w), out, gate=spec.gate)


@torch.library.custom_op("k3gen::kda_decode_out", mutates_args=("ssm", "conv", "out"))
def kda_decode_out(handle: str, qkvg: torch.Tensor, fa: torch.Tensor, beta_logit: torch.Tensor, ssm: torch.Tensor,
                   conv: torch.Tensor, slots: torch.Tensor, conv_w: torch.Tensor, fb_w: torch.Tensor,
                   dt_bias: torch.Tensor, a_log: torch.Tensor, norm_w: torch.Tensor, out: torch.Tensor) -> None:
    spec = spec_of(handle, "kda_decode")
    check_decode(spec, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w, out)
    _decode(handle, spec, qkvg, fa, beta_logit, ssm, conv, slots, (conv_w, fb_w, dt_bias, a_log, norm_w), out)


@kda_decode_out.register_fake
def _(handle, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w, out):
    check_decode(spec_of(handle, "kda_decode"), qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias,
                 a_log, norm_w, out)


@torch.library.custom_op("k3gen::kda_decode", mutates_args=("ssm", "conv"))
def kda_decode(handle: str, qkvg: torch.Tensor, fa: torch.Tensor, beta_logit: torch.Tensor, ssm: torch.Tensor,
               conv: torch.Tensor, slots: torch.Tensor, conv_w: torch.Tensor, fb_w: torch.Tensor,
               dt_bias: torch.Tensor, a_log: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
    spec = spec_of(handle, "kda_decode")
    B = check_decode(spec, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w)
    out = torch.empty(B, spec.heads, KDA_DV, dtype=BF16, device=qkvg.device)
    _decode(handle, spec, qkvg, fa, beta_logit, ssm, conv, slots, (conv_w, fb_w, dt_bias, a_log, norm_w), out)
    return out


@kda_decode.register_fake
def _(handle, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w):
    spec = spec_of(handle, "kda_decode")
    B = check_decode(spec, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w)
    return qkvg.new_empty(B, spec.heads, KDA_DV, dtype=BF16)


# -- kda_prefill -----------------------------------------------------------------------------------
def check_prefill(spec, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, conv_w, fb_w, dt_bias, a_log,
                  norm_w, out=None):
    want("slots", slots, I32, (None,))
    B = slots.shape[0]
    want("cu_seqlens", cu_seqlens, I32, (B + 1,))
    want("resume", resume, I32, (B,))
    N = qkvg.shape[0] if qkvg.dim() == 2 else -1
    _rows(spec, N, qkvg, fa, beta_logit)
    S = _ssm(spec, ssm)
    want("conv", conv, BF16, (S, 3 * spec.d, CONV_TAPS - 1))
    _weights(spec, conv_w, fb_w, dt_bias, a_log, norm_w)
    if out is not None:
        want("out", out, BF16, (N, spec.heads, KDA_DV))
    _device(dict(qkvg=qkvg, fa=fa, beta_logit=beta_logit, cu_seqlens=cu_seqlens, slots=slots, resume=resume,
                 ssm=ssm, conv=conv, conv_w=conv_w, fb_w=fb_w, dt_bias=dt_bias, a_log=a_log, norm_w=norm_w, out=out))
    return N


def _prefill(handle, spec, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, w, out) -> None:
    if out.device.type == "cuda":
        launcher(handle, "kda_prefill")(qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, *w, out)
        return
    from k3gen.ops.kda_prefill.reference import kda_prefill as ref
    ref(qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, _weights_of(w), out, gate=spec.gate)


@torch.library.custom_op("k3gen::kda_prefill_out", mutates_args=("ssm", "conv", "out"))
def kda_prefill_out(handle: str, qkvg: torch.Tensor, fa: torch.Tensor, beta_logit: torch.Tensor,
                    cu_seqlens: torch.Tensor, slots: torch.Tensor, resume: torch.Tensor, ssm: torch.Tensor,
                    conv: torch.Tensor, conv_w: torch.Tensor, fb_w: torch.Tensor, dt_bias: torch.Tensor,
                    a_log: torch.Tensor, norm_w: torch.Tensor, out: torch.Tensor) -> None:
    spec = spec_of(handle, "kda_prefill")
    w = (conv_w, fb_w, dt_bias, a_log, norm_w)
    check_prefill(spec, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, *w, out)
    _prefill(handle, spec, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, w, out)


@kda_prefill_out.register_fake
def _(handle, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, conv_w, fb_w, dt_bias, a_log, norm_w, out):
    check_prefill(spec_of(handle, "kda_prefill"), qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv,
                  conv_w, fb_w, dt_bias, a_log, norm_w, out)


@torch.library.custom_op("k3gen::kda_prefill", mutates_args=("ssm", "conv"))
def kda_prefill(handle: str, qkvg: torch.Tensor, fa: torch.Tensor, beta_logit: torch.Tensor,
                cu_seqlens: torch.Tensor, slots: torch.Tensor, resume: torch.Tensor, ssm: torch.Tensor,
                conv: torch.Tensor, conv_w: torch.Tensor, fb_w: torch.Tensor, dt_bias: torch.Tensor,
                a_log: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
    spec = spec_of(handle, "kda_prefill")
    w = (conv_w, fb_w, dt_bias, a_log, norm_w)
    N = check_prefill(spec, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, *w)
    out = torch.empty(N, spec.heads, KDA_DV, dtype=BF16, device=qkvg.device)
    _prefill(handle, spec, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, w, out)
    return out


@kda_prefill.register_fake
def _(handle, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, conv_w, fb_w, dt_bias, a_log, norm_w):
    spec = spec_of(handle, "kda_prefill")
    N = check_prefill(spec, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, conv_w, fb_w, dt_bias,
                      a_log, norm_w)
    return qkvg.new_empty(N, spec.heads, KDA_DV, dtype=BF16)


# -- kda_verify ------------------------------------------------------------------------------------
def check_verify(spec, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, conv_w, fb_w, dt_bias,
                 a_log, norm_w, out=None):
    H, M, T = spec.heads, spec.drafts, spec.tokens
    want("slots", slots, I32, (None,))
    B = slots.shape[0]
    _rows(spec, B * T, qkvg, fa, beta_logit)
    S = _ssm(spec, ssm)
    want("draft_rec", draft_rec, F32, (S, M, H, KDA_DV, KDA_DK))
    want("conv_ext", conv_ext, F32, (S, 3 * spec.d, CONV_TAPS - 1 + M))
    want("pending", pending, I32, (S,))
    _weights(spec, conv_w, fb_w, dt_bias, a_log, norm_w)
    if out is not None:
        want("out", out, BF16, (B, T, H, KDA_DV))
    _device(dict(qkvg=qkvg, fa=fa, beta_logit=beta_logit, ssm=ssm, draft_rec=draft_rec, conv_ext=conv_ext,
                 pending=pending, slots=slots, conv_w=conv_w, fb_w=fb_w, dt_bias=dt_bias, a_log=a_log,
                 norm_w=norm_w, out=out))
    return B


def _verify(handle, spec, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, w, out) -> None:
    if out.device.type == "cuda":
        launcher(handle, "kda_verify")(qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, *w, out)
        return
    from k3gen.ops.kda_verify.reference import kda_verify as ref
    ref(qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, _weights_of(w), out, gate=spec.gate)


@torch.library.custom_op("k3gen::kda_verify_out", mutates_args=("ssm", "draft_rec", "conv_ext", "out"))
def kda_verify_out(handle: str, qkvg: torch.Tensor, fa: torch.Tensor, beta_logit: torch.Tensor, ssm: torch.Tensor,
                   draft_rec: torch.Tensor, conv_ext: torch.Tensor, pending: torch.Tensor, slots: torch.Tensor,
                   conv_w: torch.Tensor, fb_w: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                   norm_w: torch.Tensor, out: torch.Tensor) -> None:
    spec = spec_of(handle, "kda_verify")
    w = (conv_w, fb_w, dt_bias, a_log, norm_w)
    check_verify(spec, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, *w, out)
    _verify(handle, spec, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, w, out)


@kda_verify_out.register_fake
def _(handle, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, conv_w, fb_w, dt_bias, a_log, norm_w,
      out):
    check_verify(spec_of(handle, "kda_verify"), qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots,
                 conv_w, fb_w, dt_bias, a_log, norm_w, out)


@torch.library.custom_op("k3gen::kda_verify", mutates_args=("ssm", "draft_rec", "conv_ext"))
def kda_verify(handle: str, qkvg: torch.Tensor, fa: torch.Tensor, beta_logit: torch.Tensor, ssm: torch.Tensor,
               draft_rec: torch.Tensor, conv_ext: torch.Tensor, pending: torch.Tensor, slots: torch.Tensor,
               conv_w: torch.Tensor, fb_w: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
               norm_w: torch.Tensor) -> torch.Tensor:
    spec = spec_of(handle, "kda_verify")
    w = (conv_w, fb_w, dt_bias, a_log, norm_w)
    B = check_verify(spec, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, *w)
    out = torch.empty(B, spec.tokens, spec.heads, KDA_DV, dtype=BF16, device=qkvg.device)
    _verify(handle, spec, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, w, out)
    return out


@kda_verify.register_fake
def _(handle, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, conv_w, fb_w, dt_bias, a_log, norm_w):
    spec = spec_of(handle, "kda_verify")
    B = check_verify(spec, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, conv_w, fb_w, dt_bias,
                     a_log, norm_w)
    return qkvg.new_empty(B, spec.tokens, spec.heads, KDA_DV, dtype=BF16)
