"""The device-side error word on the CPU (issue 27): k3gen/runtime/faults.py (bit names agree with
include/k3gen/common/faults.cuh; read / clear / check raise the typed error naming op and fault) and
the launcher plumbing: each launcher of kv_cache_write, mla_decode, kda_decode, kda_verify and
moe_experts, called with well-formed CPU tensors and a recording stand-in for the kernel, passes its
op's word last (or inside moe_experts' argument struct), as many arguments as the rendered kernel
signature takes, and nothing extra to the frozen sm100-mxfp4 kernels."""
from __future__ import annotations

import re
import types

import pytest
import torch

from k3gen.errors import K3genError, KernelFaultError, SpecError
from k3gen.ir.dtypes import KvDtype, SsmDtype
from k3gen.pipeline.render import render
from k3gen.runtime import faults
from k3gen.targets import TARGETS
from test_launcher_checks import _kda_decode, _kda_verify, _kv_cache_write, _mla_decode, _mla_prefill, _moe_experts

HEADER = faults.__file__.replace("runtime/faults.py", "include/k3gen/common/faults.cuh")


def test_bit_names_match_the_header():
    src = open(HEADER).read()
    enum = dict((m.group(1), int(m.group(2))) for m in re.finditer(r"k(\w+) = 1u << (\d+),", src))
    names = {re.sub(r"(?<!^)([A-Z])", r"_\1", k).lower(): v for k, v in enum.items()}
    assert names == {n: i for i, n in enumerate(faults.FAULTS)}
    assert len(faults.OPS) <= faults.WORDS


@pytest.fixture
def cpu_words(monkeypatch):
    """The error words on the CPU, also under the key of CUDA device 0 (what launchers ask for)."""
    buf = torch.zeros(faults.WORDS, dtype=torch.int32)
    monkeypatch.setattr(faults, "_buffers", {torch.device("cpu"): buf, torch.device("cuda", 0): buf})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return buf


def test_read_clear_check(cpu_words):
    cpu = torch.device("cpu")
    assert faults.read(cpu) == {}
    faults.check(cpu)   # clean: no error
    cpu_words[faults.OPS.index("mla_decode")] = faults.BITS["page"] | faults.BITS["length"]
    cpu_words[faults.OPS.index("kda_verify")] = faults.BITS["pending"]
    assert faults.read(cpu) == {"mla_decode": ["page", "length"], "kda_verify": ["pending"]}
    assert faults.bits("mla_decode", cpu) == faults.BITS["page"] | faults.BITS["length"]
    with pytest.raises(KernelFaultError) as e:
        faults.check(cpu, reset=False)
    assert isinstance(e.value, K3genError) and isinstance(e.value, IndexError)
    assert "mla_decode: page, length" in str(e.value) and "kda_verify: pending" in str(e.value)
    assert e.value.faults == {"mla_decode": ["page", "length"], "kda_verify": ["pending"]}
    with pytest.raises(KernelFaultError):
        faults.check(cpu)            # reset=True clears after reporting
    assert faults.read(cpu) == {}
    cpu_words[0] = -1                 # every bit, unknown ones named by position
    assert faults.read(cpu)["kv_cache_write"][-1] == "bit31"
    faults.clear(cpu)
    assert int(cpu_words.abs().sum()) == 0


def test_word_addresses(cpu_words):
    cpu = torch.device("cpu")
    ptrs = [faults.word(op, cpu) for op in faults.OPS]
    assert ptrs == [cpu_words.data_ptr() + 4 * i for i in range(len(faults.OPS))]
    assert faults.buffer(cpu) is cpu_words      # one buffer per device, kept (graphs hold its address)
    with pytest.raises(SpecError):
        faults.word("act_quant_fp8", cpu)     # an op without a word


def test_buffer_is_allocated_once_per_device(monkeypatch):
    monkeypatch.setattr(faults, "_buffers", {})
    a = faults.buffer("cpu")
    assert faults.buffer(torch.device("cpu")) is a and a.dtype == torch.int32 and a.shape == (faults.WORDS,)


