"""act_quant_fp8: per-token per-128 FP8 activation quantization (`python -m bench --op act_quant_fp8`)."""
from __future__ import annotations

from bench.harness import case, make_row, sets_for, time_graph
from k3gen.ir.dims import evaluate


@case
def act_quant_fp8(ceiling: float, quick: bool = False) -> list:
    """Per-token per-128 FP8 activation quantization (CuTe DSL kernel), K = 7168 and 1536."""
    import torch

    from k3gen.ir.dtypes import ScaleRecipe
    from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec
    from k3gen.ops.act_quant_fp8.launcher import ActQuantFp8
    from k3gen.targets import get_target

    rows, same = [], {}
    for k in (7168,) if quick else (7168, 1536):
        for recipe in ScaleRecipe:
            op = ActQuantFp8(ActQuantFp8Spec(target=get_target("sm90"), k=k, recipe=recipe)).load()
            sdt = torch.float32 if recipe is ScaleRecipe.FP32 else torch.uint8
            for m in (1, 128, 4096) if quick else (1, 16, 128, 1024, 4096, 16384):
                nbytes = evaluate(op.spec.bytes_moved(), M=m)
                sets = [(torch.randn(m, k, device="cuda").to(torch.bfloat16),
                         torch.empty(m, k, dtype=torch.uint8, device="cuda"),
                         torch.empty(m, k // 128, dtype=sdt, device="cuda")) for _ in range(sets_for(nbytes))]
                us = time_graph([lambda s=s: op(*s) for s in sets])
                rows.append(make_row("act_quant_fp8", f"K{k} M{m} {recipe.value}", us, nbytes, ceiling, same))
                del sets
    return rows
