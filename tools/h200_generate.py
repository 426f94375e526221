"""On the GPU machine: `k3gen generate --config small` from a `k3gen build --model small --out DIR` bundle (no JIT),
for every KV/SSM dtype, with and without --spec and --graphs, in one process (the command line's own code path:
k3gen.cli.main). Greedy outputs of the four modes of one dtype pair must agree (graphs == eager, spec == greedy).
Then the same model from a checkpoint in each published layout (ModelOpt NVFP4 as nvidia/Kimi-K3-NVFP4, the
official compressed-tensors MXFP4 as moonshotai/Kimi-K3), written here by the project's writers and loaded by
`generate --checkpoint` (model/formats/detect.py): batch 1/2/4/8, eager vs CUDA graphs, graphs twice (deterministic).
Usage: K3GEN_PREBUILT=DIR K3GEN_DISABLE_JIT=1 python3 tools/h200_generate.py
"""
from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3gen.cli import main  # noqa: E402

MODES = {"eager": [], "spec3": ["--spec", "3"], "graphs": ["--graphs"], "spec3+graphs": ["--spec", "3", "--graphs"]}


def run(kv: str, ssm: str, extra: list[str], batch: int = 2) -> tuple[int, str]:
    buf = io.StringIO()
    argv = ["generate", "--config", "small", "--arch", "sm90", "--kv", kv, "--ssm", ssm, "--path", "kernel",
            "--prompt-ids", "5,6,7,5,6,7,5,6", "--batch", str(batch), "--max-new", "12", *extra]
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


def main_() -> int:
    bad = 0
    for kv in ("bf16", "fp8", "nvfp4"):
        for ssm in ("fp32", "bf16"):
            outs = {}
            for name, extra in MODES.items():
                rc, text = run(kv, ssm, extra)
                toks = re.findall(r"^\[\d+\] (.*)$", text, flags=re.M)
                outs[name] = toks
                print(f"{kv:5} {ssm:4} {name:12} rc={rc} {' | '.join(toks)}")
                if rc:
                    print(text[-2000:])
                    bad += 1
            if len({str(v) for v in outs.values()}) != 1:
                print(f"{kv} {ssm}: the modes disagree")
                bad += 1
    print(f"h200_generate: {24 - bad} of 24 runs good" if bad <= 24 else "h200_generate: failures")
    return (1 if bad else 0) | layouts()


def layouts() -> int:
    import tempfile

    from model.checkpoint import write_random_checkpoint
    from model.config import get_config
    from model.formats.ct_mxfp4 import write_official_checkpoint
    # Both published layouts, written here by the project's writers and detected by `generate --checkpoint`
    # (model/formats/detect.py): ModelOpt NVFP4 (nvidia/Kimi-K3-NVFP4) and the official compressed-tensors
    # MXFP4 (moonshotai/Kimi-K3, experts kept packed as MXFP4).
    writers = {"nvfp4-modelopt": write_random_checkpoint,
               "mxfp4-compressed-tensors": lambda cfg, d, seed: write_official_checkpoint(cfg, d, seed=seed, shards=4)}
    cfg, bad, n = get_config("small"), 0, 0
    for name, write in writers.items():
        d = Path(tempfile.mkdtemp(prefix=f"k3gen-{name}-"))
        write(cfg, d, seed=11)
        for batch in (1, 2, 4, 8):
            outs = {}
            for mode, extra in (("eager", []), ("graphs", ["--graphs"]), ("graphs2", ["--graphs"])):
                rc, text = run("nvfp4", "bf16", ["--checkpoint", str(d), *extra], batch=batch)
                toks = re.findall(r"^\[\d+\] (.*)$", text, flags=re.M)
                outs[mode] = toks
                n += 1
                print(f"{name:25} B{batch} {mode:8} rc={rc} {' | '.join(toks[:2])}")
                if rc or len(toks) != batch:
                    print(text[-2000:])
                    bad += 1
            if len({str(v) for v in outs.values()}) != 1:
                print(f"{name} B{batch}: eager / graphs / graphs again disagree")
                bad += 1
    print(f"h200_generate layouts: {n - bad} of {n} runs good")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main_())
