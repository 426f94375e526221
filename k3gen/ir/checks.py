"""Field checks several op specs share, so that one field is rejected with one message everywhere."""
from __future__ import annotations

from k3gen.errors import SpecError, TargetError
from k3gen.ir.dtypes import KvDtype, ScaleLayout


def check_enum_fields(spec, pairs) -> None:
    """Each (field, enum type) of `pairs` must hold a member of its enum; the first that does not
    is rejected by its own name (a variant reading it would fail less clearly)."""
    for f, enum_t in pairs:
        if not isinstance(getattr(spec, f), enum_t):
            raise SpecError(f, getattr(spec, f), [e.value for e in enum_t])


def check_heads(heads, limit: int, why: str) -> None:
    """A positive int head count of at most `limit` (`why` names the grid dimension it is)."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise SpecError("heads", heads, "a positive head count (K3: 96, 48, 24, 12, 6)")
    if heads > limit:
        raise SpecError("heads", heads, f"<= {limit}", why)


def check_ssm_on_target(spec) -> None:
    if spec.ssm not in spec.target.ssm_dtypes:
        raise TargetError("ssm", spec.ssm.value, [s.value for s in spec.target.ssm_dtypes],
                          f"target {spec.target.name}")


def default_scale_layout(spec) -> ScaleLayout:
    """NVFP4 KV takes the target's tile-scale layout; the other formats have no tile scales."""
    return spec.target.nvfp4_scale_layout if spec.kv is KvDtype.NVFP4 else ScaleLayout.LINEAR


def check_kv_on_target(spec) -> None:
    """`spec.kv` is a format of the target, and the NVFP4-only fields (`scale_layout`,
    `max_drafts`) keep their neutral values for the other formats."""
    if spec.kv not in spec.target.kv_dtypes:
        raise TargetError("kv", spec.kv.value, [k.value for k in spec.target.kv_dtypes],
                          f"target {spec.target.name}")
    if spec.kv is not KvDtype.NVFP4 and spec.scale_layout is not ScaleLayout.LINEAR:
        raise SpecError("scale_layout", spec.scale_layout.value, [ScaleLayout.LINEAR.value],
                        f"{spec.kv} KV has no FP4 tile scales")
    if spec.kv is not KvDtype.NVFP4 and spec.max_drafts:
        raise SpecError("max_drafts", spec.max_drafts, [0], "only NVFP4 KV keeps an HP tail ring")
