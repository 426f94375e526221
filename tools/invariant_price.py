"""The price of TargetConfig.invariant (issue 27) on the GPU kernel path: a decode step and a verify
step of the small preset replayed from their CUDA graphs at several batch sizes, with the default
split plan and with the invariant one (splits fixed per step length, verify attention per query
token), median of `--reps` replays timed by CUDA events, in one process so both run on the same GPU
state.

    K3GEN_PREBUILT=build-out K3GEN_DISABLE_JIT=1 python3 tools/invariant_price.py --kv bf16
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step_times(invariant: bool, a, batches) -> dict:
    import torch

    from model.cache import HybridCache
    from model.config import TargetConfig, get_config
    from model.generate import DecodeGraphs, load_rank_weights, random_checkpoint
    from model.model import K3Model
    cfg = get_config(a.config)
    t = TargetConfig(kv=a.kv, ssm=a.ssm, max_drafts=a.drafts, path="kernel", invariant=invariant)
    slots = max(batches)
    pages = slots * -(-(a.context + a.drafts + 8) // t.kv_layout().page)
    cache = HybridCache(cfg, t, slots, pages, a.context + 8, "cuda")
    w = load_rank_weights(random_checkpoint(cfg, 0)[0], cfg, t.recipe, None, "cuda")
    m = K3Model(w, t, cache)
    g = torch.Generator().manual_seed(0)
    ids = list(range(slots))
    m.prefill(ids, [torch.randint(0, cfg.vocab, (a.context - 4 * i,), generator=g).tolist() for i in ids])
    out = {}
    for T in (1, 1 + a.drafts):
        graphs = DecodeGraphs(m, T)
        graphs.capture()
        for B in batches:
            slots_t = torch.tensor([cache.mgr.entry(s).slot for s in ids[:B]], dtype=torch.int32, device="cuda")
            start = torch.tensor([cache.mgr.entry(s).length for s in ids[:B]], dtype=torch.int32, device="cuda")
            tokens = torch.zeros(B * T, dtype=torch.long, device="cuda")
            for _ in range(3):
                graphs.run(tokens, slots_t, start)
            ts = []
            for _ in range(a.reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graphs.run(tokens, slots_t, start)
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e3)
            out[f"T{T}_B{B}"] = statistics.median(ts)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small")
    ap.add_argument("--kv", default="bf16", choices=["bf16", "fp8", "nvfp4"])
    ap.add_argument("--ssm", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence before the steps")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    res = {"default": step_times(False, a, batches), "invariant": step_times(True, a, batches)}
    for k in res["default"]:
        d, i = res["default"][k], res["invariant"][k]
        print(f"{a.config} kv {a.kv} ssm {a.ssm} {k}: default {d:.1f} us, invariant {i:.1f} us ({i / d:.3f}x)")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
