"""Two tcgen05 hazards, checked in a kernel's PTX and SASS (CPU only; nothing runs).

(a) A tcgen05.ld's destination registers hold the data only after tcgen05.wait::ld; NVVM sees the
    load as defining them at once and may hoist register-only arithmetic above the wait (the
    kernels pin them with sm100::pin after the wait). Checked in the PTX: between a tcgen05.ld and
    the next tcgen05.wait::ld (which must follow in the same basic block) no instruction names any
    of the load's destinations.
(b) After divergent single-lane roles (producer / MMA issuer lane 0), every lane rejoins its warp
    before the closing barrier: bar.sync is .aligned. Checked in the PTX (the source's
    __syncwarp: a bar.warp.sync in the closing barrier's basic block, before it) and in the SASS
    (WARPSYNC right before the closing BAR.SYNC, and no branch lands on the BAR.SYNC itself).
"""
from __future__ import annotations

import re

_REG = re.compile(r"%[a-z]+[0-9]+")


def ptx_entry(ptx: str, entry: str) -> list[str]:
    """The instruction lines of `.entry entry` (comments, .loc and blank lines dropped; labels kept)."""
    start = ptx.index(f".entry {entry}(")
    nxt = [i for i in (ptx.find(".entry ", start + 1), ptx.find(".func ", start + 1)) if i > 0]
    body = ptx[start:min(nxt) if nxt else len(ptx)]
    lines = []
    for raw in body.splitlines():
        line = raw.split("//", 1)[0].strip()
        if line and not line.startswith(".loc"):
            lines.append(line)
    return lines


def _is_block_edge(line: str) -> bool:
    return line.endswith(":") or re.search(r"\bbra(\.uni)?\b", line) is not None or line.startswith("ret")


def ld_uses_before_wait(lines: list[str]) -> list[str]:
    """Hazard (a): one message per tcgen05.ld whose destinations are named before its wait, or
    whose wait is not in its basic block."""
    bad = []
    for i, line in enumerate(lines):
        if not line.startswith("tcgen05.ld."):
            continue
        dests = set(_REG.findall(line[line.index("{"):line.index("}")]))
        for j in range(i + 1, len(lines)):
            nxt = lines[j]
            if nxt.startswith("tcgen05.wait::ld"):
                break
            if _is_block_edge(nxt):
                bad.append(f"line {i}: no tcgen05.wait::ld before the block ends ({nxt})")
                break
            used = dests & set(_REG.findall(nxt))
            if used and not nxt.startswith("tcgen05.ld."):
                bad.append(f"line {i}: {sorted(used)[0]} used before tcgen05.wait::ld: {nxt}")
                break
        else:
            bad.append(f"line {i}: tcgen05.ld never waited for")
    return bad


def ld_count(lines: list[str]) -> int:
    return sum(line.startswith("tcgen05.ld.") for line in lines)


def closing_barrier_converged_ptx(lines: list[str]) -> bool:
    """Hazard (b) in the PTX: the entry's last bar.sync has a bar.warp.sync in its basic block."""
    last = max(i for i, line in enumerate(lines) if re.match(r"(bar\.sync|barrier\.sync)\b", line))
    for j in range(last - 1, -1, -1):
        if lines[j].startswith("bar.warp.sync"):
            return True
        if _is_block_edge(lines[j]):
            return False
    return False


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_function(sass: str, name: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of one function's SASS (cuobjdump -sass text)."""
    start = sass.index(f"Function : {name}\n")
    end = sass.find("Function : ", start + 1)
    out = []
    for m in _SASS.finditer(sass[start:end if end > 0 else len(sass)]):
        out.append((int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return out


def closing_barrier_converged_sass(instrs: list[tuple[int, str, str]]) -> bool:
    """Hazard (b) in the SASS: WARPSYNC right before the last BAR.SYNC of barrier 0 (__syncthreads;
    named barriers of a subset of warps are not it), no branch to the BAR.SYNC."""
    idx = max(i for i, (_, op, arg) in enumerate(instrs) if op.startswith("BAR.SYNC") and arg == "0x0")
    addr = instrs[idx][0]
    if not instrs[idx - 1][1].startswith("WARPSYNC"):
        return False
    targets = {int(t, 16) for _, op, arg in instrs if op.startswith("BRA") for t in re.findall(r"0x([0-9a-f]+)", arg)}
    return addr not in targets


_ASYNC_LD = re.compile(r"\bld(?:32|8)_async\(((?:[^;()]|\([^;()]*\))*)\);")


def unpinned_async_loads(src: str) -> list[str]:
    """Hazard (a) in the source: each ldN_async's destination is pinned (pin(dest)) after the next
    wait_ld(), before 400 characters pass (the pattern every tcgen05 kernel here uses)."""
    bad = []
    for m in _ASYNC_LD.finditer(src):
        if "(unsigned taddr" in m.group(0):
            continue   # the helper's own definition
        dest = m.group(1).rsplit(",", 1)[1].strip()
        # Pinned: the destination as written (`x[c]`), or the whole array it lies in
        # (`*reinterpret_cast<..>(&x[8 * c])` -> pin(x)).
        roots = re.findall(r"([A-Za-z_]\w*)\s*\[", dest) or [dest]
        w = src.find("wait_ld()", m.end())
        window = src[w:w + 400] if w >= 0 else ""
        exact = r"\bpin\(\s*" + re.escape(dest) + r"\s*\)"
        whole = r"\bpin\(\s*" + re.escape(roots[-1]) + r"\s*\)"
        if not (re.search(exact, window) or re.search(whole, window)):
            bad.append(f"{m.group(0)}: {dest} not pinned after wait_ld()")
    return bad
