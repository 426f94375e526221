"""Launcher of fp8_block_gemm (ABI: template.cu.j2 and cute_kernel.py; contract: spec.py).

Graph-safe: the checks read tensor metadata only, the launch plan depends on M and the SM count
(read at load()), and the shared-memory attribute is set once per device before any capture. The
wgmma variant takes its W and x operands as TMA tensor maps by value: they are encoded on the host
(cuTensorMapEncodeTiled touches no device state) and copied into the launch's parameters, so a
captured graph holds the maps of the tensors it was captured with, like any pointer argument.
The tcgen05_tma variant (sm103/sm107, CuTe DSL) launches through runtime.cute_launch, which encodes
its two maps from the build's atom geometry, with the same cluster split-K plan (spec._plan_tma).
The streaming mode's workspace (FP32 partial slots + arrival counters that the kernel leaves at
zero) is allocated once per device at load(), so launches of one launcher must not run
concurrently on two streams (they would share the counters).
"""
from __future__ import annotations


from k3gen.config import settings
from k3gen.errors import DeviceError, SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.spec import BLOCK, MAX_SPLIT, cdiv, nt_for, work_items
from k3gen.runtime.launcher import Launcher
from k3gen.runtime.checks import check_tensor
from k3gen.runtime.loader import I32, PTR, ArgPack, _check
from k3gen.runtime.tma import MapCache

TMA_CACHE = 64   # encoded maps kept per launcher (weights are few; activations rotate through a handful)


def scale_torch_dtype(recipe: ScaleRecipe):
    import torch
    return torch.float32 if recipe is ScaleRecipe.FP32 else torch.uint8


