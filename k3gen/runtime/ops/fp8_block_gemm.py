"""Launcher of fp8_block_gemm (ABI: templates/fp8_block_gemm.cu.j2; contract: ir/ops/fp8_block_gemm.py).

Graph-safe: the checks read tensor metadata only, the split depends on M and the SM count (read at
load()), and the shared-memory attribute is set once per device before any capture.
"""
from __future__ import annotations


from ...errors import SpecError
from ...ir.dtypes import ScaleRecipe
from ...ir.ops.fp8_block_gemm import MAX_SPLIT, cdiv, choose_split
from ..bind import Launcher
from ..checks import check_tensor
from ..loader import I32, PTR, _check


def scale_torch_dtype(recipe: ScaleRecipe):
    import torch
    return torch.float32 if recipe is ScaleRecipe.FP32 else torch.uint8


class Fp8BlockGemm(Launcher):
    def __init__(self, spec):
        super().__init__(spec)
        self._smem_set: set[int] = set()

    def load(self):
        if self.spec.lowering == "cute":  # tcgen05 targets: CuTe DSL cubin, ABI from the build
            if self._kernel is None:
                from ...build import resolve
                from ..cute_launch import load_cute_kernel
                cubin, self.meta = resolve(self.spec)
                self._kernel = load_cute_kernel(cubin, self.meta).load()
            return self
        super().load()
        self.sm_count  # noqa: B018  (queried once, outside any graph capture)
        self._allow_smem(self.device_index)
        return self

    def _allow_smem(self, device: int) -> None:
        if device in self._smem_set:
            return
        from cuda.bindings import driver
        f = self._kernel.function(device)  # not self.kernel: that calls load(), which calls us
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(f, attr, self.spec.smem_bytes(1)), "cuFuncSetAttribute")
        self._smem_set.add(device)

    def split_for(self, m: int) -> int:
        s = self.spec
        if s.lowering == "cute":
            return 1
        return choose_split(s.n, s.k, m, s.bm, self.sm_count)

    def check(self, x_codes, x_scales, w_codes, w_scales, out) -> int:
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
        check_tensor("w_codes", w_codes, torch.uint8, (s.n, s.k), align=16)
        check_tensor("w_scales", w_scales, sdt, (s.n_blocks, s.k_blocks))
        check_tensor("out", out, torch.bfloat16, (m, s.n), align=16)
        devs = {t.device for t in (x_codes, x_scales, w_codes, w_scales, out)}
        if len(devs) != 1 or next(iter(devs)).type != "cuda":
            raise SpecError("device", sorted(map(str, devs)), "one CUDA device for all tensors")
        if cdiv(max(m, 1), s.bm) > 65535:
            raise SpecError("M", m, f"<= {65535 * s.bm}", "grid.y")
        return m

    def __call__(self, x_codes, x_scales, w_codes, w_scales, out, *, split: int | None = None):
        """out[M, N] (BF16) = dequant(x_codes, x_scales) @ dequant(w_codes, w_scales)^T; returns out."""
        import torch
        m = self.check(x_codes, x_scales, w_codes, w_scales, out)
        if m == 0:
            return out
        if self.spec.lowering == "cute":
            if split not in (None, 1):
                raise SpecError("split", split, [1], "the tcgen05 kernel has no split-K yet")
            self.kernel.launch(self.spec.grid(m, 1), x_codes, x_scales, w_codes, w_scales, out)
            return out
        cap = min(MAX_SPLIT, self.spec.k_blocks)
        if split is not None and not 1 <= split <= cap:
            raise SpecError("split", split, f"1..{cap}", "K blocks per cluster CTA >= 1")
        split = split or self.split_for(m)
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        self._allow_smem(dev)
        stream = torch.cuda.current_stream(out.device).cuda_stream
        args = (x_codes.data_ptr(), x_scales.data_ptr(), w_codes.data_ptr(), w_scales.data_ptr(),
                out.data_ptr(), m)
        types = (PTR, PTR, PTR, PTR, PTR, I32)
        grid, block = self.spec.grid(m, split), (self.spec.threads, 1, 1)
        smem = self.spec.smem_bytes(split)
        if split == 1:
            self.kernel.launch(grid, block, args, types, dev, stream, smem)
        else:
            self.kernel.launch_cluster(grid, block, (split, 1, 1), args, types, dev, stream, smem)
        return out

