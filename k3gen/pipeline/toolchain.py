"""Where the CUDA pieces k3gen uses live: headers, cuobjdump/nvdisasm, NVRTC version.

The pip wheels (nvidia-cuda-*) are preferred; a system CUDA (CUDA_HOME or PATH) is the fallback,
which is what the GPU machine has.
"""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path


def _wheel_roots() -> list[Path]:
    roots = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels
        for p in getattr(nvidia, "__path__", []):
            for sub in ("cu13", "cuda_runtime", "cuda_nvrtc"):
                if (Path(p) / sub).is_dir():
                    roots.append(Path(p) / sub)
    except ImportError:
        pass
    return roots


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> Path | None:
    for root in _wheel_roots():
        if (root / "include" / "cuda_bf16.h").exists():
            return root / "include"
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env) and (Path(os.environ[env]) / "include" / "cuda_bf16.h").exists():
            return Path(os.environ[env]) / "include"
    for p in ("/usr/local/cuda/include",):
        if (Path(p) / "cuda_bf16.h").exists():
            return Path(p)
    return None


@functools.lru_cache(maxsize=None)
def tool(name: str) -> str | None:
    """Path of cuobjdump / nvdisasm."""
    for root in _wheel_roots():
        if (root / "bin" / name).exists():
            return str(root / "bin" / name)
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env) and (Path(os.environ[env]) / "bin" / name).exists():
            return str(Path(os.environ[env]) / "bin" / name)
    return shutil.which(name) or (f"/usr/local/cuda/bin/{name}"
                                  if Path(f"/usr/local/cuda/bin/{name}").exists() else None)


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc
    err, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=1)
def cutlass_dsl_version() -> str:
    try:
        from importlib.metadata import version
        return version("nvidia-cutlass-dsl")
    except Exception:
        return "absent"
