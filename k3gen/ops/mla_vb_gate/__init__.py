"""mla_vb_gate: the contract is spec.py; the kernels are variants.py."""
from k3gen.ops.mla_vb_gate import variants as _variants  # noqa: F401  (attaches the variant table)
from k3gen.ops.mla_vb_gate.spec import *  # noqa: F401,F403
