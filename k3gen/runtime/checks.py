"""Host-side argument checks shared by the launchers: metadata only (no sync, no allocation)."""
from __future__ import annotations

from k3gen.errors import SpecError


def check_tensor(name, t, dtype, shape, *, contiguous=True, inner_unit=False, align=0) -> None:
    """Raise SpecError unless `t` is a `dtype` tensor of `shape` (entries: int, or None for any),
    contiguous (or, with contiguous=False and inner_unit=True, of unit inner stride), and with a
    data pointer aligned to `align` bytes."""
    ok = t.dtype == dtype and t.dim() == len(shape) and all(
        want is None or got == want for got, want in zip(t.shape, shape))
    if ok and contiguous:
        ok = t.is_contiguous()
    if ok and inner_unit:
        ok = t.stride(-1) == 1
    if ok and align:
        ok = t.data_ptr() % align == 0
    if not ok:
        layout = "contiguous" if contiguous else "unit inner stride" if inner_unit else ""
        want = f"{str(dtype).replace('torch.', '')} {list('*' if s is None else s for s in shape)}"
        raise SpecError(name, (tuple(t.shape), str(t.dtype).replace("torch.", "")),
                        [want], ", ".join(x for x in (layout, f"{align}-byte aligned" if align else "") if x))


def check_kda_weights(heads: int, conv_w, fb_w, dt_bias, a_log, norm_w) -> None:
    """The per-layer KDA weights every KDA kernel reads (conv taps, f_b, dt_bias, A_log, norm)."""
    import torch

    from k3gen.ir.layouts import CONV_TAPS, KDA_DK, KDA_DV
    D = heads * KDA_DK
    check_tensor("conv_w", conv_w, torch.bfloat16, (3 * D, CONV_TAPS), align=8)
    check_tensor("fb_w", fb_w, torch.bfloat16, (D, KDA_DK), align=16)
    check_tensor("dt_bias", dt_bias, torch.float32, (D,), align=16)
    check_tensor("a_log", a_log, torch.float32, (heads,))
    check_tensor("norm_w", norm_w, torch.float32, (KDA_DV,))


def check_one_device(out, *tensors) -> None:
    dev = out.device
    if dev.type != "cuda" or any(t.device != dev for t in tensors):
        raise SpecError("device", str(dev), "one CUDA device for every tensor")
