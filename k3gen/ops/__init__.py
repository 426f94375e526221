"""The op menu: one folder per fused op (the folder name is the op name).

Each folder holds spec.py (the contract), variants.py (the kernels that implement it), a template
(template.cu.j2) or a CuTe DSL module (cute_kernel.py), reference.py (FP32, runs on the CPU) and
launcher.py (one Launcher subclass). Nothing here is a hand-kept table: folders are discovered.
"""
from __future__ import annotations

import enum
import functools
import importlib
import json
import typing
from pathlib import Path

from k3gen.errors import SpecError
from k3gen.ir.spec import OpSpec, registered
from k3gen.ir.target import Target

OPS_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def op_names() -> tuple[str, ...]:
    return tuple(sorted(d.name for d in OPS_DIR.iterdir() if (d / "spec.py").is_file()))


def registry() -> dict[str, type[OpSpec]]:
    """op name -> spec class; importing each op package registers its spec and its variants."""
    for name in op_names():
        importlib.import_module(f"k3gen.ops.{name}")
    return registered()


def spec_class(op: str) -> type[OpSpec]:
    reg = registry()
    if op not in reg:
        raise SpecError("op", op, sorted(reg))
    return reg[op]


def launcher_path(op: str) -> tuple[str, str]:
    """(module, class name) of the op's launcher, without importing the runtime."""
    text = (OPS_DIR / op / "launcher.py").read_text()
    import re
    names = re.findall(r"^class (\w+)\(Launcher\):", text, flags=re.M)
    if len(names) != 1:
        raise SpecError("launcher", op, f"exactly one `class X(Launcher)` in ops/{op}/launcher.py")
    return f"k3gen.ops.{op}.launcher", names[0]


def spec_from_canonical(text: str, target: Target) -> OpSpec:
    """Rebuild a spec from canonical JSON using the field types of its class."""
    d = json.loads(text)
    cls = spec_class(d.pop("op"))
    d.pop("target")
    hints = typing.get_type_hints(cls)
    kw = {}
    for k, v in d.items():
        t = hints.get(k)
        if v is not None and typing.get_args(t):  # Optional[X] / X | None: the non-None member
            t = next((a for a in typing.get_args(t) if a is not type(None)), t)
        if isinstance(t, type) and issubclass(t, enum.Enum):
            v = t(v)
        elif hasattr(t, "from_canonical"):
            v = t.from_canonical(v)
        kw[k] = v
    return cls(target=target, **kw)
