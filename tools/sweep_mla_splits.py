"""Split-count sweep of mla_decode at small batches (H200): the time per launch (graph replay over
rotated cache sets, bench.time_graph) for explicit split counts next to MlaDecode.plan's choice.
Usage on the device: python3 tools/sweep_mla_splits.py [B ...] (prints JSON lines)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench/ and k3gen/

import torch

from bench.harness import time_graph
from bench.cases.mla_decode import _random_cache
from k3gen.ir.dtypes import KvDtype
from k3gen.ops.mla_decode.spec import MlaDecodeSpec
from k3gen.ops.mla_decode.launcher import MlaDecode
from k3gen.targets import get_target

tgt = get_target("sm90")
batches = [int(x) for x in sys.argv[1:]] or [1, 4]
for kv, kw in ((KvDtype.BF16, {}), (KvDtype.FP8, {}), (KvDtype.NVFP4, {"max_drafts": 3})):
    op = MlaDecode(MlaDecodeSpec(target=tgt, heads=12, kv=kv, **kw)).load()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for B in batches:
        for L in (8192, 32768):
            pages = L // op.spec.page
            sets = [(_random_cache(op.spec, B * pages, B, gen),
                     torch.randperm(B * pages, device="cuda", generator=gen).to(torch.int32).view(B, pages))
                    for _ in range(3)]
            lengths = torch.full((B,), L, dtype=torch.int32, device="cuda")
            ring = torch.arange(B, dtype=torch.int32, device="cuda")
            q = (torch.randn(B, 1, 12, 576, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
            out = torch.empty(B, 1, 12, 512, dtype=torch.bfloat16, device="cuda")
            chosen = op.plan(B, L).splits
            res = {}
            for n in sorted({8, 16, 32, 48, 64, 96, 128, chosen}):
                if n * 2 > L // 64:
                    continue
                plan = op.plan(B, L, splits=n)
                res[n] = round(time_graph([lambda s=s: op(q, s[0], s[1], lengths, out, ring_slot=ring, scale=89.6,
                                                          plan=plan) for s in sets]), 2)
            print(json.dumps({"kv": kv.value, "schedule": op.spec.schedule, "B": B, "L": L, "chosen": chosen,
                              "us": res}), flush=True)
