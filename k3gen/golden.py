"""Hashes of the frozen generated sources of the original target (sm100-mxfp4).

`python -m k3gen.golden --add` records sources that are new; it refuses to change the hash of a
source already recorded, because those kernels are frozen byte for byte once landed.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from .build import GENERATED_ROOT, REPO_ROOT

GOLDEN = REPO_ROOT / "tests" / "golden" / "sm100_mxfp4.json"


def current() -> dict[str, str]:
    d = GENERATED_ROOT / "sm100_mxfp4"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.cu"))}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    now = current()
    changed = [n for n, h in recorded.items() if n in now and now[n] != h]
    if changed:
        print("frozen sources changed (not allowed): " + ", ".join(changed), file=sys.stderr)
        return 1
    new = {n: h for n, h in now.items() if n not in recorded}
    if "--add" in argv:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({**recorded, **new}, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(new)} new frozen sources")
    else:
        print(f"{len(recorded)} frozen, {len(new)} new (use --add to record them)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
