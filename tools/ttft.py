"""Time to first token of a model preset on the GPU kernel path: the prefill of one prompt (every
layer, the LM head of its last token) timed on the host after a synchronize, after a warm-up
prefill, median of
`--reps` runs, plus what ran outside generated kernels (the ops record's `torch:` entries).

    K3GEN_PREBUILT=build-out K3GEN_DISABLE_JIT=1 python3 tools/ttft.py --tokens 4096 --kv bf16
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import torch

    from model.generate import build_model
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv", default="bf16", choices=["bf16", "fp8", "nvfp4"])
    ap.add_argument("--ssm", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--path", default="kernel", choices=["kernel", "reference"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path, help="append the result as one JSON line to this file")
    a = ap.parse_args(argv)
    m = build_model(a.config, "sm90", a.kv, a.ssm, 0, a.path, None, 0, a.device, a.tokens + 8, 1)
    gen = torch.Generator().manual_seed(0)
    vocab = m.cfg.vocab
    prompt = torch.randint(0, vocab, (a.tokens,), generator=gen).tolist()
    m.prefill([0], [prompt[:64]])      # loads every kernel the prefill uses
    m.release([0])
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    sync()
    m.ops.ran.clear()
    times = []
    for rep in range(a.reps):
        t0 = time.perf_counter()
        m.prefill([rep + 1], [prompt])
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        m.release([rep + 1])
    outside = sorted(k for k in m.ops.ran if k.startswith("torch:"))
    res = {"config": a.config, "tokens": a.tokens, "kv": a.kv, "ssm": a.ssm, "median_ms": statistics.median(times),
           "times_ms": times, "torch_ops": outside}
    print(f"TTFT {a.config} T{a.tokens} kv {a.kv} ssm {a.ssm}: median {res['median_ms']:.2f} ms "
          f"({', '.join(f'{t:.2f}' for t in times)}); outside kernels: {', '.join(outside) or 'none'}")
    if a.json:
        with a.json.open("a") as f:
            f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
