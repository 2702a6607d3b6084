"""Megatron's rank layout, in one place: coordinates, groups, names and the 1F1B order.

Megatron numbers ranks tensor-parallel first, then along a stage's data axis (the
data-parallel replicas times the context-parallel ranks), then by pipeline stage:
``tp = r % TP``, ``d = (r // TP) % (DP x CP)``, ``stage = r // (TP x DP x CP)``.
Consecutive ranks share a node (``gpus_per_node`` of them); a rank's NIC is named
after its GPU, as the ``mlx5_N`` devices of a GPU node are.

Every reader that is told a layout (the PyTorch collector, Megatron's configuration,
MEGATRACE's logs), and the detectors that check what they observe against one, use
this module; the simulator keeps its own program of calls (it is the independent check
of the detectors), but names and places ranks the same way.

>>> lay = Layout(world=16, tp=2, pp=2, dp=4, gpus_per_node=8)
>>> lay.coords(13), lay.rank(1, 2, 1)
((1, 2, 1), 13)
>>> lay.node(13), lay.gpu(13), lay.nic(13)
('node-1', 5, 'mlx5_5')
>>> groups = lay.groups()
>>> groups[(0, 1)].value, groups[(0, 2, 4, 6)].value, groups[(0, 8)].value
('tp', 'dp', 'pp')
>>> Layout(world=4, dp=4, ep=2).groups()[(2, 3)].value  # experts: within data parallelism
'ep'
>>> one_f_one_b(stage=0, stages=2, microbatches=3)
[('forward', 0), ('forward', 1), ('backward', 0), ('forward', 2), ('backward', 1), ('backward', 2)]
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import NamedTuple

from schemas.enums import CommRole, Phase
from schemas.records import JobInfo

FWD, BWD = Phase.FORWARD.value, Phase.BACKWARD.value


class Layout(NamedTuple):
    """A job's parallel sizes and node size (``dp`` from the others when given as 0)."""

    world: int
    tp: int = 1
    pp: int = 1
    dp: int = 0
    cp: int = 1
    gpus_per_node: int = 8
    ep: int = 1

    @classmethod
    def of(cls, job: JobInfo) -> Layout:
        """The layout a job record states."""
        return cls(job.world_size, job.tp, job.pp, job.dp, job.cp, job.gpus_per_node, job.ep)

    @property
    def data(self) -> int:
        """Ranks along a stage's data axis: data-parallel replicas x context-parallel ranks."""
        return (self.dp or self.world // (self.tp * self.pp * self.cp)) * self.cp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, data-axis index, tensor-parallel index) of a global rank."""
        d = self.data
        return rank // (self.tp * d), (rank // self.tp) % d, rank % self.tp

    def rank(self, stage: int, d: int, t: int) -> int:
        """The global rank at (pipeline stage, data-axis index, tensor-parallel index)."""
        return (stage * self.data + d) * self.tp + t

    def node(self, rank: int) -> str:
        return f"node-{rank // self.gpus_per_node}"

    def gpu(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def nic(self, rank: int) -> str:
        return nic_name(self.gpu(rank))

    def groups(self) -> dict[tuple[int, ...], CommRole]:
        """Member ranks -> role of Megatron's TP, DP and PP groups (of more than one rank;
        with context parallelism, DP groups span the whole data axis), its expert-parallel
        groups (``ep`` consecutive ranks of a stage's data axis), and the world."""
        out: dict[tuple[int, ...], CommRole] = {}
        tp, pp, d = self.tp, self.pp, self.data
        for s in range(pp):
            for a in range(d if tp > 1 else 0):
                out[tuple(self.rank(s, a, t) for t in range(tp))] = CommRole.TP
            for t in range(tp if d > 1 else 0):
                out[tuple(self.rank(s, a, t) for a in range(d))] = CommRole.DP
        for a in range(d if pp > 1 else 0):
            for t in range(tp):
                out[tuple(self.rank(s, a, t) for s in range(pp))] = CommRole.PP
        ep = self.ep if self.ep > 1 and self.cp == 1 else 0  # (Megatron: not with CP)
        for s in range(pp if ep else 0):
            for t in range(tp):
                for g in range(d // ep):
                    group = tuple(self.rank(s, a, t) for a in range(g * ep, (g + 1) * ep))
                    out.setdefault(group, CommRole.EP)  # one the size of DP's is DP's
        out.setdefault(tuple(range(self.world)), CommRole.WORLD)
        return out


def comm_hash(kind: str, ranks: Iterable[int]) -> int:
    """The hash of a communicator a reader names itself (a process group, a pair of
    pipeline ranks, one inferred from calls): the same on every member, and unsigned
    63-bit.

    >>> comm_hash("group", [0, 1]) == comm_hash("group", (0, 1)) != comm_hash("p2p", [0, 1])
    True
    """
    digest = hashlib.blake2b(f"{kind}:{','.join(map(str, ranks))}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def nic_name(gpu: int) -> str:
    """The NIC of a GPU where the source does not name it (one per GPU, as on DGX nodes)."""
    return f"mlx5_{gpu}"


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved 1F1B order of (phase, micro-batch) nodes for one stage."""
    warm = min(stages - stage - 1, microbatches)
    order = [(FWD, mb) for mb in range(warm)]
    for i in range(microbatches - warm):
        order += [(FWD, warm + i), (BWD, i)]
    order += [(BWD, mb) for mb in range(microbatches - warm, microbatches)]
    return order


__all__ = ["BWD", "FWD", "Layout", "comm_hash", "nic_name", "one_f_one_b"]
