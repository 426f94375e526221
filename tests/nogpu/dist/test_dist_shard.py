"""model/shard.py in one process: every layout's rank shares put back together are the whole model's
weights (dequantized values, bitwise), each rank holds the tensors model/params.py (plan-memory) counts
for it, the expert slices are the MXFP4 reader's own per-rank slices, and splits the stored formats
cannot represent raise typed errors naming the tensor and rank."""
from __future__ import annotations

import math

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.presets import preset_dict
from model.checkpoint import write_random_checkpoint
from model.config import config_from_dict, get_config
from model.dist import Layout
from model.params import _rank_shape, param_table
from model.shard import ShardAlignmentError, check_rank_weights, check_shardable, shard_experts, shard_weights
from model.weights import ExpertWeights, KdaLayerWeights, MoeWeights, load_weights

import dist_cases as C

LAYOUTS = [Layout(2), Layout(4), Layout(2, 2), Layout(4, 4), Layout(4, 2)]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d, _ = write_random_checkpoint(C.tiny4(), tmp_path_factory.mktemp("tiny4"), seed=5, fp4="codes")
    return load_weights(d, C.tiny4())


def _rows(x):
    """An FP8 weight as (codes, each row's scales): equal pairs are equal values, whatever the tiling."""
    return torch.cat([x.codes.float(), x.scales.float().repeat_interleave(128, 0)[:x.n]], 1)


def _cols(x):
    return torch.cat([x.codes.float(), x.scales.float().repeat_interleave(128, 1)[:, :x.k]], 0)


