"""The model generates on the CPU through the reference path: the small config end to end, the
decode path against prefill (teacher forcing), speculative decoding against greedy decoding
(n-gram drafter and an oracle drafter that forces partial acceptance), the CLI."""
from __future__ import annotations

import pytest
import torch

from k3gen.errors import SpecError
from model.cache import HybridCache
from model.checkpoint import write_random_checkpoint
from model.config import TargetConfig, small_config, tiny_config
from model.cli import generate_main as main
from model.generate import Generator, Request, ngram_drafts
from model.model import K3Model
from model.weights import load_weights

# A divergence between two decodes of the same model may only happen where the two best logits
# are closer than this (FP32 batch-shape noise of the reference path is ~1e-5 relative).
TIE = 1e-3


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    d, _ = write_random_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=3)
    return load_weights(d, tiny_config())


def _model(w, **kw):
    t = TargetConfig(**kw)
    return K3Model(w, t, HybridCache(w.cfg, t, num_slots=4, num_pages=24, max_seq_len=160))


def _same_or_tie(a: Request, b: Request) -> None:
    for i, (x, y) in enumerate(zip(a.out, b.out)):
        if x != y:
            assert min(a.margins[i], b.margins[i]) < TIE, f"token {i}: {x} != {y} with margin {a.margins[i]}"
            return          # after a legitimate tie the continuations differ


def test_small_config_generates_on_cpu(tmp_path):
    cfg = small_config()
    d, _ = write_random_checkpoint(cfg, tmp_path, seed=0, fp4="codes")   # the fast draw: same format
    m = _model(load_weights(d, cfg), kv="nvfp4", ssm="bf16")
    reqs = Generator(m).generate([Request([3, 1, 4, 1, 5], 3), Request([2, 7], 3, temperature=0.8, seed=5)])
    assert all(len(r.out) == 3 and all(0 <= t < cfg.vocab for t in r.out) for r in reqs)
    assert m.ops.ran["ref:kda_decode"] == 2 * 6 and m.ops.ran["ref:mla_attention"] == 2 * 2
    assert m.cache.mgr.free_slots == 4 and m.cache.mgr.free_pages == 24


@pytest.mark.parametrize("kv,ssm", [("bf16", "fp32"), ("nvfp4", "bf16"), ("fp8", "fp32")])
def test_decode_matches_prefill_teacher_forced(tiny_weights, kv, ssm):
    """Decoding token by token gives the logits of prefilling the whole sequence (absorbed vs
    unabsorbed MLA, KDA decode vs prefill), up to the KV format's quantization."""
    m = _model(tiny_weights, kv=kv, ssm=ssm)
    seq = torch.randint(0, 512, (26,), generator=torch.Generator().manual_seed(1)).tolist()
    full = m.prefill([0], [seq], all_logits=True)[19:25]
    m.release([0])
    got = Generator(m).teacher_forced([seq[:20]], [seq[20:]])[0]
    tol = {"bf16": 0.03, "fp8": 0.06, "nvfp4": 0.15}[kv]
    assert ((got - full).norm() / full.norm()) < tol
    assert (got.argmax(-1) == full.argmax(-1)).float().mean() >= 0.8


