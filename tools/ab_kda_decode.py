"""Time kda_decode on chosen shapes with whatever cubins K3GEN_PREBUILT points at (H200 A/B runs).

Usage: python tools/ab_kda_decode.py LABEL [H:B:ssm ...]; prints one JSON line per case with the
bench's method (graph replay over rotated cold input sets, median per launch), PDL and L2 warming on and off.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench/ and k3gen/

import torch

from bench.harness import copy_time_us, sets_for, time_graph
from k3gen.ir.dims import evaluate
from k3gen.ir.dtypes import SsmDtype
from k3gen.ops.kda_decode.spec import KdaDecodeSpec
from k3gen.ops.kda_decode.reference import random_weights
import k3gen.ops.kda_decode.launcher as kda_mod
from k3gen.ops.kda_decode.launcher import KdaDecode
from k3gen.targets import get_target

label = sys.argv[1]
cases = sys.argv[2:] or ["12:1:fp32", "24:1:fp32", "12:1:bf16", "24:1:bf16", "12:128:fp32", "12:512:bf16"]
K = 128
gen = torch.Generator(device="cuda").manual_seed(0)
for case in cases:
    H, B, ssm = case.split(":")
    H, B, ssm = int(H), int(B), SsmDtype(ssm)
    sdt = torch.float32 if ssm is SsmDtype.FP32 else torch.bfloat16
    op = KdaDecode(KdaDecodeSpec(target=get_target("sm90"), heads=H, ssm=ssm)).load()
    w = random_weights(H, generator=torch.Generator().manual_seed(H)).to("cuda")
    D = H * K
    nbytes = evaluate(op.spec.bytes_moved(), B=B)
    sets = []
    for _ in range(sets_for(nbytes)):
        fab = torch.randn(B, K + H, device="cuda", generator=gen).to(torch.bfloat16)
        sets.append((torch.randn(B, 4 * D, device="cuda", generator=gen).to(torch.bfloat16), fab[:, :K], fab[:, K:],
                     (torch.randn(B, H, K, K, device="cuda", generator=gen) * 0.05).to(sdt),
                     torch.randn(B, 3 * D, 3, device="cuda", generator=gen).to(torch.bfloat16),
                     torch.randperm(B, device="cuda", generator=gen).to(torch.int32)))
    out = torch.empty(B, H, K, device="cuda", dtype=torch.bfloat16)

    def launches(pdl, warm, ahead, schedule=None, split=None):
        return [lambda s=s: op(*s, w.conv_w, w.fb_w, w.dt_bias, w.a_log, w.norm_w, out, pdl=pdl, warm=warm,
                               ahead=ahead, schedule=schedule, split=split) for s in sets]

    res = {"label": label, "case": case, "bytes": nbytes, "schedule": op.schedule_for(B, sets[0][0], sets[0][4]),
           "split": op.split_for(B)}
    grid = os.environ.get("GRID", "full") == "full"
    for pdl, warm, ahead in (((1, 0, 0), (1, 1, 0), (1, 1, 1), (1, 0, 1), (1, 0, 0), (1, 1, 0), (1, 1, 1), (0, 0, 0),
                              (0, 0, 1)) if grid else ((1, 0, 0), (1, 0, 1))):
        key = f"{'pdl' if pdl else 'nopdl'}_w{warm}a{ahead}"
        res.setdefault(key, []).append(round(time_graph(launches(bool(pdl), bool(warm), bool(ahead), "rows"), reps=60), 3))
    # AHEAD=2,3: also time the row kernel warming that many waves ahead (the launcher warms one)
    for m in filter(None, os.environ.get("AHEAD", "").split(",")):
        real = kda_mod.choose_warming
        kda_mod.choose_warming = lambda c, r, *a, m=int(m): (0, m * r)
        res[f"ahead_x{m}"] = round(time_graph(launches(True, None, None, "rows"), reps=60), 3)
        kda_mod.choose_warming = real
    for sp in filter(None, os.environ.get("SPLITS", "").split(",")):   # SPLITS=2,4: forced row splits
        res[f"split{sp}"] = round(time_graph(launches(True, None, None, "rows", int(sp)), reps=60), 3)
    if B * H >= 264:
        for warm in (0, 1):
            res[f"stream_w{warm}"] = round(time_graph(launches(True, bool(warm), False, "stream"), reps=60), 3)
    res["copy_same_us"] = round(copy_time_us(nbytes), 3)
    print(json.dumps(res), flush=True)
    del sets
    torch.cuda.empty_cache()
