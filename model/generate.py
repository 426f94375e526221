"""Generation: batched prefill + decode, greedy and seeded sampling, speculative decoding with a
prompt-lookup (n-gram) drafter through KDA verify and multi-token MLA attention, CUDA graphs per
decode batch size on the kernel path. `python -m model generate --help` (also `k3gen generate`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3gen.errors import SpecError

from model.model import K3Model
from model.ops import RefOps


@dataclass
class Request:
    prompt: list[int]
    max_new: int
    temperature: float = 0.0          # 0: greedy
    seed: int = 0
    out: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)   # top-2 logit gap of each emitted token


def sample(logits: torch.Tensor, req: Request, gen: torch.Generator | None) -> int:
    top2 = torch.topk(logits.float(), 2).values
    req.margins.append(float(top2[0] - top2[1]))
    if req.temperature <= 0:
        return int(torch.argmax(logits))
    p = torch.softmax(logits.float().cpu() / req.temperature, -1)
    return int(torch.multinomial(p, 1, generator=gen))


def ngram_drafts(history: list[int], m: int, max_n: int = 3) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the longest
    suffix n-gram (n = max_n .. 1); padded by repeating the last token to exactly m drafts."""
    for n in range(min(max_n, len(history) - 1), 0, -1):
        tail = history[-n:]
        for i in range(len(history) - n - 1, -1, -1):
            if history[i:i + n] == tail:
                d = history[i + n:i + n + m]
                if d:
                    return (d + [d[-1]] * m)[:m]
    return [history[-1]] * m


