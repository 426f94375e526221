"""One module per fused op; importing this package registers them all."""
from . import kv_cache_write  # noqa: F401
from . import act_quant_fp8  # noqa: F401
from . import kda_decode  # noqa: F401
from . import fp8_block_gemm  # noqa: F401
from . import kda_verify  # noqa: F401
from . import kda_prefill  # noqa: F401
from . import mla_q_absorb  # noqa: F401
from . import mla_vb_gate  # noqa: F401
from . import mla_decode  # noqa: F401
