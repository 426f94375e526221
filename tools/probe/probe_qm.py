"""Per-CTA %globaltimer stamps of the BF16 wgmma_qm mla_decode: where B32 L8K's fixed cost goes
(bench/notes/mla_decode_2.md). Stamps: 0 entry, 1 Q staged, 2 first tile in (S), 3 S loop done,
6 O loop done, 4 partial stored; combine: resident, after griddep_wait, done.

Runs in a probe tree only: a copy of main (`git archive HEAD`; the patch was made against 38614b3,
whose mla_decode template and wgmma_qm header main still has) with tools/probe/qm_globaltimer.patch
applied (`patch -p0`) and its own bundle (`tools/prebuild_gpu.py ../bProbe --ops mla_decode`); then
on the GPU, from the probe tree:
    PYTHONPATH=$PWD K3GEN_PREBUILT=$PWD/../bProbe python3 tools/probe/probe_qm.py"""
import ctypes, json, sys
from pathlib import Path
sys.path.insert(0, str(Path.cwd()))   # the probe tree
import torch
from bench.cases.mla_decode import _random_cache
from k3gen.ops.mla_decode.spec import MlaDecodeSpec
from k3gen.ops.mla_decode.launcher import MlaDecode
from k3gen.targets import get_target
from cuda.bindings import driver

def read(kern, dev, n=16384):
    kern.function(dev)
    err, dptr, size = driver.cuModuleGetGlobal(kern._modules[dev], b"k3gen_probe")
    buf = (ctypes.c_ulonglong * n)()
    driver.cuMemcpyDtoH(ctypes.addressof(buf), dptr, n * 8)
    return list(buf)

def clear(kern, dev, n=16384):
    kern.function(dev)
    err, dptr, size = driver.cuModuleGetGlobal(kern._modules[dev], b"k3gen_probe")
    driver.cuMemsetD8(dptr, 0, n * 8)

op = MlaDecode(MlaDecodeSpec(target=get_target("sm90"), heads=12, schedule="wgmma_qm")).load()
gen = torch.Generator(device="cuda").manual_seed(0)
dev = torch.cuda.current_device()
for B, L, splits in [(32, 8192, None), (128, 8192, None), (32, 8192, 8), (32, 32768, None)]:
    pages = L // op.spec.page
    sets = [(_random_cache(op.spec, B * pages, B, gen),
             torch.randperm(B * pages, device="cuda", generator=gen).to(torch.int32).view(B, pages)) for _ in range(3)]
    lengths = torch.full((B,), L, dtype=torch.int32, device="cuda")
    ring = torch.arange(B, dtype=torch.int32, device="cuda")
    q = (torch.randn(B, 1, 12, 576, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    out = torch.empty(B, 1, 12, 512, dtype=torch.bfloat16, device="cuda")
    plan = op.plan(B, L, splits=splits)
    n = plan.splits
    for s in sets:
        op(q, s[0], s[1], lengths, out, ring_slot=ring, scale=89.6, plan=plan)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for s in sets * 3:
            op(q, s[0], s[1], lengths, out, ring_slot=ring, scale=89.6, plan=plan)
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
    per = e0.elapsed_time(e1) * 1000 / 9
    P = read(op.kernel, dev)
    ctas = op.geo.groups * n * B
    rows = [P[i * 8:i * 8 + 8] for i in range(ctas)]
    t0 = min(r[0] for r in rows)
    f = lambda k: sorted((r[k] - t0) / 1000 for r in rows)
    d = lambda a, b: sorted((r[b] - r[a]) / 1000 for r in rows)
    q_ = lambda xs: [round(xs[0], 2), round(xs[len(xs) // 2], 2), round(xs[-1], 2)]
    res = {"B": B, "L": L, "splits": n, "ctas": ctas, "graph_us_per_launch": round(per, 2),
           "entry": q_(f(0)), "q_staged": q_(d(0, 1)), "first_tile": q_(d(0, 2)), "s_loop": q_(d(2, 3)),
           "o_after_s": q_(d(3, 6)), "store": q_(d(3, 4)), "end": q_(f(4)),
           "sms": len({r[5] for r in rows})}
    if n > 1:
        C = read(op._combine, dev)
        cc = [C[8192 + i * 3: 8192 + i * 3 + 3] for i in range(12 * B)]
        res["combine_resident"] = q_(sorted((c[0] - t0) / 1000 for c in cc))
        res["combine_go"] = q_(sorted((c[1] - t0) / 1000 for c in cc))
        res["combine_done"] = q_(sorted((c[2] - t0) / 1000 for c in cc))
    print("PROBE " + json.dumps(res), flush=True)
    del sets
    torch.cuda.empty_cache()
