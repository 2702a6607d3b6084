"""The PyTorch collector's communicators, as every member names them, and the job's
layout as declared (:class:`CommBook`).

A process group is a communicator named by a stable hash of its member ranks, so every
member names it the same way; groups of the same ranks are one communicator, with one
sequence of calls. A job torchrun started again gets new names (the restart count is
salted in), as NCCL makes new communicators. Point-to-point calls go on a two-rank
communicator per pair of ranks. Each communicator is announced once, with its role from
the declared Megatron layout (TP/PP/DP; none declared: a stage a rank, roles other).
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec

from producers.torch_calls import Comm
from schemas.enums import CommRole
from schemas.layout import Layout, comm_hash
from schemas.records import CommInfo, JobInfo, RankInfo


class CommBook:
    """One process's communicators and layout; the records announcing them wait in
    :attr:`meta` until the collector takes them (:meth:`take`)."""

    def __init__(
        self, dist: Any, *, job: str, rank: int, world: int, node: str, gpu: int, salt: str
    ) -> None:
        self.dist = dist
        self.job, self.rank, self.world, self.node, self.gpu = job, rank, world, node, gpu
        self.salt = salt  # "" for a first start, "@n" for the n-th restart
        self.roles: dict[tuple[int, ...], CommRole] = {}
        self.tp = self.pp = self.dp = 1
        self.layout = Layout(world, 1, 1, 1)  # none told: a stage a rank
        self.groups: dict[int, Comm] = {}  # id(process group) -> communicator
        self.pairs: dict[tuple[int, int], Comm] = {}  # (low, high) global ranks
        self.meta: list[msgspec.Struct] = []
        self._announced: set[int] = set()

    def declare(
        self,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        num_layers: int = 0,
        num_microbatches: int = 1,
        global_batch_size: int = 0,
        micro_batch_size: int = 0,
        gpus_per_node: int | None = None,
        distributed_optimizer: bool = False,
        ep: int = 1,
    ) -> None:
        """The job's parallel layout (Megatron order; ``ep``: expert parallelism, out of
        data parallelism); rank 0 publishes the job record. Communicators met before are
        announced again, with their roles in it."""
        dp = dp or self.world // (tp * pp)
        self.tp, self.pp, self.dp = tp, pp, dp
        self.layout = Layout(self.world, tp, pp, dp, ep=ep)
        self.roles = self.layout.groups()
        now = time.time_ns()
        if self.rank == 0:
            self.meta.append(
                JobInfo(
                    job=self.job,
                    ts_ns=now,
                    source="torch",
                    world_size=self.world,
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    num_layers=num_layers,
                    global_batch_size=global_batch_size,
                    micro_batch_size=micro_batch_size,
                    num_microbatches=num_microbatches,
                    gpus_per_node=gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 8)),
                    distributed_optimizer=distributed_optimizer,
                    ep=ep,
                )
            )
        stage, d, t = self.layout.coords(self.rank)
        self.meta.append(
            RankInfo(
                job=self.job,
                ts_ns=now,
                rank=self.rank,
                node=self.node,
                gpu=self.gpu,
                tp_rank=t,
                pp_stage=stage,
                dp_rank=d,
                ep_rank=d % ep,
            )
        )
        self._announced.clear()
        for c in [*self.groups.values(), *self.pairs.values()]:
            self._announce(c)

    def of(self, group: Any) -> Comm:
        """The communicator of ``group`` (None: the default one). Groups of the same ranks
        are one communicator, one sequence: ``None`` and the default group object (which
        DDP passes) are, and so are two groups made of the same ranks (every member
        issues their calls in the program's order, so the numbers agree)."""
        c = self.groups.get(id(group))
        if c is None:
            dist = self.dist
            g = group if group is not None else dist.distributed_c10d._get_default_group()
            ranks = tuple(dist.get_process_group_ranks(g))
            h = comm_hash(f"group{self.salt}", ranks)
            c = next((x for x in self.groups.values() if x.hash == h), None)
            if c is None:
                c = Comm(h, ranks, self.rank)
                self._announce(c)
            self.groups[id(group)] = c
        return c

    def pair(self, peer: int) -> Comm:
        """The two-rank communicator of this rank's transfers with ``peer``."""
        key = (min(self.rank, peer), max(self.rank, peer))
        c = self.pairs.get(key)
        if c is None:
            c = self.pairs[key] = Comm(comm_hash(f"p2p{self.salt}", key), key, self.rank)
            self._announce(c)
        return c

    def distinct(self) -> list[Comm]:
        """Every communicator met, once each."""
        return list({c.hash: c for c in [*self.groups.values(), *self.pairs.values()]}.values())

    def take(self) -> list[msgspec.Struct]:
        """The announcing records not yet taken."""
        out, self.meta = self.meta, []
        return out

    def _announce(self, c: Comm) -> None:
        if c.hash in self._announced:
            return
        self._announced.add(c.hash)
        pair = c in self.pairs.values()
        role = CommRole.PP if pair and self.pp > 1 else self.roles.get(c.ranks, CommRole.OTHER)
        if pair and self.pp == 1:
            role = CommRole.OTHER
        stage = min(self.layout.coords(r)[0] for r in c.ranks)
        self.meta.append(
            CommInfo(
                job=self.job,
                ts_ns=time.time_ns(),
                comm_hash=c.hash,
                role=role,
                ranks=list(c.ranks),
                name=f"{role.value}:{','.join(map(str, c.ranks))}",
                pp_stage=stage,
            )
        )


__all__ = ["CommBook"]
