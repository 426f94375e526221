"""Tensor and expert parallelism over torch.distributed: the layout of the ranks, process-group set-up
(`torchrun`'s env://; NCCL on GPUs, gloo on CPUs) and the few collectives the model issues.

Layout (`Layout(world, ep)`): attention is split by heads over all `world` ranks (attention TP = world,
no attention DP); the dense MLP, the shared experts and the vocabulary (embedding and LM head) too. The
routed experts are split by id over `ep` ranks and each expert's intermediate over `moe_tp = world // ep`
ranks, SGLang's convention: `ep_rank = rank // moe_tp`, `moe_tp_rank = rank % moe_tp` (K3 as served on 16
GPUs: `Layout(16, ep=4)`, TP16 attention with MoE TP4 x EP4).

Determinism: every reduction is an all-gather followed by a sum in rank order on every rank (`reduce_sum`),
never the backend's all-reduce, whose order depends on NCCL's algorithm and the ranks' topology. Every rank
then holds bitwise the same sums, so the same logits and tokens, run after run.

World size 1 issues no collective and needs no process group: `Parallel.single()`, and the model takes its
unsplit path (model/model.py).

Failure: a rank that fails (to load, say) reports it through `agree` and the others raise `RankFailedError`
at once; a rank that dies or hangs before it gets there leaves the others in a collective that the process
group's timeout ends (`CollectiveError` / `CollectiveTimeoutError`), so no rank waits forever.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from k3gen.errors import K3genError, SpecError

DEFAULT_TIMEOUT_S = 600.0


class DistError(K3genError):
    """Tensor/expert parallel execution failed on this or another rank."""


class RankFailedError(DistError):
    """Another rank reported a failure (its own error is raised there)."""


class CollectiveError(DistError):
    """A collective failed: a peer died or the process group broke."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within the process group's timeout (a peer hung or died)."""


class RankMismatchError(DistError):
    """The ranks disagree on what must be identical everywhere (the generated tokens)."""


@dataclass(frozen=True)
class Layout:
    """`world` ranks; routed experts over `ep` of them (a divisor of world), intermediates over world // ep."""
    world: int
    ep: int = 1

    def __post_init__(self):
        for f in ("world", "ep"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f, v, "a positive int")
        if self.world % self.ep:
            raise SpecError("ep", self.ep, f"divisors of the world size {self.world}",
                            "the EP groups partition the ranks (attention TP = world)")

    @property
    def moe_tp(self) -> int:
        return self.world // self.ep

    def check(self, cfg) -> None:
        """SpecError unless `cfg` splits exactly (heads, experts, vocab, intermediates); the block
        alignment of the packed weights is model/shard.py's check."""
        from model.params import check_parallel
        check_parallel(cfg, self.world, self.ep)
        for f, n, by in (("vocab", cfg.vocab, self.world), ("dense_inter", cfg.dense_inter, self.world),
                         ("shared_inter", cfg.shared_inter, self.world), ("moe_inter", cfg.moe_inter, self.moe_tp)):
            if n % by:
                raise SpecError(f, n, f"multiples of {by}", f"split over the ranks of {self}")

    def place(self, rank: int) -> "Place":
        if not 0 <= rank < self.world:
            raise SpecError("rank", rank, f"0..{self.world - 1}")
        return Place(self, rank)

    def __str__(self) -> str:
        return f"TP{self.world}" + (f" (MoE TP{self.moe_tp} x EP{self.ep})" if self.ep > 1 else "")


