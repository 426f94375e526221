"""Isolate a kda_decode launch failure seen in the benchmark: run the bench's inputs eagerly and
under graph replay for a few shapes, syncing after each stage so the failing stage is named."""
import sys

import torch

from k3gen.ir.dtypes import SsmDtype
from k3gen.ir.ops.kda_decode import KdaDecodeSpec
from k3gen.reference.kda_decode import random_weights
from k3gen.runtime.ops.kda_decode import KdaDecode
from k3gen.targets import get_target

K = 128
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
nsets = int(sys.argv[2]) if len(sys.argv) > 2 else 8
for H, B, split in [(12, 1, 8), (12, 1, 1), (12, 1, 2), (12, 1, 4), (12, 8, 4), (12, 128, 1)]:
    op = KdaDecode(KdaDecodeSpec(target=get_target("sm90"), heads=H, ssm=SsmDtype.FP32)).load()
    w = random_weights(H, generator=torch.Generator().manual_seed(H)).to("cuda")
    D = H * K
    sets = []
    for _ in range(nsets):
        fab = torch.randn(B, K + H, device="cuda").to(torch.bfloat16)
        sets.append(dict(qkvg=torch.randn(B, 4 * D, device="cuda").to(torch.bfloat16), fa=fab[:, :K],
                         beta_logit=fab[:, K:], ssm=torch.randn(B, H, K, K, device="cuda") * 0.05,
                         conv=torch.randn(B, 3 * D, 3, device="cuda").to(torch.bfloat16),
                         slots=torch.randperm(B, device="cuda").to(torch.int32),
                         out=torch.empty(B, H, K, device="cuda", dtype=torch.bfloat16)))

    def call(s):
        op(s["qkvg"], s["fa"], s["beta_logit"], s["ssm"], s["conv"], s["slots"], w.conv_w, w.fb_w, w.dt_bias,
           w.a_log, w.norm_w, s["out"], split=split)
    stage = "eager"
    try:
        for i in range(reps):
            for s in sets:
                call(s)
            torch.cuda.synchronize()
        stage = "graph"
        g = torch.cuda.CUDAGraph()
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st), torch.cuda.graph(g, stream=st):
            for s in sets:
                call(s)
        torch.cuda.current_stream().wait_stream(st)
        for i in range(reps):
            g.replay()
            torch.cuda.synchronize()
        fin = all(torch.isfinite(s["out"].float()).all().item() for s in sets)
        print(f"H{H} B{B} split{split}: ok ({reps} x {nsets} eager + graph), finite={fin}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"H{H} B{B} split{split}: FAILED at {stage}: {e}", flush=True)
        break
