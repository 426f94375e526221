"""Shape and dtype checks the `k3gen::` ops run before any work: on real tensors (eager, CPU and
CUDA) and on fake ones (torch.compile tracing, FakeTensorMode), so they read metadata only: no
data pointer (fake tensors have none; the launchers check alignment at launch), no device access.
Every failure is a SpecError naming the argument, what it got and what the spec allows."""
from __future__ import annotations

import functools

from k3gen.errors import SpecError


def dt(name: str):
    import torch
    return getattr(torch, name)


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def want(name: str, t, dtype, shape, *, contiguous: bool = True, inner_unit: bool = False) -> None:
    """`t` is a `dtype` tensor of `shape` (None: any size), contiguous, or (contiguous=False,
    inner_unit=True) of unit inner stride."""
    import torch
    if not isinstance(t, torch.Tensor):
        raise SpecError(name, type(t).__name__, "a torch.Tensor")
    ok = t.dtype == dtype and t.dim() == len(shape)
    if ok:
        for got, w in zip(t.shape, shape):
            if w is not None and got != w:
                ok = False
    if ok and contiguous:
        ok = t.is_contiguous()
    if ok and inner_unit and t.dim():
        ok = t.stride(-1) == 1 or t.shape[-1] <= 1
    if not ok:
        layout = "contiguous" if contiguous else "unit inner stride" if inner_unit else ""
        spec = f"{_name(dtype)} {['*' if s is None else s for s in shape]}"
        raise SpecError(name, (tuple(t.shape), _name(t.dtype)), [spec], layout)


def at_least(name: str, got, lo, what: str) -> None:
    if got < lo:
        raise SpecError(name, got, f">= {lo}", what)


def same_device(*named) -> None:
    """Every tensor on the first one's device (the CPU path is the FP32 reference, CUDA the kernel)."""
    first = named[0][1].device
    for name, t in named[1:]:
        if t is not None and t.device != first:
            raise SpecError(f"{name}.device", str(t.device), [str(first)], "one device for every tensor")


def cache_list(handle: str, cache) -> list:
    """The KV cache tensors in the layout's order: a dict by name (checked) or already a list."""
    if isinstance(cache, (list, tuple)):
        return list(cache)
    from k3gen.library.table import cache_names
    names = cache_names(handle)
    if not isinstance(cache, dict) or set(cache) != set(names):
        raise SpecError("cache", sorted(cache) if isinstance(cache, dict) else type(cache).__name__, list(names),
                        "the tensors of the spec's KvLayout, by name (or a list in that order)")
    return [cache[n] for n in names]


@functools.lru_cache(maxsize=None)
def cache_shapes(layout) -> tuple:
    """(name, torch dtype name, leading dim "P" or "S", trailing shape) per cache tensor: the
    leading dim is num_pages (or num_slots for the HP tail ring), the rest is static."""
    from k3gen.runtime.checks import _TORCH_DTYPES
    out = []
    for n, ts in layout.tensors().items():
        lead = "S" if str(ts.shape[0]) == "num_slots" else "P"
        out.append((n, _TORCH_DTYPES[ts.dtype.name], lead, ts.concrete_shape(num_pages=1, num_slots=1)[1:]))
    return tuple(out)


def check_cache(spec, cache: list) -> tuple:
    """The cache tensors against the layout; returns (num_pages, num_slots)."""
    shapes = cache_shapes(spec.layout)
    if len(cache) != len(shapes):
        raise SpecError("cache", len(cache), [len(shapes)], f"the tensors {[s[0] for s in shapes]} in this order")
    dims = {"P": None, "S": 1}
    for (n, dtype, lead, rest), t in zip(shapes, cache):
        if t.dim() != 1 + len(rest):
            raise SpecError(f"cache[{n!r}]", tuple(t.shape), [f"[{lead}, {', '.join(map(str, rest))}]"])
        if dims[lead] is None or lead == "S":
            dims[lead] = t.shape[0]
        want(f"cache[{n!r}]", t, dt(dtype), (dims[lead],) + tuple(rest))
    return dims["P"], dims["S"]
