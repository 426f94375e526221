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
        # A size-1 inner dim is read at offset 0 whatever its stride (FLA's beta [B, T, 1] views).
        ok = t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1
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


def check_kda_rows(heads: int, rows, qkvg, fa, beta_logit, rows_label=None) -> None:
    """The per-token activation rows of a KDA kernel: `rows` rows each (None: any), any row
    stride, unit inner stride; `rows_label` names the row count in the qkvg message (default: rows)."""
    import torch

    from k3gen.ir.layouts import KDA_DK
    D = heads * KDA_DK
    check_tensor("qkvg", qkvg, torch.bfloat16, (rows, None), contiguous=False, inner_unit=True)
    if qkvg.shape[1] < 4 * D:
        raise SpecError("qkvg", tuple(qkvg.shape), f"[{rows if rows_label is None else rows_label}, >= {4 * D}]",
                        "one row [q | k | v | g_out]")
    check_tensor("fa", fa, torch.bfloat16, (rows, KDA_DK), contiguous=False, inner_unit=True)
    check_tensor("beta_logit", beta_logit, torch.bfloat16, (rows, heads), contiguous=False, inner_unit=True)


def check_kda_ssm(spec, ssm) -> int:
    """The SSM state pool [num_slots, H, 128, 128] in the spec's storage dtype; returns num_slots."""
    import torch

    from k3gen.ir.dtypes import SsmDtype
    from k3gen.ir.layouts import KDA_DK, KDA_DV
    sdt = torch.float32 if spec.ssm is SsmDtype.FP32 else torch.bfloat16
    check_tensor("ssm", ssm, sdt, (None, spec.heads, KDA_DV, KDA_DK), align=16)
    return ssm.shape[0]


_TORCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "e4m3": "uint8", "e2m1": "uint8", "int32": "int32"}


def kv_cache_wants(layout, cache: dict) -> tuple[int, int, dict]:
    """(num_pages, num_slots, {name: (torch dtype, shape)}) of the tensors a KvLayout's cache holds,
    its sizes read from `cache`, which must name every one of them."""
    import torch
    specs = layout.tensors()
    missing = set(specs) - set(cache)
    if missing:
        raise SpecError("cache", sorted(cache), sorted(specs), f"missing {sorted(missing)}")
    num_pages = cache[next(iter(specs))].shape[0]
    num_slots = cache["hp_tail"].shape[0] if "hp_tail" in specs else 1
    wants = {name: (getattr(torch, _TORCH_DTYPES[ts.dtype.name]),
                    ts.concrete_shape(num_pages=num_pages, num_slots=num_slots)) for name, ts in specs.items()}
    return num_pages, num_slots, wants
