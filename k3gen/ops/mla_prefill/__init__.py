"""mla_prefill: the contract is spec.py; the kernels are variants.py."""
from k3gen.ops.mla_prefill import variants as _variants  # noqa: F401  (attaches the variant table)
from k3gen.ops.mla_prefill.spec import *  # noqa: F401,F403
