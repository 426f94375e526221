"""attn_res: the contract is spec.py; the kernels are variants.py."""
from k3gen.ops.attn_res import variants as _variants  # noqa: F401  (attaches the variant table)
from k3gen.ops.attn_res.spec import *  # noqa: F401,F403
