"""Launcher of moe_experts (ABI: template.cu.j2; contract: spec.py).

    MoeExperts(spec)(x, w13, s13, w2, s2, route, out, *, gs13=None, gs2=None, x_scales=None,
                     out_f32=None, ws=None, expert_base=0, pdl=None) -> out

- x: BF16 [T, W] (act bf16), or E4M3 codes uint8 [T, W] with x_scales [T, W / 128] (FP32, or UE8M0
  uint8 bytes, per the spec's recipe: act_quant_fp8's outputs), W = spec.hidden (the latent).
- w13, s13, w2, s2 (+ gs13, gs2 for NVFP4): model/weight_types.ExpertWeights' tensors as loaded
  (w13, w13_scale, w2, w2_scale, w13_global, w2_global); E4M3 scales as uint8 or float8_e4m3fn.
- route: the dict MoeRoute returns (ids [T, k], weights [T, k], offsets [R + 1], perm [T k]; counts
  and inv are not read), R = spec.route_experts.
- out: BF16 [T, W]; out_f32: optional FP32 [T, W] (the same sum before rounding, for a TP / EP
  reduction). expert_base: the router's number of this rank's expert 0 (EP; base + E <= R).
- ws: workspace(max_tokens) (h [T_max k, I] BF16 and y [T_max k, W] FP32); None: the launcher's own,
  allocated (or grown) by an eager call, so call once with the largest T before a graph capture.

Three launches on torch's stream (gate_up, down, combine; programmatic dependent launch between
them), no host sync, no allocation once the workspace is there: graph-safe. Grids depend on T only.
The variant decides the GEMM launches: "mma_swapab" (SM90) passes the ExpertArgs struct alone;
"tcgen05" (sm103 / sm107) also a TMA map of w13 / w2 (encoded on the host, no device state: also
inside a capture) and its plan's dynamic shared memory, and needs 16-byte aligned scale tensors
(bulk copies). The combine launch is the same kernel on every target.
"""
from __future__ import annotations

import ctypes

from k3gen.config import settings
from k3gen.errors import DeviceError, SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.moe_experts.spec import COMBINE_THREADS, PROBE_THREADS, ActFormat, WeightFormat, cdiv
from k3gen.runtime import faults
from k3gen.runtime.checks import check_one_device, check_tensor
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.loader import I32, PTR, ArgPack, CudaKernel
from k3gen.runtime.tma import MapCache

ROUTE_KEYS = ("ids", "weights", "offsets", "perm")