# ---- launcher plumbing --------------------------------------------------------------------------
class FakeKernel:
    """Records launches instead of calling the driver."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def launch(self, grid, block, args, types_, *rest, **kw):
        self.calls.append((self.name, tuple(args), tuple(types_)))

    def launch_ex(self, grid, block, cluster, args, types_, *rest, **kw):
        self.calls.append((self.name, args if isinstance(args, int) else tuple(args), types_))
        self.last_ex = (grid, block, rest)

    def __getattr__(self, name):
        return lambda *a, **k: 0


def signature_arity(spec, entry: str) -> int:
    """Parameters of the extern "C" kernel `entry` in the rendered source."""
    src = render(spec)
    for m in re.finditer(r"\b" + entry + r"\(", src):
        if "__global__" not in src[max(0, m.start() - 300):m.start()]:
            continue
        depth, i, params = 1, m.end(), ""
        while depth:
            c = src[i]
            depth += c == "("
            depth -= c == ")"
            params += c if depth else ""
            i += 1
        return len([p for p in params.split(",") if p.strip()])
    raise AssertionError(f"no kernel {entry} in the source")


def _wire(L, monkeypatch, calls, entries: dict):
    import sys
    mod = sys.modules[type(L).__module__]
    monkeypatch.setattr(mod, "check_one_device", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    L.__dict__["sm_count"], L.__dict__["device_index"] = 132, 0
    for attr, name in entries.items():
        setattr(L, attr, FakeKernel(name, calls))


def _check_last_is_word(spec, calls, op: str, entries):
    word = faults.word(op, torch.device("cpu"))
    assert [c[0] for c in calls] == list(entries)
    for (entry, args, types_), want in zip(calls, entries):
        assert len(args) == len(types_) == signature_arity(spec, entry), entry
        if spec.target.frozen:
            assert word not in args, f"{entry}: the frozen kernel takes no error word"
        else:
            assert args[-1] == word and types_[-1].__name__ == "c_void_p", entry


@pytest.mark.parametrize("kv", ["bf16", "fp8", "nvfp4"])
def test_kv_cache_write_passes_the_word(kv, cpu_words, monkeypatch):
    L, args, kwargs = _kv_cache_write(kv)
    calls = []
    _wire(L, monkeypatch, calls, {"_kernel": "k3gen_kv_cache_write"})
    L(*args.values(), **kwargs)
    _check_last_is_word(L.spec, calls, "kv_cache_write", ["k3gen_kv_cache_write"])


def test_frozen_kv_cache_write_gets_no_word(cpu_words, monkeypatch):
    from k3gen.ops.kv_cache_write.launcher import KvCacheWrite
    from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
    _, args, kwargs = _kv_cache_write("bf16")
    L = KvCacheWrite(KvCacheWriteSpec(target=TARGETS["sm100-mxfp4"], kv=KvDtype.BF16))
    calls = []
    _wire(L, monkeypatch, calls, {"_kernel": "k3gen_kv_cache_write"})
    L(*args.values(), **kwargs)
    _check_last_is_word(L.spec, calls, "kv_cache_write", ["k3gen_kv_cache_write"])
    assert signature_arity(L.spec, "k3gen_kv_cache_write") == 13


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_mla_decode_passes_the_word(kv, cpu_words, monkeypatch):
    from k3gen.ops.mla_decode.launcher import SplitPlan
    L, args, kwargs = _mla_decode(kv)
    calls = []
    _wire(L, monkeypatch, calls, {"_kernel": "k3gen_mla_decode", "_combine": "k3gen_mla_decode_combine"})
    if not L.geo.kv_map:
        L(*args.values(), **kwargs, plan=SplitPlan(5, 64, 1))
        _check_last_is_word(L.spec, calls, "mla_decode", ["k3gen_mla_decode"])
        return
    # TMA schedule (wgmma_qm): the arguments travel in an ArgPack, the tensor map last.
    import k3gen.ops.mla_decode.launcher as ml
    packs = []

    class Recorded(ml.ArgPack):
        def __init__(self):
            super().__init__()
            packs.append(self)

    monkeypatch.setattr(ml, "ArgPack", Recorded)
    L._kv_map = lambda *a: bytes(128)
    L(*args.values(), **kwargs, plan=SplitPlan(5, 64, 1))
    vals = packs[0]._vals
    assert len(vals) == signature_arity(L.spec, "k3gen_mla_decode")
    assert vals[-2].value == faults.word("mla_decode", torch.device("cpu")) and len(bytes(vals[-1])) == 128


@pytest.mark.parametrize("variant", ["wgmma", "wgmma_cp", "tcgen05", "wgmma_ps"])
def test_mla_prefill_passes_the_word_before_its_maps(variant, cpu_words, monkeypatch):
    import dataclasses

    import k3gen.ops.mla_prefill.launcher as ml
    from k3gen.ops.mla_prefill.spec import PrefillKernel
    L, args, _ = _mla_prefill("fp32")
    # The same launcher serves the SM100 family's tcgen05 kernel (its plan: 224 threads).
    target = TARGETS["sm103-nvfp4"] if variant == "tcgen05" else L.spec.target
    L = type(L)(dataclasses.replace(L.spec, kernel=PrefillKernel(variant), target=target))
    calls, packs = [], []

    class Recorded(ml.ArgPack):
        def __init__(self):
            super().__init__()
            packs.append(self)

    monkeypatch.setattr(ml, "ArgPack", Recorded)
    monkeypatch.setattr(ml, "head_map", lambda t: bytes(128))
    monkeypatch.setattr(ml, "rope_map", lambda t: bytes(128))
    monkeypatch.setattr(ml, "q_map", lambda t: bytes(128))
    sched = torch.zeros(2, dtype=torch.int32)   # the persistent variant's counters (CPU stand-in)
    if variant == "wgmma_ps":
        L._sms[0] = 132
        monkeypatch.setattr(L, "_counters", lambda dev: sched)
    _wire(L, monkeypatch, calls, {"_kernel": "k3gen_mla_prefill"})
    L(*args.values())
    assert [c[0] for c in calls] == ["k3gen_mla_prefill"]
    vals = packs[0]._vals
    assert len(vals) == signature_arity(L.spec, "k3gen_mla_prefill") == 25
    assert vals[18].value == faults.word("mla_prefill", torch.device("cpu"))
    # then B and the persistent variant's counters (null for the others), then the 4 maps (k_nope, k_pe, v, q)
    assert vals[19].value == 2 and (vals[20].value or 0) == (sched.data_ptr() if variant == "wgmma_ps" else 0)
    assert [len(bytes(v)) for v in vals[21:]] == [128] * 4
    src = render(L.spec)
    assert "int heads_fast,\n    unsigned* err, int batch, int* sched," in src and "heads_fast, err, batch, sched};" in src
    grid, block, rest = L._kernel.last_ex   # the variant's plan: block and dynamic shared memory
    assert block == (L.spec.threads, 1, 1) and rest[-1] == L.spec.smem_bytes
    assert grid == (L.spec.grid(2, 3, True, 132) if variant == "wgmma_ps" else L.spec.grid(2, 3, True))
    assert f"__launch_bounds__({L.spec.threads}, 1)" in src and L.spec.threads == (224 if variant == "tcgen05" else 384)


def test_mla_decode_every_schedule_declares_the_word():
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    sm90, sm103 = TARGETS["sm90"], TARGETS["sm103-nvfp4"]
    specs = [MlaDecodeSpec(target=sm90, heads=12, schedule=s) for s in ("mma", "wgmma_qm")]
    specs += [MlaDecodeSpec(target=sm90, heads=12, kv=KvDtype.FP8), MlaDecodeSpec(target=sm90, heads=12, kv=KvDtype.NVFP4,
                                                                                   max_drafts=3)]
    specs += [MlaDecodeSpec(target=sm103, heads=12, kv=kv, max_drafts=3 if kv is KvDtype.NVFP4 else 0)
              for kv in KvDtype]
    for s in specs:
        src = render(s)
        assert "int splits, unsigned* err" in src and "part_lse, splits, err}" in src, s.slug()
        # the TMA map (wgmma_qm, tcgen05 BF16) comes after the word, as the launcher packs it
        assert signature_arity(s, "k3gen_mla_decode") == 18 + ("TmaMap" in src.split("k3gen_mla_decode(")[1][:600])


@pytest.mark.parametrize("ssm", ["fp32", "bf16"])
@pytest.mark.parametrize("schedule", ["rows", "stream"])
def test_kda_decode_passes_the_word(ssm, schedule, cpu_words, monkeypatch):
    L, args, kwargs = _kda_decode(ssm)
    calls = []
    _wire(L, monkeypatch, calls, {"_kernel": "k3gen_kda_decode", "_stream": "k3gen_kda_decode_stream"})
    L._stream_smem, L._stream_ctas = 1024, 2
    L(*args.values(), schedule=schedule)
    _check_last_is_word(L.spec, calls, "kda_decode", ["k3gen_kda_decode" + ("_stream" if schedule == "stream" else "")])


@pytest.mark.parametrize("schedule", ["rows", "prefetch", "split"])
def test_kda_verify_passes_the_word(schedule, cpu_words, monkeypatch):
    L, args, kwargs = _kda_verify("bf16")
    calls = []
    _wire(L, monkeypatch, calls, {"_kernel": "k3gen_kda_verify", "_prefetch": "k3gen_kda_verify_prefetch",
                                  "_split": "k3gen_kda_verify_split"})
    L._prefetch_smem = L._split_smem = 1024
    L(*args.values(), schedule=schedule)
    entry = {"rows": "k3gen_kda_verify", "prefetch": "k3gen_kda_verify_prefetch", "split": "k3gen_kda_verify_split"}
    _check_last_is_word(L.spec, calls, "kda_verify", [entry[schedule]])


def test_frozen_kda_verify_gets_no_word(cpu_words, monkeypatch):
    from k3gen.ops.kda_verify.launcher import KdaVerify
    from k3gen.ops.kda_verify.spec import KdaVerifySpec
    _, args, kwargs = _kda_verify("fp32")
    L = KdaVerify(KdaVerifySpec(target=TARGETS["sm100-mxfp4"], heads=4, drafts=3, ssm=SsmDtype.FP32))
    calls = []
    _wire(L, monkeypatch, calls, {"_kernel": "k3gen_kda_verify"})
    L(*args.values())
    _check_last_is_word(L.spec, calls, "kda_verify", ["k3gen_kda_verify"])
    assert "kFaults" not in render(L.spec)


@pytest.mark.parametrize("weights", ["mxfp4", "nvfp4"])
def test_moe_experts_passes_the_word(weights, cpu_words, monkeypatch):
    import k3gen.ops.moe_experts.launcher as ml
    L, args, kwargs = _moe_experts(weights, "bf16")
    made = []

    class Recorded(ml.ExpertArgs):
        def __init__(self, **kw):
            super().__init__(**kw)
            made.append(self)

    monkeypatch.setattr(ml, "ExpertArgs", Recorded)
    calls = []
    _wire(L, monkeypatch, calls, {"_kernel": "k3gen_moe_experts", "_down": "k3gen_moe_experts_down",
                                  "_combine": "k3gen_moe_experts_combine"})
    L(*args.values(), **kwargs)
    word = faults.word("moe_experts", torch.device("cpu"))
    assert [m.err for m in made] == [word, word]
    assert ml.ctypes.sizeof(ml.ExpertArgs) == 88   # the template's static_assert
    assert "sizeof(k3gen::moe::ExpertArgs) == 88" in render(L.spec)
    name, cargs, ctypes_ = calls[-1]
    assert name == "k3gen_moe_experts_combine" and cargs[-1] == word
    assert len(cargs) == signature_arity(L.spec, "k3gen_moe_experts_combine")
