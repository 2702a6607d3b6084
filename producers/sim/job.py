"""The simulated job: Megatron-style hybrid parallelism, its rank layout and communicators.

Rank layout (Megatron): ``tp = r % TP``, ``dp = (r // TP) % DP``,
``pp = r // (TP * DP)``; nodes hold ``gpus_per_node`` consecutive ranks, one
NIC per GPU. With context parallelism Megatron's order is tp-cp-dp-pp: the
"data axis" of a stage then has ``DP * CP`` ranks, ``d = cp + CP * dp``, and
everything below indexes ranks by (stage, d, tp).

Communicators:

* TP: one per (pp stage, dp index), members in tp order;
* DP: one per (pp stage, tp index), members in dp order;
* PP: one two-member communicator per adjacent stage pair and (dp, tp), as
  PyTorch's NCCL backend creates for point-to-point traffic. For Send/Recv the
  sequence number counts transfers from the sender to its peer, so the n-th
  Send from A to B matches the n-th Recv at B from A;
* EP (with ``ep > 1``, a mixture-of-experts model): the data-parallel ranks of
  a (stage, tp index) split into groups of ``ep`` consecutive dp indices, as
  Megatron carves expert-parallel groups out of data parallelism. Every layer's
  MLP is a MoE layer: an AllToAll dispatches tokens to the experts and another
  combines them, in the forward and again in the backward pass.

* CP (with ``cp > 1``, context parallelism: each rank holds ``1/CP`` of the
  sequence): one communicator per group of ``cp`` consecutive data-axis
  ranks. Attention needs the whole sequence's keys and values, exchanged as
  Megatron/Transformer Engine's ``all_gather`` context-parallel mode does: per
  layer, two AllGathers (keys, values) in the forward pass, and an AllGather
  of keys and values plus a ReduceScatter of their gradients in the backward
  pass. Gradients are reduced over the DP x CP ranks (the DP communicator
  spans the data axis). CP with EP is refused (not simulated).

>>> spec = JobSpec(tp=2, pp=2, dp=2, num_layers=4, global_batch_size=8)
>>> spec.world_size, spec.num_microbatches, spec.coords(5)
(8, 4, (1, 0, 1))
>>> layout = Layout(spec)
>>> layout.comms[layout.tp_comm[1, 0]].ranks
[4, 5]
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from schemas import layout as megatron
from schemas.enums import CommRole, Schedule
from schemas.records import CommInfo, JobInfo, RankInfo


class SpecError(ValueError):
    """An impossible job description."""


@dataclass(frozen=True)
class JobSpec:
    """What is trained and how it is parallelised, plus the timing model's constants."""

    job: str = "sim-job"
    tp: int = 2
    pp: int = 2
    dp: int = 2
    cp: int = 1
    ep: int = 1
    num_layers: int = 8
    hidden: int = 4096
    seq_len: int = 4096
    micro_batch_size: int = 1
    global_batch_size: int = 16
    gpus_per_node: int = 8
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    #: pipeline transfers batched over the pipeline group's communicator (Megatron's
    #: batch_isend_irecv), not over one communicator per pair of stages (single sends)
    pp_group_comm: bool = False
    #: heartbeats report the transfers' progress too (the PyTorch collector's do; the NCCL
    #: plugin's count collectives only, and a pipeline group's transfers have no one count)
    heartbeat_p2p: bool = True
    # timing model
    fwd_ms_per_layer: float = 1.0
    bwd_ratio: float = 2.0
    optimizer_ms: float = 4.0
    jitter_cv: float = 0.02
    rank_speed_cv: float = 0.004
    rank_lateness_us: float = 60.0
    host_lead_us: float = 150.0
    nvlink_gbytes_s: float = 300.0
    nic_gbytes_s: float = 45.0
    latency_us: float = 12.0
    nchannels: int = 2
    clock_skew_us: float = 20.0
    heartbeat_interval_ms: float = 250.0
    kernels: bool = True
    t0_ns: int = 1_790_000_000_000_000_000
    seed: int = 0

    @property
    def pp_groups(self) -> bool:
        """Whether pipeline transfers go over pipeline-group communicators (more than a pair)."""
        return self.pp_group_comm and self.pp > 2

    def __post_init__(self) -> None:
        for name in (
            "tp",
            "pp",
            "dp",
            "cp",
            "ep",
            "num_layers",
            "micro_batch_size",
            "gpus_per_node",
            "nchannels",
        ):
            if getattr(self, name) < 1:
                raise SpecError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cp > 1 and self.ep > 1:
            raise SpecError("context and expert parallelism together are not simulated")
        if self.seq_len % self.cp:
            raise SpecError(f"seq_len {self.seq_len} is not divisible by cp {self.cp}")
        if self.dp % self.ep:
            raise SpecError(
                f"ep {self.ep} must divide dp {self.dp}: expert-parallel groups are carved "
                f"out of the data-parallel ranks"
            )
        if self.num_layers % self.pp:
            raise SpecError(f"num_layers {self.num_layers} is not divisible by pp {self.pp}")
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            raise SpecError(
                f"global_batch_size {self.global_batch_size} is not a multiple of "
                f"micro_batch_size*dp = {per_step}"
            )
        if self.tp > self.gpus_per_node:
            raise SpecError(f"tp {self.tp} must fit in a node of {self.gpus_per_node} GPUs")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def dpc(self) -> int:
        """Ranks along a stage's data axis: data-parallel replicas x context-parallel ranks."""
        return self.dp * self.cp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.pp

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    @cached_property
    def layout(self) -> megatron.Layout:
        """How ranks are numbered and named (:mod:`schemas.layout`, shared with every reader
        and the detectors)."""
        return megatron.Layout(
            self.world_size, self.tp, self.pp, self.dp, self.cp, self.gpus_per_node
        )

    def rank(self, stage: int, d: int, tp: int) -> int:
        """The global rank at (pp stage, data-axis index, tp index)."""
        return self.layout.rank(stage, d, tp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp stage, data-axis index, tp index) of a global rank (the data-axis index is
        the dp index without context parallelism)."""
        return self.layout.coords(rank)

    def node_of(self, rank: int) -> str:
        return self.layout.node(rank)

    def gpu_of(self, rank: int) -> int:
        return self.layout.gpu(rank)

    def nic_of(self, rank: int) -> str:
        return self.layout.nic(rank)

    def job_info(self) -> JobInfo:
        return JobInfo(
            job=self.job,
            ts_ns=self.t0_ns,
            name=self.job,
            source="simulator",
            world_size=self.world_size,
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            cp=self.cp,
            ep=self.ep,
            num_layers=self.num_layers,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            num_microbatches=self.num_microbatches,
            schedule=Schedule.ONE_F_ONE_B,
            sequence_parallel=self.sequence_parallel,
            distributed_optimizer=self.distributed_optimizer,
            gpus_per_node=self.gpus_per_node,
        )


def comm_hash(job: str, name: str) -> int:
    """A stable unsigned 64-bit hash naming one communicator of a job."""
    return (zlib.crc32(f"{job}/{name}".encode()) << 32) | zlib.crc32(f"{name}@{job}".encode())


@dataclass(frozen=True)
class Comm:
    index: int
    hash: int
    role: CommRole
    ranks: list[int]
    name: str
    pp_stage: int


@dataclass
class Layout:
    """Communicator tables of a :class:`JobSpec`, as index arrays for the engine."""

    spec: JobSpec
    comms: list[Comm] = field(init=False)
    tp_comm: np.ndarray = field(init=False)  # [stage, dp] -> comm index
    dp_comm: np.ndarray = field(init=False)  # [stage, tp] -> comm index
    pp_comm: np.ndarray = field(init=False)  # [stage (lower of pair), dp, tp] -> comm index
    ep_comm: np.ndarray = field(init=False)  # [stage, d, tp] -> comm index (-1: no EP)
    cp_comm: np.ndarray = field(init=False)  # [stage, d, tp] -> comm index (-1: no CP)
    ranks: np.ndarray = field(init=False)  # [stage, d, tp] -> global rank (d: data axis)

    def __post_init__(self) -> None:
        s = self.spec
        self.comms = []
        D = s.dpc
        self.ranks = np.array(
            [[[s.rank(p, d, t) for t in range(s.tp)] for d in range(D)] for p in range(s.pp)]
        )
        self.tp_comm = np.zeros((s.pp, D), dtype=np.int64)
        self.dp_comm = np.zeros((s.pp, s.tp), dtype=np.int64)
        self.pp_comm = np.zeros((max(s.pp - 1, 1), D, s.tp), dtype=np.int64)
        self.ep_comm = np.full((s.pp, D, s.tp), -1, dtype=np.int64)
        self.cp_comm = np.full((s.pp, D, s.tp), -1, dtype=np.int64)
        for p in range(s.pp):
            for d in range(D):
                self.tp_comm[p, d] = self._add(
                    CommRole.TP, list(self.ranks[p, d]), f"tp.{p}.{d}", p
                )
            for t in range(s.tp):
                self.dp_comm[p, t] = self._add(
                    CommRole.DP, list(self.ranks[p, :, t]), f"dp.{p}.{t}", p
                )
        for d in range(D):
            for t in range(s.tp):
                if s.pp_groups:  # one communicator: the whole pipeline
                    group = [int(r) for r in self.ranks[:, d, t]]
                    self.pp_comm[:, d, t] = self._add(CommRole.PP, group, f"pp.{d}.{t}", 0)
                    continue
                for p in range(s.pp - 1):
                    pair = [int(self.ranks[p, d, t]), int(self.ranks[p + 1, d, t])]
                    self.pp_comm[p, d, t] = self._add(CommRole.PP, pair, f"pp.{p}.{d}.{t}", p)
        for role, size, table in (
            (CommRole.EP, s.ep, self.ep_comm),
            (CommRole.CP, s.cp, self.cp_comm),
        ):
            if size < 2:
                continue
            for p in range(s.pp):  # groups of consecutive data-axis ranks
                for t in range(s.tp):
                    for g in range(D // size):
                        group = slice(g * size, (g + 1) * size)
                        name = f"{role.value}.{p}.{t}.{g}"
                        table[p, group, t] = self._add(role, list(self.ranks[p, group, t]), name, p)
        self.hashes = np.array([c.hash for c in self.comms], dtype=np.uint64)
        self.sizes = np.array([len(c.ranks) for c in self.comms], dtype=np.int64)
        # rank_in_comm lookup: dict per comm
        self._rank_in = [{r: i for i, r in enumerate(c.ranks)} for c in self.comms]

    def _add(self, role: CommRole, ranks: list[int], name: str, stage: int) -> int:
        idx = len(self.comms)
        ranks = [int(r) for r in ranks]
        self.comms.append(Comm(idx, comm_hash(self.spec.job, name), role, ranks, name, stage))
        return idx

    def rank_in_comm(self, comm: int, rank: int) -> int:
        return self._rank_in[comm][rank]

    def comms_of_rank(self, rank: int) -> list[int]:
        return [c.index for c in self.comms if rank in self._rank_in[c.index]]

    def metadata(self) -> list[JobInfo | RankInfo | CommInfo]:
        """The job, rank and communicator records a real deployment would publish first."""
        s = self.spec
        out: list[JobInfo | RankInfo | CommInfo] = [s.job_info()]
        for r in range(s.world_size):
            p, d, t = s.coords(r)
            out.append(
                RankInfo(
                    job=s.job,
                    ts_ns=s.t0_ns,
                    rank=r,
                    node=s.node_of(r),
                    gpu=s.gpu_of(r),
                    nic=s.nic_of(r),
                    tp_rank=t,
                    pp_stage=p,
                    dp_rank=d // s.cp,
                    cp_rank=d % s.cp,
                )
            )
        for c in self.comms:
            out.append(
                CommInfo(
                    job=s.job,
                    ts_ns=s.t0_ns,
                    comm_hash=c.hash,
                    role=c.role,
                    ranks=c.ranks,
                    name=c.name,
                    # a pipeline group's communicator spans every stage
                    pp_stage=None if len(c.ranks) > 2 and c.role is CommRole.PP else c.pp_stage,
                )
            )
        return out
