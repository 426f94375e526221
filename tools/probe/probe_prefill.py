"""Per-tile SM clock64 stamps (both warpgroups of a CTA share one SM clock; %globaltimer ticks
too coarsely for ~1 us phases) of mla_prefill's wgmma_pp consumers: how a warpgroup's period splits
between waiting for its turn and stages, its GEMMs and its softmax, and whether the two warpgroups'
softmaxes overlap (FA3's pingpong wants each one's softmax under the other's GEMMs).
Stamps per (CTA < 256, warpgroup c, tile it < 32): 5 loop top, 6 stages landed, 0 turn taken, 1 QK(it)
and PV(it - 1) issued, 2 QK done, 3 softmax done, 4 PV done; tile 0 is not stamped. Phases: pack (4 of
it - 1 to 5), stage_wait (5 to 6), turn_wait (6 to 0), issue, qk_wait, softmax, pv_wait; period = 0 to
the next 0. Per CTA (slot 32): entry, %smid, consumer start (Q copied), first QK done, last PV done,
output stored: the prologue, the first tile, the epilogue, and the gap between one CTA's end and the
next CTA's entry on the same SM (what a persistent kernel would hide). Cases: H96 / H12 x T4096, H96 8 x 1024.

Runs in a probe tree only: a copy of main (`git archive HEAD`) with tools/probe/prefill_globaltimer.patch
applied (`patch -p0`) and its own bundle (`tools/prebuild_gpu.py ../bProbeP --ops mla_prefill`); then
on the GPU, from the probe tree:
    PYTHONPATH=$PWD K3GEN_PREBUILT=$PWD/../bProbeP python3 tools/probe/probe_prefill.py"""
import ctypes
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))   # the probe tree

import torch
from cuda.bindings import driver

from bench.cases.mla_prefill import prefill_inputs
from k3gen.ops.mla_prefill.launcher import MlaPrefill
from k3gen.ops.mla_prefill.spec import MlaPrefillSpec, OutDtype, PrefillKernel
from k3gen.targets import get_target

N = 1 << 17


def probe(kern, dev, clear=False):
    kern.function(dev)
    err, dptr, size = driver.cuModuleGetGlobal(kern._modules[dev], b"k3gen_probe")
    if clear:
        driver.cuMemsetD8(dptr, 0, N * 8)
        return None
    buf = (ctypes.c_ulonglong * N)()
    driver.cuMemcpyDtoH(ctypes.addressof(buf), dptr, N * 8)
    return list(buf)


def med(xs):
    return round(statistics.median(xs), 3) if xs else None


dev = torch.cuda.current_device()
gen = torch.Generator(device="cuda").manual_seed(0)
mhz = driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, dev)[1] / 1000
us = lambda a, b: (b - a) / mhz   # at the rated clock; ratios between phases are exact
W = 33 * 7                         # stamps per (CTA, warpgroup): 32 tile slots + the CTA slot, 7 each


def slot(P, cta, c, t):
    o = (cta * 2 + c) * W + t * 7
    return P[o:o + 7]


for H, B, T in ((96, 1, 4096), (12, 1, 4096), (96, 8, 1024)):
    spec = MlaPrefillSpec(target=get_target("sm90"), heads=H, out_dtype=OutDtype.BF16, kernel=PrefillKernel.WGMMA_PP)
    op = MlaPrefill(spec).load()
    N = B * T
    x = prefill_inputs(H, B, T, gen, n_sets=1)[0]
    cu = torch.arange(0, N + 1, T, device="cuda", dtype=torch.int32)
    out = torch.empty(N, H, 128, device="cuda", dtype=torch.bfloat16)
    run = lambda: op(x["q"], x["kn"], x["kp"], x["v"], cu, cu, out, T, heads_fast=spec.heads_fast(N))
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    probe(op.kernel, dev, clear=True)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); run(); e1.record(); torch.cuda.synchronize()
    P = probe(op.kernel, dev)
    ph = {k: [] for k in ("pack", "stage_wait", "turn_wait", "issue", "qk_wait", "softmax", "pv_wait", "period")}
    overlap = []   # fraction of warpgroup 0's softmax during which warpgroup 1 is also in its softmax
    cta_ph = {k: [] for k in ("prologue", "first_tile", "epilogue", "launch_gap", "tiles")}
    by_sm = {}
    for cta in range(256):
        rows = {}
        for c in range(2):
            for it in range(1, 31):   # slot 31 may hold later tiles
                st = slot(P, cta, c, it)
                if all(st):
                    rows[(c, it)] = st
        for (c, it), st in rows.items():
            ph["issue"].append(us(st[0], st[1])); ph["qk_wait"].append(us(st[1], st[2]))
            ph["softmax"].append(us(st[2], st[3])); ph["pv_wait"].append(us(st[3], st[4]))
            ph["stage_wait"].append(us(st[5], st[6])); ph["turn_wait"].append(us(st[6], st[0]))
            nxt = rows.get((c, it + 1))
            if nxt:
                ph["pack"].append(us(st[4], nxt[5])); ph["period"].append(us(st[0], nxt[0]))
            if c == 0 and st[3] > st[2]:
                both = sum(max(0, min(st[3], o[3]) - max(st[2], o[2]))
                           for o in (rows.get((1, j)) for j in (it - 1, it, it + 1)) if o)
                overlap.append(both / (st[3] - st[2]))
        a, b = slot(P, cta, 0, 32), slot(P, cta, 1, 32)
        if all(a[i] and b[i] for i in (0, 2, 3, 4, 5)):
            cta_ph["prologue"].append(us(a[0], a[2])); cta_ph["first_tile"].append(us(a[2], a[3]))
            cta_ph["epilogue"].append(us(max(a[4], b[4]), max(a[5], b[5])))
            cta_ph["tiles"].append(us(a[3], max(a[4], b[4])))
        if a[0]:
            by_sm.setdefault(a[1], []).append((a[0], max(a[5], b[5])))
    for runs in by_sm.values():
        runs.sort()
        for (s0, e0_), (s1, _) in zip(runs, runs[1:]):
            if e0_:
                cta_ph["launch_gap"].append(us(e0_, s1))
    res = {"H": H, "B": B, "T": T, "kernel_us": round(e0.elapsed_time(e1) * 1000, 1), "mhz": mhz,
           **{k: med(v) for k, v in ph.items()}, "samples": len(ph["softmax"]),
           "softmax_overlap": med(overlap), **{"cta_" + k: med(v) for k, v in cta_ph.items()},
           "ctas": len(cta_ph["prologue"]), "gaps": len(cta_ph["launch_gap"])}
    print("PROBE " + json.dumps(res), flush=True)