class ExpertArgs(ctypes.Structure):
    """k3gen::moe::ExpertArgs (include/k3gen/moe/experts.cuh), passed by value."""
    _fields_ = [("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("gs", ctypes.c_void_p),
                ("x", ctypes.c_void_p), ("xs", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("offsets", ctypes.c_void_p), ("perm", ctypes.c_void_p),
                ("num_tokens", ctypes.c_int), ("nslots", ctypes.c_int), ("expert_base", ctypes.c_int),
                ("err", ctypes.c_void_p)]


def _scale_bytes(name, t, shape, align=2):
    import torch
    if t.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise SpecError(f"{name}.dtype", str(t.dtype), ["uint8", "float8_e4m3fn"], "scale bytes")
    check_tensor(name, t if t.dtype == torch.uint8 else t.view(torch.uint8), torch.uint8, shape, align=align)


class MoeExperts(Launcher):
    def __init__(self, spec):
        super().__init__(spec)
        self._ws: dict = {}
        self._maps = MapCache(512)      # tcgen05: the codes' maps, per weight tensor (a model's layers)
        self._smem_set: set[int] = set()

    def load(self):
        if self._kernel is None:
            from k3gen.runtime.resolve import resolve
            cubin, self.meta = resolve(self.spec)
            self._kernel = CudaKernel(cubin, self.meta["entry"])
            self._down = self._kernel.sibling("k3gen_moe_experts_down")
            self._combine = self._kernel.sibling("k3gen_moe_experts_combine")
            self._probe = self._kernel.sibling("k3gen_moe_experts_dequant")
            self.sm_count  # noqa: B018  (grid.y of the persistent GEMMs; queried outside any capture)
            self._allow_smem(self.device_index)
            faults.buffer()   # allocated outside any capture (graphs keep its address)
        return self

    def _allow_smem(self, device: int) -> None:
        """tcgen05: the GEMMs' dynamic shared memory (over 48 KB) opted in, once per device."""
        if not self._tc or device in self._smem_set:
            return
        for k, p in ((self._kernel, self._plans[0]), (self._down, self._plans[1])):
            k.set_max_dynamic_smem(p.smem_bytes, device)
        self._smem_set.add(device)

    @property
    def _tc(self) -> bool:
        return self.spec.impl.name == "tcgen05"

    @property
    def _plans(self):
        """(gate_up, down) TcPlan of the tcgen05 variant."""
        return self.spec.impl.plans(self.spec)

    def _wmap(self, w, plan) -> bytes:
        """TMA map of packed codes w [E, rows, K/2] as uint8 rows [E rows][K/2 bytes]: box [32 rows]
        [kstage / 2 bytes], no swizzle (the decoders read the raw rows); past K reads as zeros."""
        rows, kb = w.shape[0] * w.shape[1], w.shape[2]
        return self._maps.get(w, (kb, rows), (kb,), (plan.kstage // 2, 32), swizzle=0)

    def workspace(self, max_tokens: int, device="cuda") -> dict:
        """The intermediate and partial buffers for up to max_tokens tokens (allocated once)."""
        import torch
        s = self.spec
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 < max_tokens * s.top_k < 2 ** 31:
            raise SpecError("max_tokens", max_tokens, f"1..{(2 ** 31 - 1) // s.top_k}", "32-bit slot indices")
        n = max_tokens * s.top_k
        return {"h": torch.empty(n, s.inter, dtype=torch.bfloat16, device=device),
                "y": torch.empty(n, s.hidden, dtype=torch.float32, device=device)}

    def _own_workspace(self, T: int, device) -> dict:
        import torch
        ws = self._ws.get(device)
        if ws is None or ws["h"].shape[0] < T * self.spec.top_k:
            if torch.cuda.is_current_stream_capturing():
                raise DeviceError(f"moe_experts: the launcher's workspace must grow to {T} tokens inside a "
                                  "CUDA-graph capture; call it once eagerly with the largest T, or pass ws=")
            ws = self.workspace(max(T, 1), device)
            self._ws[device] = ws
        return ws

    def check(self, x, w13, s13, w2, s2, route, out, gs13, gs2, x_scales, out_f32, ws, expert_base) -> int:
        """Metadata checks (no sync); returns T."""
        import torch
        s = self.spec
        E, W, I, k, R, g = s.experts, s.hidden, s.inter, s.top_k, s.route_experts, s.group
        T = x.shape[0] if x.dim() == 2 else -1
        if s.act is ActFormat.BF16:
            check_tensor("x", x, torch.bfloat16, (T, W), align=16)
            if x_scales is not None:
                raise SpecError("x_scales", "a tensor", [None], "BF16 activations carry no scales")
        else:
            check_tensor("x", x, torch.uint8, (T, W), align=16)
            if x_scales is None:
                raise SpecError("x_scales", None, ["a tensor"], "FP8 activations need their scales")
            sdt = torch.float32 if s.recipe is ScaleRecipe.FP32 else torch.uint8
            check_tensor("x_scales", x_scales, sdt, (T, W // 128))
        check_tensor("w13", w13, torch.uint8, (E, 2 * I, W // 2), align=16)
        check_tensor("w2", w2, torch.uint8, (E, W, I // 2), align=16)
        salign = 16 if self._tc else 2   # tcgen05: bulk copies of the scale rows
        _scale_bytes("s13", s13, (E, 2 * I, W // g), salign)
        _scale_bytes("s2", s2, (E, W, I // g), salign)
        if s.weights is WeightFormat.NVFP4:
            if gs13 is None or gs2 is None:
                raise SpecError("gs13/gs2", None, ["FP32 tensors"], "NVFP4 experts need their global scales")
            check_tensor("gs13", gs13, torch.float32, (E, 2))
            check_tensor("gs2", gs2, torch.float32, (E, 1))
        elif gs13 is not None or gs2 is not None:
            raise SpecError("gs13/gs2", "a tensor", [None], "MXFP4 experts have no global scales")
        if not isinstance(route, dict) or any(n not in route for n in ROUTE_KEYS):
            raise SpecError("route", sorted(route) if isinstance(route, dict) else type(route).__name__,
                            list(ROUTE_KEYS), "the dict MoeRoute returns")
        check_tensor("route['ids']", route["ids"], torch.int32, (T, k))
        check_tensor("route['weights']", route["weights"], torch.float32, (T, k))
        check_tensor("route['offsets']", route["offsets"], torch.int32, (R + 1,))
        check_tensor("route['perm']", route["perm"], torch.int32, (T * k,))
        check_tensor("out", out, torch.bfloat16, (T, W), align=16)
        if out_f32 is not None:
            check_tensor("out_f32", out_f32, torch.float32, (T, W), align=16)
        if isinstance(expert_base, bool) or not isinstance(expert_base, int) or not 0 <= expert_base <= R - E:
            raise SpecError("expert_base", expert_base, f"0..{R - E}", f"experts [base, base + {E}) of the router's {R}")
        if ws is not None:
            if set(ws) != {"h", "y"}:
                raise SpecError("ws", sorted(ws), ["h", "y"], "from workspace(max_tokens)")
            check_tensor("ws['h']", ws["h"], torch.bfloat16, (None, I))
            check_tensor("ws['y']", ws["y"], torch.float32, (ws["h"].shape[0], W), align=16)
            if ws["h"].shape[0] < T * k:
                raise SpecError("ws", ws["h"].shape[0] // k, f">= {T} tokens", "sized by workspace(max_tokens)")
        if T * k >= 2 ** 31 or s.max_items(T) > 65535:
            raise SpecError("T", T, f"<= {self.max_tokens()}", "grid.y of the expert GEMMs")
        tensors = [x, w13, s13, w2, s2, out, *(route[n] for n in ROUTE_KEYS)]
        tensors += [t for t in (gs13, gs2, x_scales, out_f32) if t is not None]
        check_one_device(*tensors)
        return T

    def max_tokens(self) -> int:
        t = 1
        while self.spec.max_items(2 * t) <= 65535 and 2 * t * self.spec.top_k < 2 ** 31:
            t *= 2
        return t

    def __call__(self, x, w13, s13, w2, s2, route, out, *, gs13=None, gs2=None, x_scales=None, out_f32=None,
                 ws=None, expert_base: int = 0, pdl: bool | None = None, rows: int | None = None):
        """out[T, W] (BF16) = the routed experts' weighted sum (spec.py); returns out. `rows` caps
        the persistent GEMMs' grid.y below the resident rows (tests: CTAs that walk many items)."""
        import torch
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise SpecError("rows", rows, "an int >= 1", "CTA rows of the persistent expert GEMMs")
        T = self.check(x, w13, s13, w2, s2, route, out, gs13, gs2, x_scales, out_f32, ws, expert_base)
        if T == 0:
            return out
        s = self.spec
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        ws = self._own_workspace(T, out.device) if ws is None else ws
        stream = torch.cuda.current_stream(out.device).cuda_stream
        self.load()._allow_smem(dev)
        pdl = settings().pdl if pdl is None else pdl
        ptr = lambda t: 0 if t is None else t.data_ptr()   # noqa: E731
        err = faults.word("moe_experts", out.device)
        common = dict(offsets=ptr(route["offsets"]), perm=ptr(route["perm"]), num_tokens=T, nslots=T * s.top_k,
                      expert_base=expert_base, err=err)
        a13 = ExpertArgs(w=ptr(w13), s=ptr(s13), gs=ptr(gs13), x=ptr(x), xs=ptr(x_scales), out=ptr(ws["h"]),
                         **common)
        a2 = ExpertArgs(w=ptr(w2), s=ptr(s2), gs=ptr(gs2), x=ptr(ws["h"]), xs=0, out=ptr(ws["y"]), **common)
        # The struct's bytes by value (cuLaunchKernel copies them at the call and at graph capture).
        p13, p2 = ArgPack().add(bytes(a13)), ArgPack().add(bytes(a2))
        if self._tc:
            t13, t2 = self._plans
            p13.add(self._wmap(w13, t13))
            p2.add(self._wmap(w2, t2))
            items = s.max_items(T)
            g13, g2 = (t13.mtiles, t13.item_rows(items, self.sm_count), 1), (t2.mtiles, t2.item_rows(items, self.sm_count), 1)
            launch = ((g13, t13.threads, t13.smem_bytes), (g2, t2.threads, t2.smem_bytes))
        else:
            g13, g2 = s.gate_up_grid(T, self.sm_count), s.down_grid(T, self.sm_count)
            if rows is not None:
                g13 = (g13[0], min(g13[1], rows), 1) if s.gate_up.persistent else g13
                g2 = (g2[0], min(g2[1], rows), 1) if s.down.persistent else g2
            launch = ((g13, s.gate_up.threads, 0), (g2, s.down.threads, 0))
        if rows is not None and self._tc:   # every tcgen05 CTA walks items
            launch = tuple(((g[0], min(g[1], rows), 1), n, m) for g, n, m in launch)
        for kern, pack, (grid, threads, smem) in zip((self.kernel, self._down), (p13, p2), launch):
            kern.launch_ex(grid, (threads, 1, 1), None, pack.address(), None, dev, stream, smem, pdl=pdl)
        self._combine.launch_ex(s.combine_grid(T), (COMBINE_THREADS, 1, 1), None,
                                (ptr(ws["y"]), ptr(route["ids"]), ptr(route["weights"]), ptr(out), ptr(out_f32),
                                 expert_base, err), (PTR, PTR, PTR, PTR, PTR, I32, PTR), dev, stream, pdl=pdl)
        return out

    def dequantize(self, which: str, w, s, gs, expert: int, row0: int, nrows: int, out):
        """Tests: the FP32 values the GEMMs multiply (after the NVFP4 global) of rows [row0, row0 +
        nrows) of one expert's w13 (which "w13") or w2 ("w2") into out [nrows, K]."""
        import torch
        sp = self.spec
        K = sp.hidden if which == "w13" else sp.inter
        if which not in ("w13", "w2"):
            raise SpecError("which", which, ["w13", "w2"])
        check_tensor("out", out, torch.float32, (nrows, K))
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        self.load()
        grid = (cdiv(nrows * K // 32, PROBE_THREADS), 1, 1)
        self._probe.launch_ex(grid, (PROBE_THREADS, 1, 1), None,
                              (w.data_ptr(), s.data_ptr(), 0 if gs is None else gs.data_ptr(), out.data_ptr(),
                               0 if which == "w13" else 1, expert, row0, nrows),
                              (PTR, PTR, PTR, PTR, I32, I32, I32, I32), dev, torch.cuda.current_stream().cuda_stream)
        return out
