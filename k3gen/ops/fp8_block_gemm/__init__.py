"""fp8_block_gemm: the contract is spec.py; the kernels are variants.py."""
from k3gen.ops.fp8_block_gemm import variants as _variants  # noqa: F401  (attaches the variant table)
from k3gen.ops.fp8_block_gemm.spec import *  # noqa: F401,F403