class DecodeGraphs:
    """One CUDA graph per batch size in the target's list (and per T); a batch is padded to the
    next captured size with rows that use the cache's reserved padding slot and page. Every
    kernel is loaded (compiled) before the first capture: capture never compiles."""

    def __init__(self, model: K3Model, T: int):
        self.m, self.T = model, T
        self.graphs: dict[int, tuple] = {}

    def capture(self) -> None:
        m, dev = self.m, self.m.device
        m.load_kernels()
        pad = m.cache.pad_slot
        for B in m.tcfg.graph_batch_sizes:
            tokens = torch.zeros(B * self.T, dtype=torch.long, device=dev)
            slots = torch.full((B,), pad, dtype=torch.int32, device=dev)
            start = torch.zeros(B, dtype=torch.int32, device=dev)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):                      # warm-up on the padding slot only
                m.step_core(tokens, slots, start, self.T)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = m.step_core(tokens, slots, start, self.T)
            self.graphs[B] = (g, tokens, slots, start, out)

    def run(self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        b = slots.shape[0]
        B = self.m.tcfg.graph_size_for(b)
        g, t_buf, s_buf, p_buf, out = self.graphs[B]
        t_buf.zero_()
        s_buf.fill_(self.m.cache.pad_slot)
        p_buf.zero_()
        t_buf[: b * self.T].copy_(tokens)
        s_buf[:b].copy_(slots)
        p_buf[:b].copy_(start)
        g.replay()
        return out[: b * self.T]


class Generator:
    """`prefill_chunk`: prefill the prompts in pieces of at most that many tokens
    (K3Model.prefill_pieces); None: each prompt in one piece."""

    def __init__(self, model: K3Model, graphs: bool = False, prefill_chunk: int | None = None):
        self.m = model
        if prefill_chunk is not None and prefill_chunk < 1:
            raise SpecError("prefill_chunk", prefill_chunk, ">= 1 token, or None")
        self.prefill_chunk = prefill_chunk
        self.graphs: dict[int, DecodeGraphs] = {}
        if graphs:
            if model.device.type != "cuda" or model.ops.kind != "kernel":
                raise SpecError("graphs", True, [False], "CUDA graphs need the kernel path on a GPU")
            for T in {1, 1 + model.tcfg.max_drafts}:
                self.graphs[T] = DecodeGraphs(model, T)
                self.graphs[T].capture()
        self._next_id = 0
        self.accepted: list[int] = []   # drafts accepted per verify row (statistics, tests)

    def _prefill(self, ids: list[int], prompts: list[list[int]]) -> torch.Tensor:
        if self.prefill_chunk is None:
            return self.m.prefill(ids, prompts)
        return self.m.prefill_pieces(ids, prompts, self.prefill_chunk)

    def step(self, ids: list[int], tokens: list[int], T: int) -> torch.Tensor:
        """Logits [B T, vocab] of one decode (T = 1) or verify (T = 1 + drafts) step of the sequences
        `ids` on their flat tokens: the captured CUDA graph of the batch's size where there is one."""
        slots, start = self.m.prepare(ids, T)
        t = torch.tensor(tokens, device=self.m.device)
        if T in self.graphs:  # the graph's output buffer is overwritten by the next replay
            return self.graphs[T].run(t, slots, start).clone()
        return self.m.step_core(t, slots, start, T)

    def generate(self, reqs: list[Request], speculative: bool = False, on_token=None, drafter=None) -> list[Request]:
        """Run the requests as one batch to completion; returns them with `out` filled.
        `drafter(request_index, history, m)` replaces the n-gram drafter (tests use oracles)."""
        M = self.m.tcfg.max_drafts
        if speculative and (M == 0 or any(r.temperature > 0 for r in reqs)):
            raise SpecError("speculative", True, [False], "needs max_drafts > 0 and greedy requests")
        ids = list(range(self._next_id, self._next_id + len(reqs)))
        self._next_id += len(reqs)
        gens = [torch.Generator().manual_seed(r.seed) for r in reqs]
        logits = self._prefill(ids, [r.prompt for r in reqs])
        try:
            for r, g, lg in zip(reqs, gens, logits):
                r.out.append(sample(lg, r, g))
                if on_token:
                    on_token(1)
            live = [i for i, r in enumerate(reqs) if len(r.out) < r.max_new]
            while live:
                if speculative:
                    self._spec_step(reqs, ids, live, M, on_token, drafter)
                else:
                    lg = self.step([ids[i] for i in live], [reqs[i].out[-1] for i in live], 1)
                    for i, row in zip(live, lg):
                        reqs[i].out.append(sample(row, reqs[i], gens[i]))
                        if on_token:
                            on_token(1)
                live = [i for i in live if len(reqs[i].out) < reqs[i].max_new]
        finally:
            self.m.release(ids)
        for r in reqs:
            del r.out[r.max_new:]
        return reqs

    def _spec_step(self, reqs, ids, live, M, on_token, drafter) -> None:
        T = 1 + M
        rows = []
        for i in live:
            r = reqs[i]
            d = drafter(i, r.prompt + r.out, M) if drafter else ngram_drafts(r.prompt + r.out, M)
            rows.append([r.out[-1]] + list(d))
        lg = self.step([ids[i] for i in live], [x for row in rows for x in row], T).view(len(live), T, -1)
        accepted = []
        for i, row, l in zip(live, rows, lg):
            r = reqs[i]
            n = 0
            while True:
                tok = sample(l[n], r, None)
                r.out.append(tok)
                if on_token:
                    on_token(1)
                if n < M and tok == row[1 + n] and len(r.out) < r.max_new:
                    n += 1
                    continue
                break
            accepted.append(1 + n)
        self.m.commit([ids[i] for i in live], accepted)
        self.accepted.extend(a - 1 for a in accepted)

    def teacher_forced(self, prompts: list[list[int]], targets: list[list[int]]) -> list[torch.Tensor]:
        """Logits [len(target), vocab] per request: prefill the prompt, then decode feeding the
        target tokens (the decode path, graphs included, is what gets scored)."""
        ids = list(range(self._next_id, self._next_id + len(prompts)))
        self._next_id += len(prompts)
        out = [[lg] for lg in self._prefill(ids, prompts)]
        try:
            for step in range(max(len(t) for t in targets) - 1):
                live = [i for i, t in enumerate(targets) if step + 1 < len(t)]
                lg = self.step([ids[i] for i in live], [targets[i][step] for i in live], 1)
                for i, row in zip(live, lg):
                    out[i].append(row)
        finally:
            self.m.release(ids)
        return [torch.stack(o).float().cpu() for o in out]


# -- command line ----------------------------------------------------------------------------------
def random_checkpoint(cfg, seed: int) -> tuple[str, bool]:
    """(folder, written) of the random checkpoint of `cfg` and `seed`, made once in the k3gen cache
    folder's checkpoints/ and reused. Its key covers the config's every field, the seed and the
    writer's source (model/checkpoint.py), so a changed writer makes a new one."""
    import dataclasses
    import hashlib
    import json
    import re

    import model.checkpoint as ck
    from k3gen.pipeline.store import cached_checkpoint
    h = hashlib.sha256(json.dumps({"config": dataclasses.asdict(cfg), "seed": seed}, sort_keys=True,
                                  default=str).encode())
    h.update(Path(ck.__file__).read_bytes())
    name = re.sub(r"[^A-Za-z0-9_.]", "_", cfg.name)[:40]   # a config.json's name may be a path
    key = f"{name}-s{seed}-{h.hexdigest()[:16]}"
    folder, written = cached_checkpoint(key, lambda d: ck.write_random_checkpoint(cfg, d, seed=seed))
    return str(folder), written


def load_rank_weights(checkpoint, cfg, recipe, par=None, device="cpu"):
    """The weights this rank holds, on `device`: the whole model without `par` (or at world size 1),
    else the rank's share in model/shard.py's format, read from the checkpoint in any published
    layout (model/formats/detect.py load_model_weights: each rank reads only its share, streamed
    layer by layer). Every rank reports whether it loaded (`Parallel.agree`): a rank that failed
    raises its own error, every other rank RankFailedError, none waits for it."""
    from model.formats.detect import load_model_weights
    if par is None or par.world == 1:
        return load_model_weights(checkpoint, cfg, recipe, device=device)
    from model.shard import check_shardable
    w, err = None, None
    try:
        check_shardable(cfg, par.layout)         # the layout's own errors before reading anything
        p = par.place
        w = load_model_weights(checkpoint, cfg, recipe, rank=p.rank, world=p.world, ep=p.layout.ep, device=device)
    except Exception as e:                        # noqa: BLE001 - reported to every rank, then raised here
        err = e
    par.agree("loading the weights", err)
    return w


def build_model(config, arch: str, kv: str, ssm: str, max_drafts: int, path: str, checkpoint: str | None,
                seed: int, device: str, max_seq_len: int, max_slots: int, budget_gib: float | None = None,
                par=None, graph_batch_sizes: tuple[int, ...] | None = None, invariant: bool | None = None):
    """`config`: a preset name, config.json path or ModelConfig. With `par` (model/dist.py) the model of
    its rank: the rank's weights, kernels and cache at the per-rank head counts (TargetConfig.tp = world).
    `graph_batch_sizes`: the decode graphs' batch sizes, `invariant`: TargetConfig.invariant (None: their
    TargetConfig defaults)."""
    from model.cache import HybridCache
    from model.config import ModelConfig, TargetConfig, get_config
    cfg = config if isinstance(config, ModelConfig) else get_config(config)
    tp, ep = (1, 1) if par is None else (par.world, par.layout.ep)
    extra = {} if graph_batch_sizes is None else {"graph_batch_sizes": tuple(graph_batch_sizes)}
    if invariant is not None:
        extra["invariant"] = invariant
    tcfg = TargetConfig(arch=arch, kv=kv, ssm=ssm, max_drafts=max_drafts, path=path, tp=tp, ep=ep, **extra)
    if checkpoint is None:
        checkpoint = random_checkpoint(cfg, seed)[0]
    w = load_rank_weights(checkpoint, cfg, tcfg.recipe, par, device)
    if budget_gib:
        cache = HybridCache.from_budget(cfg, tcfg, int(budget_gib * 2**30), max_seq_len, device, max_slots)
    else:
        pages = max_slots * -(-(max_seq_len + max_drafts + 1) // tcfg.kv_layout().page)
        cache = HybridCache(cfg, tcfg, max_slots, pages, max_seq_len, device)
    # The reference ops with the config's KDA gate (make_ops' RefOps takes the bounded gate only:
    # Kimi-Linear's softplus gate would run as K3's).
    ops = RefOps(tcfg.recipe, gate=cfg.kda_gate) if tcfg.path == "reference" else None
    return K3Model(w, tcfg, cache, ops=ops, par=par)


def config_name(a) -> str:
    """--config, or without it the --checkpoint folder's config.json (else the small preset)."""
    if getattr(a, "config", None):
        return a.config
    return a.checkpoint if getattr(a, "checkpoint", None) else "small"


def check_request(a, cfg) -> None:
    """What the arguments ask of the model config, checked right after it is read (before weights):
    every prompt id in [0, vocab), the prompt and the new tokens within --max-seq-len."""
    for t in a.prompt_ids:
        if not 0 <= t < cfg.vocab:
            raise SpecError("--prompt-ids", t, f"token ids in [0, {cfg.vocab})", f"the vocab of {cfg.name}")
    need = len(a.prompt_ids) + a.max_new
    if need > a.max_seq_len:
        raise SpecError("--max-seq-len", a.max_seq_len, f">= {need}",
                        f"the prompt's {len(a.prompt_ids)} tokens + --max-new {a.max_new}")


def check_arguments(a) -> str:
    """The checks that need no config: flags that do not go together, and a GPU where one is asked
    for. Returns the path that runs."""
    if a.spec > 0 and a.temperature > 0:
        raise SpecError("--spec", a.spec, [0],
                        f"speculative decoding is greedy: not with --temperature {a.temperature:g}")
    if getattr(a, "prefill_chunk", None) and a.kv == "nvfp4":
        raise SpecError("--prefill-chunk", a.prefill_chunk, "no chunked prefill with --kv nvfp4",
                        "SPEC.md section 5: NVFP4 KV prefills each prompt in one piece")
    if a.graphs and a.path == "reference":
        raise SpecError("--graphs", True, [False], "CUDA graphs need the kernel path (--path kernel or auto on a GPU)")
    cuda = a.path != "reference" and torch.cuda.is_available()
    if (a.path == "kernel" or a.graphs) and not cuda:
        from k3gen.envinfo import no_gpu_reason
        why = f"no CUDA GPU: {no_gpu_reason(torch)}"
        if a.path == "kernel":
            raise SpecError("--path", "kernel", ["reference"], why)
        raise SpecError("--graphs", True, [False], why + "; CUDA graphs run the kernel path on a GPU")
    return "kernel" if cuda else "reference"


def parallel_for(a, cfg, device: str):
    """The Parallel of `--tp/--ep` (model/dist.py), checked against the config before any work; under
    torchrun the process group (the world size must be --tp). None for one rank launched without torchrun."""
    from model import dist
    from model.shard import check_shardable
    tp, ep = getattr(a, "tp", 1), getattr(a, "ep", 1)
    world = dist.env_world()[1]
    if tp == 1 and ep == 1 and world == 1:
        return None
    layout = dist.Layout(tp, ep)
    check_shardable(cfg, layout)
    return dist.init(layout, device, getattr(a, "dist_timeout", dist.DEFAULT_TIMEOUT_S))


def run(a) -> int:
    """`k3gen generate`: every check first (arguments, then against the config and target), then the
    checkpoint, the model and generation. A typed error propagates to the command line's main.
    Under torchrun (--tp N on N ranks) rank 0 prints and every rank checks that all generated the
    same tokens (RankMismatchError otherwise)."""
    from model.config import get_config
    path = check_arguments(a)
    device = "cuda" if path == "kernel" else "cpu"
    a.config = config_name(a)
    cfg = get_config(a.config)
    check_request(a, cfg)
    par = parallel_for(a, cfg, device)
    try:
        return _run(a, cfg, path, par)
    finally:
        if par is not None:
            par.close()


def _run(a, cfg, path: str, par) -> int:
    import os
    import sys

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from k3gen.pipeline.store import folder_bytes
    from model.config import TargetConfig
    rank0 = par is None or par.rank == 0
    device = "cpu" if path == "reference" else str(par.device) if par is not None else "cuda"
    # Logs capture output: a wide console keeps a checkpoint's path on one line there.
    con = Console(highlight=False, width=None if sys.stdout.isatty() else 200, quiet=not rank0)
    tcfg = TargetConfig(arch=a.arch, kv=a.kv, ssm=a.ssm, max_drafts=a.spec, path=path,
                        tp=1 if par is None else par.world)
    if a.graphs and a.batch > tcfg.graph_batch_sizes[-1]:
        raise SpecError("--batch", a.batch, f"<= {tcfg.graph_batch_sizes[-1]} with --graphs",
                        "the largest captured decode graph")
    if a.checkpoint is not None and not os.path.isdir(a.checkpoint):
        raise SpecError("--checkpoint", a.checkpoint, "a checkpoint folder",
                        "it is a file" if os.path.exists(a.checkpoint) else "no such folder")
    t0 = time.perf_counter()
    ckpt = a.checkpoint
    if ckpt is None:
        ckpt, written = random_checkpoint(cfg, a.seed)
        con.print(f"random checkpoint of {cfg.name} (seed {a.seed}) {'written to' if written else 'reused from'} "
                  f"{ckpt}: {folder_bytes(Path(ckpt)) / 1e6:.1f} MB (`k3gen cache clear` removes it)")
    m = build_model(cfg, a.arch, a.kv, a.ssm, a.spec, path, ckpt, a.seed, device, a.max_seq_len, a.batch, par=par,
                    invariant=getattr(a, "invariant", None))
    gen = Generator(m, graphs=a.graphs, prefill_chunk=getattr(a, "prefill_chunk", None))
    where = "" if par is None else f", {par.layout} on {par.world} ranks"
    con.print(f"{a.config} on {path} path ({device}{where}), kv={a.kv} ssm={a.ssm}, "
              f"setup {time.perf_counter() - t0:.1f}s")
    reqs = [Request(prompt=list(a.prompt_ids), max_new=a.max_new, temperature=a.temperature, seed=a.seed + i)
            for i in range(a.batch)]
    with Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[rate]}"), console=Console(stderr=True, quiet=not rank0),
                  transient=True, disable=not rank0) as prog:
        task = prog.add_task("gen", total=a.max_new * a.batch, rate="")
        t1 = time.perf_counter()

        def tick(n):
            prog.advance(task, n)
            done = prog.tasks[0].completed
            prog.update(task, rate=f"{done / max(time.perf_counter() - t1, 1e-9):.1f} tok/s")
        gen.generate(reqs, speculative=a.spec > 0, on_token=tick)
        dt = time.perf_counter() - t1
    if par is not None:
        par.check_equal([t for r in reqs for t in r.out])
    for i, r in enumerate(reqs):
        con.print(f"[{i}] {r.out}")
    n = sum(len(r.out) for r in reqs)
    con.print(f"{n} tokens in {dt:.2f}s: {n / dt:.1f} tokens/s" + ("" if par is None else ", the same on every rank"))
    return 0
