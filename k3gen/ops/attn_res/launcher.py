"""Launcher of attn_res (ABI: template.cu.j2; contract: spec.py).

One launch on torch's stream, no allocation, no host sync: graph-safe. The source buffer is
allocated once for the most sources and rows a step can have (`source_buffer`); a call names how
many sources are valid. Sealing a block and, without a fused delta, adding a layer output to the
partial sum are the slice ops `seal` and `accumulate` below (in place, graph-safe).
"""
from __future__ import annotations

import ctypes

from k3gen.config import settings
from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.attn_res.spec import ResDelta
from k3gen.runtime.checks import check_one_device, check_tensor
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.loader import I32, PTR, ptr

I64 = ctypes.c_longlong
TYPES = (PTR, I64, I64, I32, PTR, PTR, PTR, I32, PTR, PTR, PTR, PTR)


def _strided_ok(t, h: int) -> bool:
    """FP32 [*, *, h] with unit inner stride, 4-element strides and a 16-byte aligned start."""
    return t.dim() == 3 and t.shape[2] == h and t.stride(2) == 1 and t.stride(1) % 4 == 0 \
        and t.stride(0) % 4 == 0 and t.data_ptr() % 16 == 0


class AttnRes(Launcher):
    def source_buffer(self, max_rows: int, device="cuda"):
        """The preallocated sources [max_sources, max_rows, hidden] FP32 (zeros)."""
        import torch
        return torch.zeros(self.spec.max_sources, max_rows, self.spec.hidden, dtype=torch.float32, device=device)

    @staticmethod
    def seal(src, n: int, out) -> None:
        """Start source n (the next block's partial sum) with a layer output: src[n, :M] = FP32(out).
        The partial sum at n - 1 is a completed block where it lies."""
        src[n, :out.shape[0]].copy_(out)

    @staticmethod
    def accumulate(src, n: int, out) -> None:
        """Add a layer output to the partial sum, source n - 1: src[n - 1, :M] += FP32(out)."""
        src[n - 1, :out.shape[0]].add_(out)

    def __call__(self, src, n: int, query, norm_w, out, *, codes=None, scales=None, mixed=None,
                 delta=None, seal: bool = False):
        """Mix sources 0..n-1 of rows 0..M-1 (M = out.shape[0]) of src [>= n, >= M, hidden] FP32,
        with query [hidden] FP32 and norm_w [hidden] BF16, into out [M, hidden] BF16 and, for an
        fp8 spec, codes [M, hidden] uint8 and scales [M, hidden/128] (FP32, or uint8 UE8M0 bytes).
        mixed (optional) [M, hidden] FP32 receives the mixed rows before the norm. A spec with
        delta takes delta [M, hidden] and first makes source n-1 src + delta (or delta with
        seal=True), in place. Returns out."""
        import torch
        s = self.spec
        h = s.hidden
        M = out.shape[0] if out.dim() == 2 else -1
        check_tensor("out", out, torch.bfloat16, (None, h), align=16)
        if src.dtype != torch.float32 or not _strided_ok(src, h) or src.shape[1] < M:
            raise SpecError("src", (tuple(src.shape), str(src.dtype).replace("torch.", "")),
                            [f"float32 [>= n, >= {M}, {h}]"], "unit inner stride, 4-element strides, 16-byte aligned")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= min(s.max_sources, src.shape[0]):
            raise SpecError("n", n, f"1..{min(s.max_sources, src.shape[0])}", "valid sources (spec max_sources, "
                            "src.shape[0])")
        check_tensor("query", query, torch.float32, (h,), align=16)
        check_tensor("norm_w", norm_w, torch.bfloat16, (h,), align=16)
        if s.fp8:
            sdt = torch.float32 if s.recipe is ScaleRecipe.FP32 else torch.uint8
            if codes is None or scales is None:
                raise SpecError("codes", None, ["uint8 codes and scales"], f"spec {s.slug()} writes FP8")
            check_tensor("codes", codes, torch.uint8, (M, h), align=16)
            check_tensor("scales", scales, sdt, (M, s.groups))
        elif codes is not None or scales is not None:
            raise SpecError("codes", "given", [None], f"spec {s.slug()} writes no FP8")
        if mixed is not None:
            check_tensor("mixed", mixed, torch.float32, (M, h), align=16)
        if s.delta is ResDelta.NONE:
            if delta is not None or seal:
                raise SpecError("delta", "given", [None], f"spec {s.slug()} fuses no partial-sum update")
        else:
            ddt = torch.bfloat16 if s.delta is ResDelta.BF16 else torch.float32
            if delta is None:
                raise SpecError("delta", None, [f"{s.delta.value} [{M}, {h}]"], f"spec {s.slug()} adds a delta")
            check_tensor("delta", delta, ddt, (M, h), align=16)
        check_one_device(out, src, query, norm_w, *(t for t in (codes, scales, mixed, delta) if t is not None))
        if M == 0:
            return out
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        args = (src.data_ptr(), src.stride(0), src.stride(1), n, query.data_ptr(), norm_w.data_ptr(), ptr(delta),
                int(bool(seal)), out.data_ptr(), ptr(codes), ptr(scales), ptr(mixed))
        cluster = (s.slices, 1, 1) if s.slices > 1 else None
        self.kernel.launch_ex(s.grid(M), (s.threads, 1, 1), cluster, args, TYPES, dev,
                              torch.cuda.current_stream(out.device).cuda_stream, pdl=settings().pdl)
        return out
