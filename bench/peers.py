"""The peers the cases time in the same run: FLA's KDA kernels and cuBLASLt block FP8 through
torch._scaled_mm. Each returns None when the package or shape is unavailable, so a missing peer
leaves its columns empty instead of losing our rows."""
from __future__ import annotations


def fla_kda():
    """FLA's recurrent KDA op and the unfused chain's pieces, or None when fla is not installed."""
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception:  # noqa: BLE001  (any import failure: the peer columns are left out)
        return None
    return fused_recurrent_kda_fwd, causal_conv1d_update, rms_norm_gated


def fla_kda_sets(B: int, H: int, state_dtype, n: int, chain: bool, gen):
    """Inputs of FLA's decode call with Kimi settings (as /work/shared/anchors/decode_anchors.py)."""
    import torch
    K = 128
    bf, dev = torch.bfloat16, "cuda"
    a_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(H * K, device=dev, generator=gen) * 0.5
    sets = []
    for _ in range(n):
        s = {name: torch.randn(B, 1, H, K, device=dev, dtype=bf, generator=gen) for name in ("q", "k", "v", "g")}
        s["beta"] = torch.randn(B, 1, H, device=dev, dtype=bf, generator=gen)
        s["pool"] = (torch.randn(B, H, K, K, device=dev, generator=gen) * 0.05).to(state_dtype)
        s["idx"] = torch.randperm(B, device=dev, generator=gen).to(torch.int32)
        s["out"] = torch.empty(B, 1, H, K, device=dev, dtype=bf)
        s["kw"] = dict(A_log=a_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                       use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
        if chain:
            D = H * K
            s["x"] = [torch.randn(B, D, device=dev, dtype=bf, generator=gen) for _ in range(3)]
            s["cache"] = [torch.randn(B, D, 4, device=dev, dtype=bf, generator=gen) * 0.5 for _ in range(3)]
            s["cw"] = [torch.randn(D, 4, device=dev, dtype=bf, generator=gen) * 0.5 for _ in range(3)]
            s["gate"] = torch.randn(B, 1, H, K, device=dev, dtype=bf, generator=gen)
            s["nw"] = torch.ones(K, device=dev, dtype=bf)
        sets.append(s)
    return sets


def scaled_mm_block(xc, xs, wc, ws):
    """cuBLASLt block-scaled FP8 through torch._scaled_mm (1x128 activation, 128x128 weight
    scales), or None when this torch/cuBLASLt rejects the shapes (M = 1 among them)."""
    import torch
    a = xc.view(torch.float8_e4m3fn)
    b = wc.view(torch.float8_e4m3fn).t()
    for sa, sb in ((xs.t().contiguous().t(), ws.t()), (xs, ws), (xs.t().contiguous().t(), ws.t().contiguous())):
        try:
            torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
            return lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
        except Exception:  # noqa: BLE001  (unsupported layout or shape: try the next, else no peer)
            continue
    return None


def fla_chunk_kda():
    """FLA's chunked KDA (the prefill peer), or None when fla is not installed."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # noqa: BLE001
        return None
    return chunk_kda