def _experts_back(parts: list[ExpertWeights], layout: Layout) -> dict[str, torch.Tensor]:
    """The whole model's packed expert tensors from the ranks' slices (EP slot major, MoE TP minor)."""
    out = {k: [] for k in ("w13", "w13_scale", "w2", "w2_scale", "w13_global", "w2_global")}
    for e in range(layout.ep):
        ranks = [parts[e * layout.moe_tp + j] for j in range(layout.moe_tp)]
        I = ranks[0].inter
        for k in ("w13", "w13_scale"):
            t = [getattr(r, k) for r in ranks]
            out[k].append(torch.cat([torch.cat([x[:, :I] for x in t], 1), torch.cat([x[:, I:] for x in t], 1)], 1))
        for k in ("w2", "w2_scale"):
            out[k].append(torch.cat([getattr(r, k) for r in ranks], 2))
        for k in ("w13_global", "w2_global"):
            assert all(torch.equal(getattr(r, k), getattr(ranks[0], k)) for r in ranks)
            out[k].append(getattr(ranks[0], k))
    return {k: torch.cat(v) for k, v in out.items()}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_rank_shares_put_back_are_the_whole_model(full, layout):
    cfg = full.cfg
    ranks = [shard_weights(full, layout.place(r)) for r in range(layout.world)]
    n = layout.world
    assert torch.equal(torch.cat([w.embed for w in ranks]), full.embed)
    assert torch.equal(torch.cat([w.lm_head for w in ranks]), full.lm_head)
    for i, lw in enumerate(full.layers):
        part = [w.layers[i] for w in ranks]
        for p in part:                          # replicated, the same objects
            assert p.input_norm is lw.input_norm and p.attn_res is lw.attn_res and p.mlp_res is lw.mlp_res
        a = lw.attn
        if isinstance(a, KdaLayerWeights):
            H = cfg.kda_heads
            q = _rows(a.qkvg).view(4, H, 128, -1)
            assert torch.equal(torch.cat([_rows(p.attn.qkvg).view(4, H // n, 128, -1) for p in part], 1), q)
            fab = _rows(a.fab)
            for p in part:
                f = _rows(p.attn.fab)
                assert torch.equal(f[:128], fab[:128])                            # f_a replicated
                assert p.attn.fab.n % 16 == 0 and not p.attn.fab.codes[128 + H // n:].any()   # zero pad
            assert torch.equal(torch.cat([_rows(p.attn.fab)[128:128 + H // n] for p in part]), fab[128:128 + H])
            k = a.kda
            assert torch.equal(torch.cat([p.attn.kda.conv_w.view(3, -1, 4) for p in part], 1), k.conv_w.view(3, -1, 4))
            for f in ("fb_w", "dt_bias", "a_log"):
                assert torch.equal(torch.cat([getattr(p.attn.kda, f) for p in part]), getattr(k, f)), f
            assert all(p.attn.kda.norm_w is k.norm_w for p in part)
        else:
            G = cfg.q_lora + 640
            ap = _rows(a.a_proj)
            for p in part:
                assert torch.equal(_rows(p.attn.a_proj)[:G], ap[:G])                # q_a | kv_a replicated
            assert torch.equal(torch.cat([_rows(p.attn.a_proj)[G:] for p in part]), ap[G:])
            assert torch.equal(torch.cat([_rows(p.attn.q_b) for p in part]), _rows(a.q_b))
            for f in ("w_uk", "w_uv"):
                assert torch.equal(torch.cat([getattr(p.attn, f) for p in part]), getattr(a, f))
        assert torch.equal(torch.cat([_cols(p.attn.o_proj) for p in part], 1), _cols(a.o_proj))
        assert all(type(p.attn.o_proj).__name__ == "RowParallel" for p in part)
        f = lw.ffn
        if isinstance(f, MoeWeights):
            for p in part:
                assert p.ffn.router is f.router and p.ffn.latent_norm is f.latent_norm
            back = _experts_back([p.ffn.experts for p in part], layout)
            for k, v in back.items():
                assert torch.equal(v, getattr(f.experts, k)), k
            g, pg = f.shared, [p.ffn.shared for p in part]
        else:
            g, pg = f, [p.ffn for p in part]
        # the FP8 [gate | up] rows and down columns of the ranks put back (each part's own tiles)
        W = g.width
        gates = torch.cat([_rows(p.gate_up)[:p.inter] for p in pg])
        ups = torch.cat([_rows(p.gate_up)[p.width:p.width + p.inter] for p in pg])
        assert torch.equal(gates, _rows(g.gate_up)[:g.inter]) and torch.equal(ups, _rows(g.gate_up)[W:W + g.inter])
        assert torch.equal(torch.cat([_cols(p.down)[:, :p.inter] for p in pg], 1), _cols(g.down)[:, :g.inter])
        assert all(type(p.down).__name__ == "RowParallel" for p in pg) and sum(p.inter for p in pg) == g.inter


def _counts(w) -> dict[str, int]:
    """Parameters per model/params.py group in a rank's weights (zero padding rows excluded)."""
    cfg = w.cfg
    c = dict.fromkeys(("embed", "lm_head", "kda_attn", "mla_attn", "dense_mlp", "router", "shared_experts", "latent",
                       "routed_experts", "attn_res", "norms"), 0)
    c["embed"], c["lm_head"] = w.embed.numel(), w.lm_head.numel()
    c["norms"] = w.final_norm.numel()
    c["attn_res"] = w.output_res.proj.numel() + w.output_res.norm.numel()
    for lw in w.layers:
        c["norms"] += lw.input_norm.numel() + lw.post_norm.numel()
        c["attn_res"] += sum(r.proj.numel() + r.norm.numel() for r in (lw.attn_res, lw.mlp_res))
        a = lw.attn
        if isinstance(a, KdaLayerWeights):
            h = a.kda.heads
            c["kda_attn"] += (a.qkvg.codes.numel() + (128 + h) * a.fab.k + a.o_proj.codes.numel()
                              + sum(t.numel() for t in (a.kda.conv_w, a.kda.fb_w, a.kda.dt_bias, a.kda.a_log,
                                                        a.kda.norm_w)))
        else:
            c["mla_attn"] += (a.a_proj.codes.numel() - 64 * a.a_proj.k + a.q_b.codes.numel() + a.o_proj.codes.numel()
                              + a.w_uk.numel() + a.w_uv.numel() + a.q_a_norm.numel() + a.kv_a_norm.numel())
        f = lw.ffn
        if isinstance(f, MoeWeights):
            c["router"] += f.router.numel() + f.bias.numel()
            c["latent"] += f.latent_down.codes.numel() + f.latent_up.codes.numel() + f.latent_norm.numel()
            c["shared_experts"] += 3 * f.shared.inter * f.shared.gate_up.k
            x = f.experts
            c["routed_experts"] += x.experts * x.inter * x.width * 3
        else:
            c["dense_mlp"] += 3 * f.inter * f.gate_up.k
    return c


@pytest.mark.parametrize("layout", [Layout(1)] + LAYOUTS, ids=str)
def test_each_rank_holds_what_plan_memory_counts(full, layout):
    want = dict.fromkeys(_counts(full), 0)
    for p in param_table(full.cfg):
        shape, copies = _rank_shape(p, layout.world, layout.ep)
        want[p.group] += math.prod(shape) * copies
    for r in range(layout.world):
        assert _counts(shard_weights(full, layout.place(r))) == want, f"rank {r}"


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    from model.formats import ct_mxfp4 as X
    d = tmp_path_factory.mktemp("ct")
    X.write_official_checkpoint(C.tiny4(), d, seed=1, shards=2, config=C.tiny4_dict())
    return X.CtMxfp4Checkpoint(d)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_expert_slices_are_the_mxfp4_readers(official, layout):
    """The MXFP4 reader slices experts at load ((rank, world) per slot); slicing its whole-model
    experts here gives the same packed bytes."""
    r = official
    whole = r.layer(1).experts
    for k in range(layout.world):
        p = layout.place(k)
        got = shard_experts(whole, p)
        want = r.layer(1, tp=p.moe_tp, ep=p.ep, expert_tp=True).experts
        for f in ("w13", "w13_scale", "w2", "w2_scale"):
            assert torch.equal(getattr(got, f), getattr(want, f)), (k, f)


def _cfg(kda_heads: int, mla_heads: int, **text):
    d = preset_dict("tiny")
    d["text_config"]["linear_attn_config"]["num_heads"] = kda_heads
    d["text_config"]["num_attention_heads"] = mla_heads
    d["text_config"].update(text)
    return config_from_dict(d, f"tiny-{kda_heads}-{mla_heads}")


def test_unrepresentable_splits_raise_typed_errors(full):
    # q_b has 192 rows per head: one MLA head per rank puts rank 1's rows across two stored tiles.
    with pytest.raises(ShardAlignmentError, match="mla q_b.*rank 1"):
        check_shardable(_cfg(4, 4), Layout(4))
    check_shardable(_cfg(4, 8, moe_intermediate_size=512), Layout(4))
    # The shared experts' FP8 [gate | up] and down split on whole 128-row tiles: tiny's 128 over 4 ranks is 32.
    with pytest.raises(ShardAlignmentError, match="shared_inter"):
        check_shardable(_cfg(4, 8), Layout(4))
    with pytest.raises(ShardAlignmentError, match="dense_inter"):
        check_shardable(_cfg(4, 8, moe_intermediate_size=512, intermediate_size=256), Layout(4))
    with pytest.raises(SpecError, match="kda_heads"):                 # tiny's 2 heads over 4 ranks
        check_shardable(get_config("tiny"), Layout(4))
    with pytest.raises(SpecError, match="ep"):
        Layout(4, 3)
    with pytest.raises(SpecError, match="experts"):                   # 8 experts over 16 EP ranks
        Layout(16, 16).check(_cfg(16, 32))
    # NVFP4 experts split their intermediate on 16-wide scale groups: 512 over 64 ranks is 8 each.
    ex = next(lw.ffn.experts for lw in full.layers if isinstance(lw.ffn, MoeWeights))
    with pytest.raises(ShardAlignmentError, match="moe_inter"):
        shard_experts(ex, Layout(64).place(3))
    # the whole model's weights are not rank 1's
    with pytest.raises(SpecError, match="vocab rows"):
        check_rank_weights(full, Layout(2).place(1))
    check_rank_weights(shard_weights(full, Layout(2).place(1)), Layout(2).place(1))


@pytest.mark.parametrize("kv,ssm,drafts", [("bf16", "fp32", 3), ("nvfp4", "bf16", 3), ("fp8", "fp32", 0)])
def test_rank_cache_is_what_plan_memory_counts(kv, ssm, drafts):
    """A rank's cache (TargetConfig.tp = world) holds the KDA state of its heads and the whole MLA latent
    rows, and its bytes are cache_bytes' (plan-memory's) per-slot and per-page figures."""
    from model.cache import HybridCache, cache_bytes
    from model.config import TargetConfig
    cfg = C.tiny4()
    one = HybridCache(cfg, TargetConfig(kv=kv, ssm=ssm, max_drafts=drafts), 3, 10, 64)
    for n in (1, 2, 4):
        t = TargetConfig(kv=kv, ssm=ssm, max_drafts=drafts, tp=n)
        c, b = HybridCache(cfg, t, 3, 10, 64), cache_bytes(cfg, t)
        assert c.nbytes() == 4 * b.per_slot + 11 * b.per_page                  # 3 slots, 10 pages + padding
        for pools in c.state.values():
            assert pools["ssm"].shape[1] == cfg.kda_heads // n
        for i, d in c.kv.items():
            assert {k: v.shape for k, v in d.items()} == {k: v.shape for k, v in one.kv[i].items()}