@dataclass(frozen=True)
class Place:
    """One rank of a layout: its attention TP slot (rank, world), its MoE TP and EP slots."""
    layout: Layout
    rank: int

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def tp(self) -> tuple[int, int]:
        return self.rank, self.layout.world

    @property
    def moe_tp(self) -> tuple[int, int]:
        return self.rank % self.layout.moe_tp, self.layout.moe_tp

    @property
    def ep(self) -> tuple[int, int]:
        return self.rank // self.layout.moe_tp, self.layout.ep

    def part(self, n: int, slot: tuple[int, int]) -> slice:
        """This rank's share [lo, hi) of n things split equally by `slot` = (index, count)."""
        i, k = slot
        if n % k:
            raise SpecError("split", n, f"multiples of {k}", f"rank {self.rank} of {self.layout}")
        return slice(i * (n // k), (i + 1) * (n // k))


def _ranks_groups(layout: Layout) -> tuple[list[list[int]], list[list[int]]]:
    """(MoE TP groups, EP groups) as rank lists: a TP group holds the ranks of one expert set."""
    m, ep = layout.moe_tp, layout.ep
    return [[e * m + j for j in range(m)] for e in range(ep)], [[e * m + j for e in range(ep)] for j in range(m)]


class Parallel:
    """This process's rank in a layout, with its process groups and the model's collectives."""

    def __init__(self, layout: Layout, rank: int, device: torch.device, group=None):
        self.layout, self.rank, self.device = layout, rank, torch.device(device)
        self.place = layout.place(rank)
        self.group = group                      # the world (attention TP) group; None at world size 1
        self.moe_tp_group = self.ep_group = None
        if layout.world > 1:
            import torch.distributed as dist
            tp_groups, ep_groups = _ranks_groups(layout)
            # new_group is collective: every rank creates every group, in the same order.
            for ranks in tp_groups:
                g = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    self.moe_tp_group = g
            for ranks in ep_groups:
                g = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    self.ep_group = g

    @classmethod
    def single(cls, device="cpu") -> "Parallel":
        """World size 1: no process group, no collective."""
        return cls(Layout(1), 0, torch.device(device))

    @property
    def world(self) -> int:
        return self.layout.world

    # -- collectives (fixed order) ----------------------------------------------------------------
    def _gather(self, x: torch.Tensor, what: str) -> list[torch.Tensor]:
        import torch.distributed as dist
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        try:
            dist.all_gather(parts, x, group=self.group)
        except (RuntimeError, dist.DistError) as e:
            kind = CollectiveTimeoutError if "timed out" in str(e).lower() or "timeout" in str(e).lower() \
                else CollectiveError
            raise kind(f"rank {self.rank} of {self.layout}: {what}: {str(e).splitlines()[0][:300]}") from e
        return parts

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, added in rank order (bitwise the same on every rank)."""
        if self.world == 1:
            return x
        parts = self._gather(x, "reduce_sum")
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc

    def gather_cat(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' x concatenated along `dim` in rank order."""
        if self.world == 1:
            return x
        return torch.cat(self._gather(x, "gather_cat"), dim=dim)

    def agree(self, what: str, error: BaseException | None = None) -> None:
        """Every rank says whether `what` succeeded; if any failed, every rank raises: the failed
        ones their own error, the others RankFailedError naming them."""
        if self.world == 1:
            if error is not None:
                raise error
            return
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=self.device)
        try:
            bad = [r for r, f in enumerate(self._gather(flag, f"agree on {what}")) if int(f.item())]
        except CollectiveError:
            if error is not None:     # this rank's own failure is the news, not the broken group
                raise error from None
            raise
        if error is not None:
            raise error
        if bad:
            raise RankFailedError(f"rank {self.rank}: {what} failed on rank(s) {bad} of {self.layout}")

    def check_equal(self, ids: list[int], what: str = "tokens") -> None:
        """RankMismatchError on every rank unless every rank holds the same ids."""
        if self.world == 1:
            return
        n = torch.tensor([len(ids)], dtype=torch.int64, device=self.device)
        lens = [int(x.item()) for x in self._gather(n, f"check {what}")]
        if len(set(lens)) > 1:
            raise RankMismatchError(f"{what}: lengths {lens} differ across ranks")
        t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        got = [p.cpu().tolist() for p in self._gather(t, f"check {what}")]
        bad = [r for r, g in enumerate(got) if g != got[0]]
        if bad:
            i = next(j for j in range(len(ids)) if any(got[r][j] != got[0][j] for r in bad))
            raise RankMismatchError(f"{what}: rank(s) {bad} differ from rank 0, first at position {i} "
                                    f"({[g[i] for g in got]})")

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:     # noqa: BLE001 - a broken group cannot be torn down cleanly
                    pass


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); 0, 1, 0 without."""
    def get(name, default):
        v = os.environ.get(name, default)
        try:
            return int(v)
        except ValueError:
            raise SpecError(name, v, "an integer", "set by torchrun") from None
    return get("RANK", "0"), get("WORLD_SIZE", "1"), get("LOCAL_RANK", "0")


def init(layout: Layout, device_type: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None,
         device: torch.device | None = None) -> Parallel:
    """This process's Parallel for `layout`, launched by torchrun (env://): NCCL on CUDA, gloo on the CPU
    (`backend` overrides: gloo with CUDA tensors runs several ranks on one GPU); the device is cuda:LOCAL_RANK
    (`device` overrides). The world size must be the layout's; world size 1 creates no process group.
    Every collective of the group fails after `timeout_s` instead of waiting for a rank that will never come."""
    if backend not in (None, "gloo", "nccl"):
        raise SpecError("backend", backend, ["gloo", "nccl"])
    rank, world, local = env_world()
    if world != layout.world:
        raise SpecError("WORLD_SIZE", world, [layout.world],
                        f"{layout} runs on {layout.world} ranks: torchrun --nproc-per-node {layout.world}")
    if not 0 <= rank < world:
        raise SpecError("RANK", rank, f"0..{world - 1}")
    if device is None:
        device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1:
        return Parallel(layout, 0, device)
    import torch.distributed as dist
    if not timeout_s > 0:
        raise SpecError("timeout_s", timeout_s, "> 0")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        kw = {"device_id": device} if backend == "nccl" else {}
        try:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s), **kw)
        except (RuntimeError, dist.DistError, ValueError) as e:
            raise CollectiveError(f"rank {rank}: process group ({backend}, env://) not formed: {e}") from e
    return Parallel(layout, rank, device, group=dist.group.WORLD)


__all__ = ["Layout", "Place", "Parallel", "init", "env_world", "DistError", "RankFailedError", "CollectiveError",
           "CollectiveTimeoutError", "RankMismatchError", "DEFAULT_TIMEOUT_S"]
