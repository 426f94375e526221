"""Launcher of moe_route (ABI: template.cu.j2; contract: spec.py).

Two launches on torch's stream (top-k, then the grouped order), no host sync, no allocation: the
outputs live in buffers sized once for T_max tokens (`workspace(max_tokens)`), so a call can be
captured in a CUDA graph; each call routes logits.shape[0] tokens into their leading rows.
"""
from __future__ import annotations

import ctypes

from k3gen.config import settings
from k3gen.errors import SpecError
from k3gen.ops.moe_route.spec import MAX_SLOTS, SORT_THREADS, TOPK_THREADS
from k3gen.runtime.checks import check_one_device, check_tensor
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.loader import I32, PTR, CudaKernel

I64 = ctypes.c_longlong
OUTPUTS = ("ids", "weights", "counts", "offsets", "perm", "inv")


class MoeRoute(Launcher):
    def load(self):
        if self._kernel is None:
            from k3gen.runtime.resolve import resolve
            cubin, self.meta = resolve(self.spec)
            self._kernel = CudaKernel(cubin, self.meta["entry"])
            self._sort = self._kernel.sibling("k3gen_moe_route_sort")
        return self

    def workspace(self, max_tokens: int, device="cuda") -> dict:
        """Output buffers for up to max_tokens tokens (the worst case, allocated once)."""
        import torch
        E, k = self.spec.experts, self.spec.top_k
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 < max_tokens * k < MAX_SLOTS:
            raise SpecError("max_tokens", max_tokens, f"1..{(MAX_SLOTS - 1) // k}", "32-bit slot indices")
        i32 = dict(dtype=torch.int32, device=device)
        return {"ids": torch.empty(max_tokens, k, **i32),
                "weights": torch.empty(max_tokens, k, dtype=torch.float32, device=device),
                "counts": torch.empty(E, **i32), "offsets": torch.empty(E + 1, **i32),
                "perm": torch.empty(max_tokens * k, **i32), "inv": torch.empty(max_tokens * k, **i32)}

    def check(self, logits, bias, ws: dict) -> int:
        """Metadata checks (no sync); returns T."""
        import torch
        E, k = self.spec.experts, self.spec.top_k
        align = 16 if self.spec.vec == 4 else 4
        check_tensor("logits", logits, torch.float32, (None, E), contiguous=False, inner_unit=True, align=align)
        T = logits.shape[0]
        if logits.stride(0) % self.spec.vec or T * k >= MAX_SLOTS:
            raise SpecError("logits", (tuple(logits.shape), logits.stride()),
                            f"row stride a multiple of {self.spec.vec}, T * {k} < 2^31")
        check_tensor("bias", bias, torch.float32, (E,), align=align)
        missing = [n for n in OUTPUTS if n not in ws]
        if missing:
            raise SpecError("workspace", sorted(ws), list(OUTPUTS), f"missing {missing}")
        check_tensor("workspace['ids']", ws["ids"], torch.int32, (None, k))
        check_tensor("workspace['weights']", ws["weights"], torch.float32, (ws["ids"].shape[0], k))
        check_tensor("workspace['counts']", ws["counts"], torch.int32, (E,))
        check_tensor("workspace['offsets']", ws["offsets"], torch.int32, (E + 1,))
        for n in ("perm", "inv"):
            check_tensor(f"workspace[{n!r}]", ws[n], torch.int32, (ws["ids"].shape[0] * k,))
        if ws["ids"].shape[0] < T:
            raise SpecError("workspace", ws["ids"].shape[0], f">= {T} tokens", "sized by workspace(max_tokens)")
        check_one_device(ws["ids"], logits, bias, *(ws[n] for n in OUTPUTS))
        return T

    def __call__(self, logits, bias, ws: dict) -> dict:
        """Route logits [T, E] FP32 with bias [E] FP32 into `ws` (from workspace()); returns the
        views of this call: ids/weights [T, k], counts [E], offsets [E + 1], perm/inv [T * k]."""
        import torch
        T = self.check(logits, bias, ws)
        if settings().validate:
            self.validate_inputs(logits, bias)
        k = self.spec.top_k
        dev = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(logits.device).cuda_stream
        self.load()
        pdl = settings().pdl   # both kernels wait (griddepcontrol.wait) before reading what the previous wrote
        if T:
            self.kernel.launch_ex(self.spec.topk_grid(T), (TOPK_THREADS, 1, 1), None,
                                  (logits.data_ptr(), logits.stride(0), bias.data_ptr(), ws["ids"].data_ptr(),
                                   ws["weights"].data_ptr(), T), (PTR, I64, PTR, PTR, PTR, I32), dev, stream,
                                  pdl=pdl)
        self._sort.launch_ex(self.spec.sort_grid(), (SORT_THREADS, 1, 1), None,
                             (ws["ids"].data_ptr(), ws["counts"].data_ptr(), ws["offsets"].data_ptr(),
                              ws["perm"].data_ptr(), ws["inv"].data_ptr(), T), (PTR, PTR, PTR, PTR, PTR, I32),
                             dev, stream, pdl=pdl)
        out = {"ids": ws["ids"][:T], "weights": ws["weights"][:T], "counts": ws["counts"],
               "offsets": ws["offsets"], "perm": ws["perm"][:T * k], "inv": ws["inv"][:T * k]}
        if settings().validate:
            self.validate_outputs(out, T)
        return out

    @staticmethod
    def validate_inputs(logits, bias) -> None:
        """Host-side checks (they synchronize): NaN or infinite logits/bias make the routing undefined."""
        import torch
        for name, t in (("logits", logits), ("bias", bias)):
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                raise SpecError(name, f"{int(bad.sum())} non-finite values, first at {bad.nonzero()[0].tolist()}",
                                "finite values (K3GEN_VALIDATE=1)")

    def validate_outputs(self, out: dict, T: int) -> None:
        """Host-side checks (they synchronize): ids in range and distinct per token, counts and
        offsets their histogram and prefix sum, perm and inv inverse permutations."""
        import torch
        E, k = self.spec.experts, self.spec.top_k
        ids = out["ids"].cpu().long()
        if T and (int(ids.min()) < 0 or int(ids.max()) >= E):
            raise SpecError("ids", (int(ids.min()), int(ids.max())), f"expert ids in [0, {E})")
        if T and bool((ids.sort(1).values[:, 1:] == ids.sort(1).values[:, :-1]).any()):
            raise SpecError("ids", "a token picks an expert twice", "k distinct experts per token")
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        if not torch.equal(out["counts"].cpu().long(), counts):
            raise SpecError("counts", "differ from the histogram of ids", "bincount(ids)")
        off = out["offsets"].cpu().long()
        if int(off[0]) != 0 or not torch.equal(off[1:], torch.cumsum(counts, 0)):
            raise SpecError("offsets", "not the exclusive prefix sum of counts", "[0, cumsum(counts)]")
        perm, inv = out["perm"].cpu().long(), out["inv"].cpu().long()
        n = T * k
        if n and (int(perm.min()) < 0 or int(perm.max()) >= n or
                  not torch.equal(inv[perm], torch.arange(n))):
            raise SpecError("perm", "not inverse to inv", "inv[perm[p]] == p")
