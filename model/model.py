"""K3Model: the layers of a ModelConfig over one HybridCache, with host-side step preparation
(`prefill`, `decode`, `verify`, `commit`) around a device-only core (`step_core`) that CUDA graphs
capture per batch size.

Under tensor/expert parallelism (`par`, model/dist.py, with the rank's weights from model/shard.py) the
model is one rank: `RankOps` sums the row-parallel o_proj's partial products over the ranks, the dense MLP's
and the MoE's partial sums are reduced likewise (`MoePart`: before routed_expert_norm), the embedding is
looked up in the rank's vocabulary rows and summed, and the LM head's logits are gathered, so every rank
holds the whole model's logits. Without `par` (or at world size 1) nothing of that runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import KvDtype
from k3gen.ops.kda_verify.reference import commit as kda_commit
from k3gen.targets import model_gemm_shapes

from model import layers as L
from model.cache import CacheStateError, HybridCache
from model.config import TargetConfig
from model.ffn_ops import QAct, ResStream
from model.ops import make_ops
from model.shard import RowParallel, check_rank_weights
from model.weights import DenseMlpWeights, KdaLayerWeights, ModelWeights, MoeWeights

BF16 = torch.bfloat16


def expert_format(w: ModelWeights) -> str | None:
    """The routed experts' stored format (ExpertWeights.fmt) of the first MoE layer; None without one."""
    return next((lw.ffn.experts.fmt for lw in w.layers if isinstance(lw.ffn, MoeWeights)), None)


def gemm_shapes_for(cfg, tp: int = 1) -> list[tuple[int, int]]:
    """(N, K) of every FP8 linear of `cfg` at `tp` (what the loader produces: fused and padded);
    k3gen's enumerator owns the list (targets.model_gemm_shapes)."""
    return model_gemm_shapes(cfg, tp)


# The LM head on the GPU multiplies fixed blocks of LM_ROWS rows (the last one zero-padded): cuBLAS
# picks its FP32 kernel and reduction order by the row count, so one GEMM over the step's B * T rows
# gives a request's logits another rounding in another batch; blocks of one shape give every row
# the same sums wherever it sits (issue 27's batch invariance). The head is memory-bound up to
# ~LM_ROWS rows, so a decode step's block costs what its rows alone would.
LM_ROWS = 64


def lm_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, hidden] FP32 @ w [vocab, hidden]^T FP32 -> [M, vocab]; row-invariant on CUDA."""
    M = x.shape[0]
    if not x.is_cuda or M == 0:
        return x @ w.T
    xp = torch.nn.functional.pad(x, (0, 0, 0, (-M) % LM_ROWS))
    return torch.cat([xp[i:i + LM_ROWS] @ w.T for i in range(0, xp.shape[0], LM_ROWS)])[:M]


@dataclass(frozen=True)
class MoePart:
    """What layers.moe needs of a rank: its experts' columns of the routing weights, the reduction."""
    experts: slice
    reduce: Callable[[torch.Tensor], torch.Tensor]


class RankOps:
    """A rank's Ops: everything is `ops`'s, but `linear` on a `RowParallel` weight (o_proj, the input
    columns of the rank's heads) sums the ranks' partial products in rank order, then rounds to BF16
    where the unsplit projection rounds. On the reference path the partials are FP32 (the sum differs
    from TP1 by FP32 reassociation only); the generated GEMM writes BF16, so there they are BF16, as a
    BF16 all-reduce after vLLM's RowParallelLinear."""

    def __init__(self, ops, par):
        self._ops, self._par = ops, par

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def linear(self, x, w):
        if not isinstance(w, RowParallel):
            return self._ops.linear(x, w)
        if self._ops.kind == "ref":
            from k3gen.ops.act_quant_fp8.reference import act_quant_fp8, dequantize
            self._ops._mark("fp8_linear")
            q = (x.codes, x.scales) if isinstance(x, QAct) else act_quant_fp8(x, self._ops.recipe)
            xd = dequantize(*q, self._ops.recipe)
            part = xd @ w.dequant().to(xd.device).T
        else:
            part = self._ops.linear(x, w).float()
        return self._par.reduce_sum(part).to(BF16)

    def glu(self, x, w, cfg):
        """The GLU with its row-parallel down projection summed over the ranks (`linear`)."""
        return self.linear(QAct(None, *self._ops.glu_hidden(x, w, cfg)), w.down)


