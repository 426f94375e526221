"""One leg of an A/B of mla_decode trees: times the BF16 wgmma_qm and the FP8 and NVFP4 wgmma
kernels (H12 T1, B32 and B128, L8K, graph-timed by bench.cases.mla_decode) of the k3gen tree in the
current directory and prints one `AB {json}` line per case (tag, case, median us, % of the same
run's copy ceiling).

A variant is a copy of the tree (`git archive HEAD | tar -x -C xV`, then the change) with its own
bundle (`cd xV && python tools/prebuild_gpu.py ../bV --ops mla_decode,kv_cache_write,mla_prefill`:
a header edit changes the inputs digest of every op that reaches it). On the GPU, legs alternate
in one call, each in its own process:

    (cd xV && PYTHONPATH=$PWD K3GEN_PREBUILT=../bV:../build-out python3 tools/ab_mla.py V)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))


def main(argv: list[str]) -> int:
    from bench.cases.mla_decode import _kv_formats, mla_decode
    from bench.harness import copy_ceiling_tbps
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    from k3gen.targets import get_target
    tag = argv[0] if argv else Path.cwd().name
    tgt = get_target("sm90")
    specs = [MlaDecodeSpec(target=tgt, heads=12, schedule="wgmma_qm")] + [
        MlaDecodeSpec(target=tgt, heads=12, kv=kv, schedule="wgmma", **kw) for kv, kw in _kv_formats()[1:]]
    ceil = copy_ceiling_tbps()
    for r in mla_decode(ceil, specs=specs, batches=(32, 128), lengths=(8192,), op_name="ab"):
        print("AB " + json.dumps({"tag": tag, "case": r.case, "us": round(r.us, 2), "pct_copy": round(r.pct_copy, 1),
                                  "ceiling": round(ceil, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
