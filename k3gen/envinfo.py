"""What `k3gen collect-env` reports: versions, toolchain paths, the K3GEN_* settings in effect and
the GPU (or, when there is none, why, in terms a user can act on)."""
from __future__ import annotations

import sys
from pathlib import Path

from k3gen.errors import K3genError


def settings_in_effect() -> dict:
    """What `collect-env` reports: each knob's value in effect and where it comes from, plus the
    cache folder used, whether JIT is on and which prebuilt folders exist."""
    import os

    from k3gen.config import describe, settings
    out = {name: f"{value or '(empty)'} [{src}]" for name, value, src in describe()}
    try:
        out["cache folder used"] = str(settings().cache_dir)
        out["JIT"] = "off (K3GEN_DISABLE_JIT)" if settings().disable_jit else "on"
        folders = [f for f in settings().prebuilt.split(os.pathsep) if f]
        out["prebuilt folders"] = ", ".join(f"{f} ({'found' if Path(f).is_dir() else 'missing'})"
                                            for f in folders) or "none"
    except K3genError as e:
        out["error"] = str(e)
    return out


def no_gpu_reason(torch) -> str:
    """Why torch sees no GPU, in the terms a user can act on."""
    import glob
    import os
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)"
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip() in ("", "-1", "none"):
        return f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU"
    if not glob.glob("/dev/nvidia[0-9]*") and sys.platform.startswith("linux"):
        return "no /dev/nvidia* device: no NVIDIA GPU or driver on this machine (or not passed to the container)"
    try:
        from cuda.bindings import driver
        err = driver.cuInit(0)[0]
        if int(err) != 0:
            return f"the CUDA driver refused to start: cuInit -> {err.name}"
    except Exception as e:  # noqa: BLE001 - a reason, not a failure
        return f"the CUDA driver could not be loaded ({type(e).__name__}: {e})"
    return "torch.cuda.is_available() is False although the driver started"


def collect_env(query_gpu: bool = True) -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from k3gen.pipeline.toolchain import cuda_include_dir, nvrtc_version, tool
    env = {"python": platform.python_version(), "platform": platform.platform(), "packages": {}}
    for pkg in ("k3gen", "torch", "cuda-bindings", "cuda-core", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime",
                "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm", "nvidia-cutlass-dsl", "jinja2", "sympy",
                "triton", "fla-core"):
        try:
            env["packages"][pkg] = version(pkg)
        except PackageNotFoundError:
            env["packages"][pkg] = None
    try:
        env["nvrtc"] = nvrtc_version()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        env["nvrtc"] = f"unavailable: {e}"
    env["cuda_include"] = str(cuda_include_dir())
    env["cuobjdump"] = tool("cuobjdump")
    env["nvdisasm"] = tool("nvdisasm")
    env["settings"] = settings_in_effect()
    env["gpu"] = None
    env["gpu_status"] = "not queried (--no-gpu)"
    if query_gpu:
        try:
            import torch
        except ImportError:
            env["gpu_status"] = "torch is not installed"
        else:
            try:
                if torch.cuda.is_available():
                    p = torch.cuda.get_device_properties(0)
                    env["gpu"] = {"name": p.name, "cc": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                                  "memory_gb": round(p.total_memory / 2**30, 1), "torch_cuda": torch.version.cuda}
                    env["gpu_status"] = "found"
                else:
                    env["gpu_status"] = "none: " + no_gpu_reason(torch)
            except Exception as e:  # noqa: BLE001
                env["gpu_status"] = f"unavailable: {type(e).__name__}: {e}"
    return env