class Fp8BlockGemm(Launcher):
    def __init__(self, spec):
        super().__init__(spec)
        self._smem_set: set[int] = set()
        self._maps = MapCache(TMA_CACHE)
        self._ws: dict = {}   # device -> (partials, counters) of the streaming mode

    def load(self):
        if self.spec.lowering == "cute":  # tcgen05 targets: CuTe DSL cubin, ABI from the build
            if self._kernel is None:
                from k3gen.runtime.resolve import resolve
                from k3gen.runtime.cute_launch import load_cute_kernel
                cubin, self.meta = resolve(self.spec)
                self._kernel = load_cute_kernel(cubin, self.meta).load()
            if self.spec.mma == "tcgen05_tma":
                self.sm_count  # noqa: B018  (the split plan's input, queried outside any capture)
            return self
        super().load()
        self.sm_count  # noqa: B018  (queried once, outside any graph capture)
        self._allow_smem(self.device_index)
        return self

    def _workspace(self, device: int):
        """Partial slots and zeroed counters for up to sm_count streaming CTAs, allocated by the
        first streaming launch on the device (the default cluster plan needs none), which must
        therefore run outside a graph capture."""
        ws = self._ws.get(device)
        if ws is None:
            import torch
            if torch.cuda.is_current_stream_capturing():
                raise DeviceError("fp8_block_gemm: the first streaming launch (ctas=) on a device allocates its "
                                  "workspace and cannot run inside a CUDA-graph capture; launch it once before")
            n = self.sm_count
            ws = (torch.empty(self.spec.workspace_floats(n), dtype=torch.float32, device=f"cuda:{device}"),
                  torch.zeros(self.spec.workspace_counters(n), dtype=torch.int32, device=f"cuda:{device}"))
            self._ws[device] = ws
        return ws

    def _allow_smem(self, device: int) -> None:
        if device in self._smem_set:
            return
        from cuda.bindings import driver
        f = self._kernel.function(device)  # not self.kernel: that calls load(), which calls us
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(f, attr, self.spec.max_smem_bytes()), "cuFuncSetAttribute")
        self._smem_set.add(device)

    def split_for(self, m: int) -> int:
        if self.spec.mma == "tcgen05":
            return 1
        return self.spec.plan(m, self.sm_count).split

    def plan_for(self, m: int, *, split: int | None = None, ctas: int | None = None, pf: int = 0):
        """The wgmma variant's launch plan for M tokens (what __call__ launches)."""
        return self.spec.plan(m, self.sm_count, split, ctas, pf)

    def _tma_map(self, t, geom: dict) -> bytes:
        return self._maps.get(t, geom["dims"], geom["strides"], geom["box"])

    def tile_weights(self, w_codes):
        """W codes [N, K] -> the pre-tiled layout the wgmma kernel streams with one 16 KB bulk copy
        per stage (`w_tiled=True`): [NB * KB * 128, 128] bytes, tile (nb, kb) at rows
        (nb * KB + kb) * 128, zero-padded past N and K, and each tile already in the 128-byte
        swizzle the TMA would write (16-byte chunk c of row r at chunk c ^ (r % 8)), so the bytes
        land in shared memory as the wgmma descriptors expect. A one-time re-layout at load time."""
        import torch
        s = self.spec
        check_tensor("w_codes", w_codes, torch.uint8, (s.n, s.k))
        nb, kb = s.n_blocks, s.k_blocks
        padded = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.uint8, device=w_codes.device)
        padded[:s.n, :s.k] = w_codes
        tiles = padded.view(nb, BLOCK, kb, BLOCK).permute(0, 2, 1, 3).reshape(nb * kb, BLOCK, 8, 16)
        r = torch.arange(BLOCK, device=w_codes.device)[:, None]
        j = torch.arange(8, device=w_codes.device)[None, :]
        return tiles[:, r, j ^ (r % 8)].contiguous().view(nb * kb * BLOCK, BLOCK)

    def check(self, x_codes, x_scales, w_codes, w_scales, out, w_tiled: bool = False) -> int:
        import torch
        s = self.spec
        m = x_codes.shape[0] if x_codes.dim() == 2 else -1
        sdt = scale_torch_dtype(s.recipe)
        # A scale tensor of the other recipe is the pairing error SPEC.md section 6 warns about.
        for name, t in (("x_scales", x_scales), ("w_scales", w_scales)):
            if t.dtype != sdt:
                raise SpecError(f"{name}.dtype", str(t.dtype).replace("torch.", ""), [str(sdt).replace("torch.", "")],
                                f"recipe {s.recipe.value}: FP32 scales are float32, UE8M0 scales uint8 bytes")
        check_tensor("x_codes", x_codes, torch.uint8, (m, s.k), align=16)
        check_tensor("x_scales", x_scales, sdt, (m, s.k_blocks))
        if w_tiled:
            check_tensor("w_codes", w_codes, torch.uint8, (s.n_blocks * s.k_blocks * BLOCK, BLOCK), align=16)
        else:
            check_tensor("w_codes", w_codes, torch.uint8, (s.n, s.k), align=16)
        check_tensor("w_scales", w_scales, sdt, (s.n_blocks, s.k_blocks))
        check_tensor("out", out, torch.bfloat16, (m, s.n), align=16)
        devs = {t.device for t in (x_codes, x_scales, w_codes, w_scales, out)}
        if len(devs) != 1 or next(iter(devs)).type != "cuda":
            raise SpecError("device", sorted(map(str, devs)), "one CUDA device for all tensors")
        tile_m = s.bm if s.lowering == "cute" else nt_for(max(m, 1))
        if cdiv(max(m, 1), tile_m) > 65535:
            raise SpecError("M", m, f"<= {65535 * tile_m}", "grid.y")
        return m

    def __call__(self, x_codes, x_scales, w_codes, w_scales, out, *, split: int | None = None,
                 ctas: int | None = None, pf: int = 0, pdl: bool | None = None, w_tiled: bool = False):
        """out[M, N] (BF16) = dequant(x_codes, x_scales) @ dequant(w_codes, w_scales)^T; returns out.
        wgmma variant: `split` forces the cluster split-K mode, `ctas` the streaming mode with that
        many persistent CTAs (ctas=0: the cluster mode with the planned split); `pf` the L2 prefetch
        distance of the weight stream in K blocks (0: off); `pdl` (default: setting K3GEN_PDL, on)
        launches with programmatic dependent launch, so the first weight tiles stream while the
        previous kernel finishes (the token tiles and scales are read after griddepcontrol.wait)."""
        if pf and self.spec.mma != "wgmma":
            raise SpecError("pf", pf, [0], "L2 prefetch is a knob of the wgmma variant")
        import torch
        if w_tiled and (self.spec.mma != "wgmma" or ctas or pf):
            raise SpecError("w_tiled", True, [False], "pre-tiled weights: the wgmma cluster mode without pf only")
        m = self.check(x_codes, x_scales, w_codes, w_scales, out, w_tiled)
        if m == 0:
            return out
        if self.spec.mma == "tcgen05_tma":
            # The cluster split-K plan (spec._plan_tma; rank r of a cluster owns k_range(r, split, KB));
            # the kernel's TMA maps are encoded by CuteKernel from the build's atom geometry.
            if ctas:
                raise SpecError("ctas", ctas, [None, 0], "the tcgen05 TMA kernel has the cluster split only")
            plan = self.spec.plan(m, self.load().sm_count, split)
            self.kernel.launch(plan.grid, x_codes, x_scales, w_codes, w_scales, out,
                               cluster=(plan.split, 1, 1) if plan.split > 1 else None)
            return out
        if self.spec.lowering == "cute":
            if split not in (None, 1) or ctas:
                raise SpecError("split", split, [1], "the cp.async tcgen05 kernel has no split-K")
            self.kernel.launch(self.spec.grid(m), x_codes, x_scales, w_codes, w_scales, out)
            return out
        cap = min(MAX_SPLIT, self.spec.k_blocks)
        if split is not None and not 1 <= split <= cap:
            raise SpecError("split", split, f"1..{cap}", "K blocks per cluster CTA >= 1")
        if split is not None and ctas:
            raise SpecError("ctas", ctas, [None, 0], "split forces the cluster mode")
        if ctas is not None and not 0 <= ctas <= self.sm_count:
            raise SpecError("ctas", ctas, f"0..{self.sm_count}", "one streaming CTA per SM at most")
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        self.load()._allow_smem(dev)  # a launcher called before load() loads itself (never in capture)
        stream = torch.cuda.current_stream(out.device).cuda_stream
        plan = self.spec.plan(m, self.sm_count, split, ctas, pf)
        boxes = self.spec.tma_boxes(m, plan.nt)
        if w_tiled:
            rows = self.spec.n_blocks * self.spec.k_blocks * BLOCK
            boxes["w"] = {"dims": (BLOCK, rows), "strides": (BLOCK,), "box": (BLOCK, BLOCK)}
        if plan.ctas and work_items(self.spec.n, self.spec.k, m) >= 2 ** 31:
            raise SpecError("M", m, "fewer than 2^31 work items", "32-bit work index of the streaming mode")
        part, cnt = self._workspace(dev) if plan.ctas else (None, None)
        args = (ArgPack().add(self._tma_map(w_codes, boxes["w"])).add(self._tma_map(x_codes, boxes["x"]))
                .add(PTR(x_scales.data_ptr())).add(PTR(w_scales.data_ptr())).add(PTR(out.data_ptr()))
                .add(I32(m)).add(I32(plan.nt))
                .add(PTR(part.data_ptr() if plan.ctas else 0)).add(PTR(cnt.data_ptr() if plan.ctas else 0))
                .add(I32(plan.pf)).add(PTR(w_codes.data_ptr() if w_tiled else 0)))
        grid, block = plan.grid, (self.spec.threads, 1, 1)
        self.kernel.launch_ex(grid, block, (plan.split, 1, 1) if plan.split > 1 else None, args.address(),
                              None, dev, stream, plan.smem, pdl=settings().pdl if pdl is None else pdl)
        return out
