"""Issue 30, on the CPU: does the FP8 KV cache turn small rounding differences upstream of it into
larger logit errors than the BF16 cache does? The small model of tests/gpu/test_model_chunked_prefill.py
on the reference path, prompt cut at 37; every BF16 output of a projection moved by one BF16 ulp (up or
down) with probability `rate` (what another sum order does), against the reference's own floor
(its FP8 projections summed in FP32), for BF16 and FP8 KV.

    python tools/diag_fp8_flips.py [N]     (N prompt tokens, default 300; ~2 minutes on 2 cores)
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from helpers import logits_errors, reference_projections_in_fp32  # noqa: E402
from model.cache import HybridCache  # noqa: E402
from model.checkpoint import write_random_checkpoint  # noqa: E402
from model.config import TargetConfig, small_config  # noqa: E402
from model.model import K3Model  # noqa: E402
from model.ops import RefOps  # noqa: E402
from model.weights import load_weights  # noqa: E402

CFG = small_config()
CUTS = (37,)
RATES = (0.01, 0.1, 0.3)


def run(weights, kv: str, n: int) -> torch.Tensor:
    t = TargetConfig(kv=kv, ssm="fp32", max_drafts=3, path="reference")
    m = K3Model(weights, t, HybridCache(CFG, t, num_slots=2, num_pages=20, max_seq_len=512, device="cpu"))
    b = [0, *CUTS, n]
    seq = torch.randint(0, CFG.vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    out = torch.cat([m.prefill([0], [seq[x:y]], all_logits=True, resume=x > 0) for x, y in zip(b, b[1:])])
    m.release([0])
    return out.float()


def flipping(real, rate: float, seed: int):
    """RefOps.linear whose BF16 outputs move by one ulp (either way) with probability `rate`."""
    g = torch.Generator().manual_seed(seed)

    def linear(self, *a, **k):
        y = real(self, *a, **k)
        if y.dtype != torch.bfloat16:
            return y
        bits = y.view(torch.int16)
        pick = (torch.rand(y.shape, generator=g) < rate) & (y != 0) & torch.isfinite(y)
        step = torch.where(torch.rand(y.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
        return torch.where(pick, bits + step, bits).view(torch.bfloat16)
    return linear


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 300
    d = Path(tempfile.mkdtemp(prefix="k3gen-fp8-flips-"))
    write_random_checkpoint(CFG, d, seed=11)
    weights = load_weights(d, CFG)
    real = RefOps.linear
    for kv in ("bf16", "fp8"):
        t0 = time.time()
        want = run(weights, kv, n)
        with reference_projections_in_fp32():
            f = logits_errors(run(weights, kv, n), want)
        print(f"{kv} KV: floor rel {f['rel']:.4f} median {f['median']:.4f} ({time.time() - t0:.0f} s)", flush=True)
        for rate in RATES:
            RefOps.linear = flipping(real, rate, 1)
            try:
                e = logits_errors(run(weights, kv, n), want)
            finally:
                RefOps.linear = real
            print(f"  ulp flips at {rate}: rel {e['rel']:.4f} ({e['rel'] / f['rel']:.2f}x floor)  median "
                  f"{e['median']:.4f} ({e['median'] / f['median']:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
