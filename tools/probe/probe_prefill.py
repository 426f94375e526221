"""Per-tile SM clock64 stamps (both warpgroups of a CTA share one SM clock; %globaltimer ticks
too coarsely for ~1 us phases) of mla_prefill's wgmma_pp consumers: how a warpgroup's period splits
between waiting for its turn and stages, its GEMMs and its softmax, and whether the two warpgroups'
softmaxes overlap (FA3's pingpong wants each one's softmax under the other's GEMMs).
Stamps per (CTA < 256, warpgroup c, tile it < 32): 5 loop top, 6 stages landed, 0 turn taken, 1 QK(it)
and PV(it - 1) issued, 2 QK done, 3 softmax done, 4 PV done; tile 0 is not stamped. Phases: pack (4 of
it - 1 to 5), stage_wait (5 to 6), turn_wait (6 to 0), issue, qk_wait, softmax, pv_wait; period = 0 to
the next 0.

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
for H, T in ((96, 4096), (12, 4096)):
    spec = MlaPrefillSpec(target=get_target("sm90"), heads=H, out_dtype=OutDtype.BF16, kernel=PrefillKernel.WGMMA_PP)
    op = MlaPrefill(spec).load()
    x = prefill_inputs(H, 1, T, gen, n_sets=1)[0]
    cu = torch.tensor([0, T], device="cuda", dtype=torch.int32)
    out = torch.empty(T, H, 128, device="cuda", dtype=torch.bfloat16)
    run = lambda: op(x["q"], x["kn"], x["kp"], x["v"], cu, cu, out, T, heads_fast=spec.heads_fast(T))
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    probe(op.kernel, dev, clear=True)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); run(); e1.record(); torch.cuda.synchronize()
    P = probe(op.kernel, dev)
    mhz = driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, dev)[1] / 1000
    us = lambda a, b: (b - a) / mhz   # at the rated clock; ratios between phases are exact
    ph = {k: [] for k in ("pack", "stage_wait", "turn_wait", "issue", "qk_wait", "softmax", "pv_wait", "period")}
    overlap = []   # fraction of warpgroup 0's softmax during which warpgroup 1 is also in its softmax
    for cta in range(256):
        rows = {}
        for c in range(2):
            for it in range(1, 31):   # slot 31 may hold later tiles
                s = P[((cta * 2 + c) * 32 + it) * 7:((cta * 2 + c) * 32 + it) * 7 + 7]
                if all(s):
                    rows[(c, it)] = s
        for (c, it), s in rows.items():
            ph["issue"].append(us(s[0], s[1])); ph["qk_wait"].append(us(s[1], s[2]))
            ph["softmax"].append(us(s[2], s[3])); ph["pv_wait"].append(us(s[3], s[4]))
            ph["stage_wait"].append(us(s[5], s[6])); ph["turn_wait"].append(us(s[6], s[0]))
            nxt = rows.get((c, it + 1))
            if nxt:
                ph["pack"].append(us(s[4], nxt[5])); ph["period"].append(us(s[0], nxt[0]))
            if c == 0 and s[3] > s[2]:
                both = sum(max(0, min(s[3], o[3]) - max(s[2], o[2]))
                           for o in (rows.get((1, j)) for j in (it - 1, it, it + 1)) if o)
                overlap.append(both / (s[3] - s[2]))
    res = {"H": H, "T": T, "kernel_us": round(e0.elapsed_time(e1) * 1000, 1),
           **{k: med(v) for k, v in ph.items()}, "samples": len(ph["softmax"]),
           "softmax_overlap": med(overlap)}
    print("PROBE " + json.dumps(res), flush=True)
