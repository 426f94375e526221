"""router_logits: the MoE router's FP32 logits of the BF16 FFN input rows (the sigmoid router's
input, before moe_route)."""
from k3gen.ops.router_logits import spec, variants  # noqa: F401