def test_generation_is_deterministic_and_batch_independent(tiny_weights):
    m = _model(tiny_weights, kv="nvfp4", ssm="fp32")
    g = Generator(m)
    a = g.generate([Request([5, 6, 7], 8), Request([9, 9, 1, 2], 8, temperature=1.0, seed=4)])
    b = g.generate([Request([9, 9, 1, 2], 8, temperature=1.0, seed=4)])
    c = g.generate([Request([5, 6, 7], 8)])
    assert a[1].out == b[0].out
    _same_or_tie(a[0], c[0])


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_speculative_equals_greedy(tiny_weights, kv):
    m = _model(tiny_weights, kv=kv, ssm="fp32", max_drafts=3)
    g = Generator(m)
    prompts = [[4, 8, 15, 16, 23, 42, 4, 8, 15], [1, 2, 3, 1, 2, 3, 1, 2]]
    greedy = g.generate([Request(p, 8) for p in prompts])
    spec = g.generate([Request(p, 8) for p in prompts], speculative=True)
    for a, b in zip(greedy, spec):
        _same_or_tie(a, b)
    # Oracle drafts (the greedy continuation with every third draft wrong) make the verify path
    # accept 0..3 drafts, rewind the rest and commit through `pending`.
    truth = [p + r.out for p, r in zip(prompts, greedy)]

    def oracle(i, hist, m_):
        n = len(hist)
        d = truth[i][n:n + m_] + [0] * m_
        return [t if (n + j) % 3 else (t + 1) % 512 for j, t in enumerate(d[:m_])]
    g.accepted.clear()
    spec2 = g.generate([Request(p, 8) for p in prompts], speculative=True, drafter=oracle)
    for a, b in zip(greedy, spec2):
        _same_or_tie(a, b)
    assert 0 in g.accepted and max(g.accepted) >= 2   # full rejections and (partial) acceptances both ran
    assert m.cache.mgr.free_slots == 4 and m.cache.mgr.free_pages == 24
    m.cache.mgr.check_invariants()


def test_speculative_needs_drafts_and_greedy(tiny_weights):
    g = Generator(_model(tiny_weights, kv="bf16", ssm="fp32"))
    with pytest.raises(SpecError, match="speculative"):
        g.generate([Request([1, 2], 2)], speculative=True)
    with pytest.raises(SpecError, match="graphs"):
        Generator(g.m, graphs=True)


def test_ngram_drafter():
    assert ngram_drafts([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert ngram_drafts([5, 6, 7, 5], 2) == [6, 7]
    assert ngram_drafts([1, 2, 3], 2) == [3, 3]


def test_cli_generate_reference_path(capsys):
    rc = main(["--config", "tiny", "--kv", "nvfp4", "--ssm", "bf16", "--prompt-ids", "1,2,3,1,2", "--max-new", "2",
               "--spec", "3", "--path", "reference"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "[0] [" in out


def test_cli_prefill_chunk_gives_the_same_tokens(capsys, monkeypatch):
    """--prefill-chunk 3: an 11-token prompt prefilled in 4 pieces (K3Model.prefill_pieces) generates
    the tokens of the one-piece prefill (BF16 KV + FP32 SSM: the pieces' logits are one piece's up to
    the FP32 LM head's row-count rounding, test_model_chunked_prefill_cpu.py)."""
    args = ["--config", "tiny", "--prompt-ids", "5,1,4,1,5,9,2,6,5,3,5", "--max-new", "4", "--path", "reference",
            "--max-seq-len", "64"]
    chunks = []
    real = K3Model.prefill_pieces

    def spy(self, ids, prompts, chunk):
        chunks.append(chunk)
        return real(self, ids, prompts, chunk)
    monkeypatch.setattr(K3Model, "prefill_pieces", spy)
    outs = []
    for extra in ([], ["--prefill-chunk", "3"]):
        assert main(args + extra) == 0
        outs.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("[0] [")])
    assert len(outs[0]) == 1 and outs[0] == outs[1] and chunks == [3]


def test_generator_prefill_chunk(tiny_weights):
    """Generator(prefill_chunk=N) prefills in pieces: the same greedy tokens, kda_prefill run once per
    piece and KDA layer (a 9-token prompt in pieces of 4: 3 rounds), the cache empty afterwards."""
    m = _model(tiny_weights)
    want = Generator(m).generate([Request([3, 1, 4, 1, 5, 9, 2, 6, 5], 5)])[0].out
    before = m.ops.ran["ref:kda_prefill"]
    got = Generator(m, prefill_chunk=4).generate([Request([3, 1, 4, 1, 5, 9, 2, 6, 5], 5)])[0].out
    assert got == want and m.ops.ran["ref:kda_prefill"] - before == 3 * len(m.cfg.kda_layer_ids)
    assert not m.cache.mgr.seqs
    with pytest.raises(SpecError, match="prefill_chunk"):
        Generator(m, prefill_chunk=0)