class K3Model:
    def __init__(self, weights: ModelWeights, tcfg: TargetConfig, cache: HybridCache, ops=None, par=None):
        self.w, self.cfg, self.tcfg, self.cache = weights, weights.cfg, tcfg, cache
        self.ops = ops or make_ops(tcfg, self.cfg, expert_format(weights))
        self.device = cache.device
        self.layout = cache.layout
        self._n_sources = self.cfg.kernel_shape().ffn.max_sources    # the AttnRes source buffer's depth
        # World size 1 is the unsplit model: no collective, today's path exactly.
        self.par = par if par is not None and par.world > 1 else None
        if self.par is not None:
            p = self.par.place
            if tcfg.tp != p.world:
                raise SpecError("TargetConfig.tp", tcfg.tp, [p.world], f"rank {p.rank} of {p.layout}: kernels and "
                                "cache at the per-rank head counts")
            check_rank_weights(weights, p)
            self.ops = RankOps(self.ops, self.par)
            self._moe_part = MoePart(p.part(self.cfg.experts, p.ep), self.par.reduce_sum)
            self._vocab = p.part(self.cfg.vocab, p.tp)

    # -- pieces -----------------------------------------------------------------------------------
    def gemm_shapes(self) -> list[tuple[int, int]]:
        out = []
        for lw in self.w.layers:
            a, f = lw.attn, lw.ffn
            lins = [a.qkvg, a.fab, a.o_proj] if isinstance(a, KdaLayerWeights) else [a.a_proj, a.q_b, a.o_proj]
            if isinstance(f, DenseMlpWeights):
                lins += [f.gate_up, f.down]
            else:
                lins += [x for x in (f.latent_down, f.latent_up) if x is not None]
                lins += [f.shared.gate_up, f.shared.down] if f.shared is not None else []
            out += [(x.n, x.k) for x in lins if x is not None]
        return out

    def _shapes_arg(self):
        """None when the ops resolve kernels through the enumerator (make_ops), else the weights' shapes."""
        return None if getattr(self.ops, "menu", None) is not None else self.gemm_shapes()

    def kernel_specs(self) -> list:
        return self.ops.specs(self._shapes_arg()) if self.ops.kind == "kernel" else []

    def max_tokens(self) -> int:
        """The most positions a sequence can hold (its block-table row): what mla_decode plans for."""
        return self.cache.max_pages_per_seq * self.layout.page

    def load_kernels(self) -> None:
        """Every kernel loaded and every mla_decode split plan made for the captured batch sizes:
        what capture needs so that it never compiles or allocates from host data."""
        if self.ops.kind == "kernel":
            self.ops.load_all(self._shapes_arg(), self.tcfg.graph_batch_sizes, self.max_tokens())

    def _ffn(self, i: int, xn: QAct) -> torch.Tensor:
        """The FFN's output (not added to the stream) for its normed, quantized input xn."""
        lw = self.w.layers[i]
        if isinstance(lw.ffn, DenseMlpWeights):
            return L.dense_mlp(self.ops, lw.ffn, xn, self.cfg)     # TP: the down GEMM's partials summed (RankOps)
        if self.par is None:
            return L.moe(self.ops, lw.ffn, xn, self.cfg)
        return L.moe(self.ops, lw.ffn, xn, self.cfg, part=self._moe_part)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.par is None:
            return self.w.embed[tokens.long()].float()
        # Vocabulary-parallel: the rank's rows, zeros elsewhere; one rank holds each token, so the sum is exact.
        t = tokens.long() - self._vocab.start
        mine = (t >= 0) & (t < self.w.embed.shape[0])
        e = self.w.embed[t.clamp(0, self.w.embed.shape[0] - 1)].float()
        return self.par.reduce_sum(torch.where(mine[:, None], e, torch.zeros_like(e)))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head (FP32, PyTorch) of the output mix h [M, hidden] FP32."""
        x = L.rms_norm(h, self.w.final_norm, self.cfg.eps)
        logits = lm_head(x.float(), self.w.lm_head.float())
        return logits if self.par is None else self.par.gather_cat(logits, dim=-1)

    def _run(self, tokens: torch.Tensor, attn) -> torch.Tensor:
        """The residual stream (ffn_ops.ResStream, arch.AttnResStream's protocol: Attention Residuals
        over blocks of cfg.attn_res_block layers, the plain sum when None): each layer's attention
        and FFN read a mix of the stream through their own pseudo-query, normed by the layer's
        RMSNorm and quantized for its first GEMMs in the same op (attn_res), and write their output
        back (the next mix adds it); the output query mixes once more, normed by the final norm."""
        s = ResStream(self.ops, self._embed(tokens), self.cfg, self._n_sources)
        for i, lw in enumerate(self.w.layers):
            s.add_attn(i, attn(i, lw, s.attn_input(lw.attn_res, lw.input_norm)))
            s.add_ffn(self._ffn(i, s.ffn_input(lw.mlp_res, lw.post_norm)))
        return self._logits(s.output(self.w.output_res, self.w.final_norm))

    # -- device core (graph-safe on the kernel path) ----------------------------------------------
    def step_core(self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, T: int) -> torch.Tensor:
        """tokens [B * T] int, slots/start [B] int32 -> logits [B * T, vocab] FP32."""
        B = slots.shape[0]
        st = L.Step(slots=slots, start=start, block_table=self.cache.block_table[slots.long()], T=T,
                    cu_rows=torch.arange(0, B * T + 1, T, dtype=torch.int32, device=slots.device))
        c = self.cache

        def attn(i, lw, xn):
            if self.cfg.kind(i) == "kda":
                return L.kda_step(self.ops, lw.attn, xn, c.state[i], st)
            return L.mla_step(self.ops, lw.attn, xn, c.kv[i], self.layout, c.kv_scale[i], st, self.cfg.eps)
        return self._run(tokens, attn)

    # -- host steps -------------------------------------------------------------------------------
    def _i32(self, xs) -> torch.Tensor:
        return torch.tensor(list(xs), dtype=torch.int32, device=self.device)

    def prefill(self, seq_ids: list[int], prompts: list[list[int]], all_logits: bool = False,
                resume: bool | list[bool] = False) -> torch.Tensor:
        """Prefill prompt tokens (each piece >= 1 token) as one varlen batch. Returns the logits of
        each piece's last token [B, vocab], or of every token [N, vocab] with all_logits.

        `resume` (one bool, or one per sequence) chooses what each sequence is: False admits a new
        sequence (a state slot and pages for its piece + max_drafts + 1 positions) whose piece starts
        at position 0; True continues one already in the cache: its piece is appended at its length
        (chunked prefill: a long prompt in pieces, or more prompt after decode steps), its
        reservation extended to length + piece + max_drafts + 1. New and continued sequences may
        share a batch. A continued piece starts from the cached KDA state and conv window
        (kda_prefill's `resume`; a state left by verify + commit is folded first, as decode folds
        it) and its MLA queries attend to the cached prefix + themselves (bottom-right causal).

        Exactness (the reference path; tests/nogpu/modeling/test_model_chunked_prefill_cpu.py): with
        FP32 SSM and BF16 KV, a prompt prefilled in any pieces gives the logits, state, conv window
        and KV rows of one piece bit for bit (every op is row-invariant; the FP32 LM head aside,
        which the tests make row-invariant). BF16 SSM rounds the KDA state to BF16 at each piece
        boundary (it is stored between calls, as decode stores it); FP8 KV gives the prefix's keys
        their FP8 quantization (one piece attends to the computed rows). Both stay within bounds
        measured there. NVFP4 KV has no chunked prefill (SPEC.md section 5: a partial 16-token tile's
        scale is not final): `resume` raises SpecError.

        All or nothing: bad input (empty piece, repeated id, an id new where `resume` says
        continued or the reverse: CacheStateError) or a batch that does not fit (CacheCapacityError)
        raises before anything is written, leaving the cache as it was."""
        c = self.cache
        B = len(seq_ids)
        res = [bool(resume)] * B if isinstance(resume, bool) else [bool(r) for r in resume]
        if len(prompts) != B or len(res) != B:
            raise SpecError("prompts/resume", (len(prompts), len(res)), [B], "one per sequence id")
        if any(len(p) == 0 for p in prompts):
            raise SpecError("prompt", [], "at least one token per prompt")
        if len(set(seq_ids)) != B:
            raise SpecError("seq_ids", list(seq_ids), "distinct ids", "one piece per sequence and batch")
        if any(res):
            self._check_chunked("resume", True)
        for s, r in zip(seq_ids, res):
            if r != (s in c.mgr.seqs):
                raise CacheStateError(f"sequence {s} is {'not ' if r else 'already '}in the cache "
                                      f"(resume={r})")
        extra = self.tcfg.max_drafts + 1
        done: list[tuple[int, int | None]] = []      # (id, pages before) of a continued one, (id, None) admitted
        try:  # all or nothing: a request that does not fit leaves the cache as it was
            for s, p, r in zip(seq_ids, prompts, res):
                if r:
                    e = c.mgr.entry(s)
                    done.append((s, len(e.pages)))
                    c.reserve(s, e.length + len(p) + extra)
                else:
                    c.admit(s, len(p) + extra)
                    done.append((s, None))
        except Exception:
            for s, pages in reversed(done):
                if pages is None:
                    c.free(s)
                else:
                    c.unreserve(s, pages)
            raise
        starts = [c.mgr.entry(s).length for s in seq_ids]
        c.sync_kda([s for s, r in zip(seq_ids, res) if r], 1)     # the state decode would read next
        for s, p in zip(seq_ids, prompts):
            c.extend(s, len(p))
            c.mgr.entry(s).kda_mode = None                        # prefill writes both KDA views
        slots = self._i32(c.mgr.entry(s).slot for s in seq_ids)
        cu, ck = [0], [0]
        for p, st in zip(prompts, starts):
            cu.append(cu[-1] + len(p))
            ck.append(ck[-1] + st + len(p))
        pf = L.Prefill(slots=slots, cu_seqlens=self._i32(cu), cu_host=cu, block_table=c.block_table[slots.long()],
                       resume=self._i32(int(st > 0) for st in starts), max_len=max(len(p) for p in prompts),
                       start=self._i32(starts), start_host=starts, cu_k=self._i32(ck), cu_k_host=ck)
        tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)

        def attn(i, lw, xn):
            if self.cfg.kind(i) == "kda":
                return L.kda_prefill(self.ops, lw.attn, xn, c.state[i], pf)
            return L.mla_prefill(self.ops, lw.attn, xn, c.kv[i], self.layout, c.kv_scale[i], pf, self.cfg.eps)
        logits = self._run(tokens, attn)
        return logits if all_logits else logits[torch.tensor(cu[1:], device=self.device) - 1]

    def _check_chunked(self, what: str, value) -> None:
        if self.tcfg.kv is KvDtype.NVFP4:
            raise SpecError(what, value, "no chunked prefill with NVFP4 KV", "SPEC.md section 5: a 16-token tile's "
                            "scale is final only once the tile is complete; prefill such prompts in one piece")

    def prefill_pieces(self, seq_ids: list[int], prompts: list[list[int]], chunk: int) -> torch.Tensor:
        """Admit the prompts and prefill them in pieces of at most `chunk` tokens (`prefill`, then
        `prefill(resume=True)` for the prompts with tokens left, in one batch per round). Returns
        each prompt's last-token logits [B, vocab]. Refused before anything runs: NVFP4 KV with a
        prompt longer than `chunk`. A later piece that does not fit releases every sequence of this
        call and raises (slots, pages and block table as before the call; a freed slot's KDA pools
        keep the released sequence's state, as after any release: an admission never reads them)."""
        if chunk < 1:
            raise SpecError("chunk", chunk, ">= 1")
        if len(prompts) != len(seq_ids):
            raise SpecError("prompts", len(prompts), [len(seq_ids)], "one per sequence id")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise SpecError("prompts", [len(p) for p in prompts], "at least one prompt, each >= 1 token")
        if any(len(p) > chunk for p in prompts):
            self._check_chunked("chunk", chunk)
        out: list[torch.Tensor] = [None] * len(seq_ids)
        admitted = False
        try:
            for off in range(0, max(len(p) for p in prompts), chunk):
                live = [b for b, p in enumerate(prompts) if len(p) > off]
                lg = self.prefill([seq_ids[b] for b in live], [prompts[b][off:off + chunk] for b in live],
                                  resume=off > 0)
                admitted = True
                for b, row in zip(live, lg):
                    out[b] = row
        except Exception:
            if admitted:
                self.release(seq_ids)
            raise
        return torch.stack(out)

    def prepare(self, seq_ids: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host bookkeeping of a step of T tokens per sequence: pages, lengths. Returns (slots, start)."""
        c = self.cache
        c.sync_kda(seq_ids, T)
        start = []
        for s in seq_ids:
            start.append(c.mgr.entry(s).length)
            c.extend(s, T)
        return self._i32(c.mgr.entry(s).slot for s in seq_ids), self._i32(start)

    def decode(self, seq_ids: list[int], tokens: list[int]) -> torch.Tensor:
        """One token per sequence (eager). Returns logits [B, vocab]."""
        slots, start = self.prepare(seq_ids, 1)
        return self.step_core(torch.tensor(tokens, device=self.device), slots, start, 1)

    def verify(self, seq_ids: list[int], tokens: list[list[int]]) -> torch.Tensor:
        """Golden token + M drafts per sequence (eager). Returns logits [B, 1 + M, vocab]; call
        `commit` with the accepted counts next."""
        T = 1 + self.tcfg.max_drafts
        if any(len(t) != T for t in tokens):
            raise SpecError("verify tokens", [len(t) for t in tokens], f"{T} per sequence (1 + max_drafts)")
        slots, start = self.prepare(seq_ids, T)
        flat = torch.tensor([x for t in tokens for x in t], device=self.device)
        return self.step_core(flat, slots, start, T).view(len(seq_ids), T, -1)

    def commit(self, seq_ids: list[int], accepted: list[int]) -> None:
        """After a verify step: `accepted[b]` of the 1 + M tokens stay (golden included)."""
        T = 1 + self.tcfg.max_drafts
        for s, a in zip(seq_ids, accepted):
            if not 1 <= a <= T:
                raise SpecError("accepted", a, f"1..{T}")
            self.cache.rewind(s, T - a)
        slots = self._i32(self.cache.mgr.entry(s).slot for s in seq_ids)
        acc = self._i32(accepted)
        for i in self.cfg.kda_layer_ids:
            kda_commit(self.cache.state[i]["pending"], slots, acc)

    def release(self, seq_ids) -> None:
        for s in seq_ids:
            self.cache.free(s)
