"""Launch kda_decode on a few bench shapes for `ncu` (no timing here; ncu measures)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench/ and k3gen/

import torch

from k3gen.ir.dtypes import SsmDtype
from k3gen.ops.kda_decode.spec import KdaDecodeSpec
from k3gen.ops.kda_decode.reference import random_weights
from k3gen.ops.kda_decode.launcher import KdaDecode
from k3gen.targets import get_target

K = 128
shapes = [(12, 128, SsmDtype.FP32), (12, 512, SsmDtype.BF16), (12, 1, SsmDtype.FP32)]
if len(sys.argv) > 1:
    shapes = shapes[: int(sys.argv[1])]
for H, B, ssm in shapes:
    op = KdaDecode(KdaDecodeSpec(target=get_target("sm90"), heads=H, ssm=ssm)).load()
    w = random_weights(H, generator=torch.Generator().manual_seed(H)).to("cuda")
    D = H * K
    sdt = torch.float32 if ssm is SsmDtype.FP32 else torch.bfloat16
    fab = torch.randn(B, K + H, device="cuda").to(torch.bfloat16)
    args = (torch.randn(B, 4 * D, device="cuda").to(torch.bfloat16), fab[:, :K], fab[:, K:],
            (torch.randn(B, H, K, K, device="cuda") * 0.05).to(sdt),
            torch.randn(B, 3 * D, 3, device="cuda").to(torch.bfloat16),
            torch.randperm(B, device="cuda").to(torch.int32), w.conv_w, w.fb_w, w.dt_bias, w.a_log, w.norm_w,
            torch.empty(B, H, K, device="cuda", dtype=torch.bfloat16))
    for _ in range(4):
        op(*args)
    torch.cuda.synchronize()
    print(f"H{H} B{B} {ssm.value}: split {op.split_for(B)}", flush=True)
