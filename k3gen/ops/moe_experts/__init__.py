"""moe_experts: the contract is spec.py; the kernels are variants.py."""
from k3gen.ops.moe_experts import variants as _variants  # noqa: F401  (attaches the variant table)
from k3gen.ops.moe_experts.spec import *  # noqa: F401,F403
