"""act_quant_fp8: the contract is spec.py; the kernels are variants.py."""
from k3gen.ops.act_quant_fp8 import variants as _variants  # noqa: F401  (attaches the variant table)
from k3gen.ops.act_quant_fp8.spec import *  # noqa: F401,F403
