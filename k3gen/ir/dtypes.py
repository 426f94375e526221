"""The dtype table: element formats, block-scaled formats and the enums specs use."""
from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class ScalarType:
    name: str
    bits: int
    cuda: str            # C++ storage type in generated code
    torch: str           # attribute of the torch module holding the storage dtype
    max_finite: float | None = None

    @property
    def bytes(self) -> float:
        return self.bits / 8


BF16 = ScalarType("bf16", 16, "__nv_bfloat16", "bfloat16", 3.3895313892515355e38)
FP16 = ScalarType("fp16", 16, "__half", "float16", 65504.0)
FP32 = ScalarType("fp32", 32, "float", "float32", 3.4028234663852886e38)
INT32 = ScalarType("int32", 32, "int", "int32")
E4M3 = ScalarType("e4m3", 8, "unsigned char", "uint8", 448.0)      # stored as raw bytes
UE8M0 = ScalarType("ue8m0", 8, "unsigned char", "uint8", 2.0 ** 127)
E2M1 = ScalarType("e2m1", 4, "unsigned char", "uint8", 6.0)         # two per byte, even element low


@dataclass(frozen=True)
class BlockScaledType:
    """Elements quantized in blocks sharing one scale, optionally with a per-tensor global scale."""
    name: str
    element: ScalarType
    scale: ScalarType
    block: int
    global_scale: ScalarType | None

    def bytes_per_element(self) -> float:
        return self.element.bytes + self.scale.bytes / self.block


NVFP4 = BlockScaledType("nvfp4", E2M1, E4M3, 16, FP32)
MXFP4 = BlockScaledType("mxfp4", E2M1, UE8M0, 32, None)
FP8_BLOCK128 = BlockScaledType("fp8_block128", E4M3, FP32, 128, None)

SCALARS = {t.name: t for t in (BF16, FP16, FP32, INT32, E4M3, UE8M0, E2M1)}
BLOCK_SCALED = {t.name: t for t in (NVFP4, MXFP4, FP8_BLOCK128)}

# E2M1 magnitudes by 3-bit code; bit 3 is the sign.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class _StrEnum(str, enum.Enum):
    def __str__(self) -> str:
        return self.value


class KvDtype(_StrEnum):
    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


class SsmDtype(_StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"


class ScaleLayout(_StrEnum):
    """Where NVFP4 KV scales live. Values are identical across layouts; only addresses differ."""
    LINEAR = "linear"          # compact: tile scales [page, 8, 32], rope scales [page, 128, 4]
    SWIZZLE_128X4 = "swz128x4"  # per-row matrix [128, 36] per page in the block-scaled-MMA order


class Fp8ScaleGranularity(_StrEnum):
    PER_TENSOR = "per_tensor"      # one static FP32 scale per layer (TensorRT-LLM)
    PER_TOKEN_128 = "per_token_128"  # dynamic FP32 scale per token per 128 dims (FlashMLA-like)


class ScaleRecipe(_StrEnum):
    FP32 = "fp32"      # raw FP32 block scales
    UE8M0 = "ue8m0"    # power-of-two scales, 2^ceil(log2(amax/448))


class GateKind(_StrEnum):
    BOUNDED = "bounded"    # g = -5 * sigmoid(exp(A_log) * z)   (Kimi K3)
    SOFTPLUS = "softplus"  # g = -exp(A_log) * softplus(z)      (Kimi-Linear)
