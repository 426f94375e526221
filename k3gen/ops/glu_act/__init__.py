"""glu_act: the gated activation (SiTU or SiLU) of a GLU's [gate | up] GEMM output, fused with the
FP8 quantization of the down projection's input."""
from k3gen.ops.glu_act import spec, variants  # noqa: F401
