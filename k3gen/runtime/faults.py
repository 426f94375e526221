"""The device-side error word: bounds faults that kernels met, recorded without a host sync.

Every index a kernel of kv_cache_write, mla_decode, kda_decode, kda_verify, moe_experts or mla_prefill
reads (page ids, slots, ring slots, lengths, start positions, cu_rows, cu_seqlens, expert ids, offsets, perm) is clamped or
skipped on the device, so no input makes a kernel touch memory outside its tensors; the kernel then
ORs the fault's bit (FAULTS, mirrored from include/k3gen/common/faults.cuh) into its op's 32-bit word
of a small buffer, one per CUDA device. What each op does with each bad index is in its spec.py
docstring ("Bad indices").

The buffer is allocated once per device (by a launcher's `load()`, outside any capture) and never
freed, so CUDA graphs that captured launches keep writing the same words. Launches pass
`word(op, device)`, a pointer: no sync, no allocation. Read it after a step or in tests:

    from k3gen.runtime import faults
    faults.clear()                 # async zero (also capturable)
    ... launches / graph replays ...
    faults.check()                 # syncs; raises k3gen.errors.KernelFaultError naming op and fault
    faults.read()                  # {op: [fault names]} of the set words, {} when clean

`K3GEN_VALIDATE=1` stays the synchronous host check with the typed errors (PageIndexError, SpecError)
before a launch.
"""
from __future__ import annotations

from k3gen.errors import KernelFaultError, SpecError

# Bit -> name, as in include/k3gen/common/faults.cuh (same order, bit i = 1 << i).
FAULTS = ("page", "table", "slot", "ring", "length", "rows", "start", "pending", "expert", "offsets", "perm")
BITS = {name: 1 << i for i, name in enumerate(FAULTS)}
# One word per op, by index; WORDS leaves room for more ops without moving a word.
OPS = ("kv_cache_write", "mla_decode", "kda_decode", "kda_verify", "moe_experts", "mla_prefill")
WORDS = 16

_buffers: dict = {}   # torch.device -> int32 [WORDS]


def _device(device):
    import torch
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def buffer(device=None):
    """The error words of `device` (default: the current CUDA device), int32 [WORDS], allocated on
    first use and kept for the process (graphs hold its address). Any torch device works (CPU: tests)."""
    import torch
    d = _device(device)
    buf = _buffers.get(d)
    if buf is None:
        if d.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise SpecError("faults.buffer", str(d), "allocated before capture",
                            "load() the kernels (or call faults.buffer()) before a CUDA-graph capture")
        buf = _buffers[d] = torch.zeros(WORDS, dtype=torch.int32, device=d)
    return buf


def word(op: str, device=None) -> int:
    """The device address of `op`'s error word (what a launcher passes as `unsigned* err`)."""
    if op not in OPS:
        raise SpecError("op", op, list(OPS), "ops with a device error word")
    buf = buffer(device)
    return buf.data_ptr() + OPS.index(op) * buf.element_size()


def decode(words) -> dict:
    """{op: [fault names]} of a list of word values (unknown bits are named bit<i>)."""
    out = {}
    for i, w in enumerate(words):
        w = int(w) & 0xFFFFFFFF
        if not w:
            continue
        op = OPS[i] if i < len(OPS) else f"word{i}"
        out[op] = [FAULTS[b] if b < len(FAULTS) else f"bit{b}" for b in range(32) if w >> b & 1]
    return out


def read(device=None) -> dict:
    """The faults recorded so far on `device` (synchronizes: a device-to-host copy)."""
    return decode(buffer(device).cpu().tolist())


def bits(op: str, device=None) -> int:
    """The raw word of `op` (synchronizes)."""
    word(op, device)
    return int(buffer(device)[OPS.index(op)].item()) & 0xFFFFFFFF


def clear(device=None) -> None:
    """Zero every word (an async memset on the current stream; graph-capturable)."""
    buffer(device).zero_()


def check(device=None, *, reset: bool = True) -> None:
    """Raise KernelFaultError when any kernel recorded a fault (synchronizes); `reset` clears the
    words first, so the next check reports only new faults."""
    found = read(device)
    if found and reset:
        clear(device)
    if found:
        raise KernelFaultError(found)
