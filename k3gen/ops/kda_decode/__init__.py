"""kda_decode: the contract is spec.py; the kernels are variants.py."""
from k3gen.ops.kda_decode import variants as _variants  # noqa: F401  (attaches the variant table)
from k3gen.ops.kda_decode.spec import *  # noqa: F401,F403
