"""The Target type: an arch plus the features generated code may depend on.

Code decides by these features (`mma`, `fp4_cvt`, `tma`, the scale layout and recipes, `menu`,
`frozen`), never by a target's name. This module sits below the ops; the registry of presets and
what each builds is `k3gen.targets`, above them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from k3gen.ir.dtypes import KvDtype, ScaleLayout, ScaleRecipe, SsmDtype


@dataclass(frozen=True)
class Target:
    name: str                 # "sm90", "sm100-mxfp4", "sm103-nvfp4", "sm107-nvfp4"
    arch: str                 # NVRTC/CuTe arch: "sm_90a", ...
    sm: int                   # 90, 100, 103, 107
    mma: str                  # "wgmma" or "tcgen05"
    fp4_cvt: bool             # hardware cvt.rn.satfinite.e2m1x2.f32
    kv_dtypes: tuple[KvDtype, ...]
    ssm_dtypes: tuple[SsmDtype, ...]
    nvfp4_scale_layout: ScaleLayout
    scale_recipe: ScaleRecipe                 # the FP8 block-scale recipe its GEMMs are paired with by default
    tma: bool = False                         # cp.async.bulk.tensor (TMA) loads
    menu: tuple[str, ...] = ()                # op names the preset builds (k3gen.targets.model_specs checks)
    # Recipes a deployment may pick for its FP8 projections; empty: only `scale_recipe`.
    gemm_recipes: tuple[ScaleRecipe, ...] = ()
    frozen: bool = False      # generated sources are frozen byte for byte once landed
    notes: str = field(default="", compare=False)

    @property
    def module_name(self) -> str:
        """Folder / Python package name under generated/."""
        return self.name.replace("-", "_")

    @property
    def recipes(self) -> tuple[ScaleRecipe, ...]:
        return self.gemm_recipes or (self.scale_recipe,)

    def canonical(self) -> dict:
        # Only what changes generated code enters the spec digest.
        return {"name": self.name, "arch": self.arch}
