"""The job's layout and schedule, built from its metadata records.

:class:`Topology` answers "who is rank r" (node, GPU, NIC, pipeline
coordinates) and "where in the schedule is collective (comm, seq)": step,
micro-batch, forward/backward, PP stage. The mapping follows Megatron's
non-interleaved 1F1B schedule:

* a TP communicator of stage s issues, per step, the same number of
  collectives for every (phase, micro-batch) node, in the stage's 1F1B order;
* the n-th point-to-point transfer from a sender to its peer is micro-batch
  ``n % M`` of step ``n // M`` (activations go down the pipeline in the
  forward pass, gradients up in the backward pass);
* a DP communicator issues one (AllReduce) or two (ReduceScatter and
  AllGather, distributed optimizer) collectives per step;
* with expert parallelism (``ep > 1``), an EP communicator of stage s issues
  two AllToAll (dispatch, combine) per layer of every (phase, micro-batch)
  node, in the stage's 1F1B order;
* with context parallelism (``cp > 1``, Megatron's tp-cp-dp-pp order: a
  stage's data axis has dp x cp ranks), a CP communicator issues two
  collectives per layer of every node (keys and values gathered in the
  forward pass; gathered, and their gradients reduce-scattered, in the
  backward pass), in the stage's 1F1B order.

>>> from schemas.records import JobInfo
>>> topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=8, tp=2, pp=2, dp=2,
...                                  num_layers=4, num_microbatches=4))
>>> topo.stage_order(0)[:4]
[('forward', 0), ('forward', 1), ('backward', 0), ('forward', 2)]
>>> topo.stage_order(0) == topo.stage_order(1)
False
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from schemas.records import CommInfo, JobInfo, RankInfo
from schemas.units import CollOp, CommRole, Phase

FWD, BWD = Phase.FORWARD.value, Phase.BACKWARD.value


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved 1F1B order of (phase, micro-batch) nodes for one stage."""
    warm = min(stages - stage - 1, microbatches)
    order = [(FWD, mb) for mb in range(warm)]
    for i in range(microbatches - warm):
        order += [(FWD, warm + i), (BWD, i)]
    order += [(BWD, mb) for mb in range(microbatches - warm, microbatches)]
    return order


class Position(NamedTuple):
    """Where a collective instance sits in the training schedule."""

    step: int
    phase: str
    microbatch: int | None = None
    pp_stage: int | None = None
    layer: int | None = None


@dataclass
class Topology:
    job: JobInfo
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    comms: dict[int, CommInfo] = field(default_factory=dict)

    @classmethod
    def from_job(cls, job: JobInfo) -> Topology:
        return cls(job)

    # ------------------------------------------------------------------ updates
    def add(self, rec: JobInfo | RankInfo | CommInfo) -> None:
        if isinstance(rec, JobInfo):
            self.job = rec
        elif isinstance(rec, RankInfo):
            self.ranks[rec.rank] = rec
        else:
            self.comms[rec.comm_hash] = rec

    # ------------------------------------------------------------------ ranks
    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp stage, data-axis index, tp index) from Megatron's layout (the data axis
        has dp x cp ranks; it is the dp index without context parallelism)."""
        j = self.job
        d = j.dp * j.cp
        return rank // (j.tp * d), (rank // j.tp) % d, rank % j.tp

    def node(self, rank: int) -> str:
        info = self.ranks.get(rank)
        return info.node if info else f"node-{rank // self.job.gpus_per_node}"

    def gpu(self, rank: int) -> int:
        info = self.ranks.get(rank)
        return info.gpu if info else rank % self.job.gpus_per_node

    def nic(self, rank: int) -> str:
        info = self.ranks.get(rank)
        return info.nic if info and info.nic else f"gpu{self.gpu(rank)}"

    def link_name(self, src: int, dst: int) -> str:
        return f"{self.node(src)}/{self.nic(src)}->{self.node(dst)}/{self.nic(dst)}"

    def role(self, comm_hash: int) -> CommRole:
        info = self.comms.get(comm_hash)
        return info.role if info else CommRole.OTHER

    # ------------------------------------------------------------------ schedule
    def stage_order(self, stage: int) -> list[tuple[str, int]]:
        key = (stage, self.job.pp, self.job.num_microbatches)
        cache = self.__dict__.setdefault("_orders", {})
        if key not in cache:
            cache[key] = one_f_one_b(*key)
        return cache[key]

    @property
    def tp_ops_per_node(self) -> int:
        """TP collectives per (phase, micro-batch) node: 2 per layer (x2 with SP)."""
        j = self.job
        return 2 * (j.num_layers // j.pp) * (2 if j.sequence_parallel else 1)

    @property
    def tp_ops_per_step(self) -> int:
        return 2 * self.job.num_microbatches * self.tp_ops_per_node

    @property
    def ep_ops_per_node(self) -> int:
        """Expert-parallel AllToAll per (phase, micro-batch) node: dispatch and combine per
        layer (0 without expert parallelism)."""
        j = self.job
        return 2 * (j.num_layers // j.pp) if j.ep > 1 else 0

    @property
    def ep_ops_per_step(self) -> int:
        return 2 * self.job.num_microbatches * self.ep_ops_per_node

    @property
    def cp_ops_per_node(self) -> int:
        """Context-parallel collectives per (phase, micro-batch) node: two per layer (0
        without context parallelism)."""
        j = self.job
        return 2 * (j.num_layers // j.pp) if j.cp > 1 else 0

    @property
    def cp_ops_per_step(self) -> int:
        return 2 * self.job.num_microbatches * self.cp_ops_per_node

    @property
    def dp_ops_per_step(self) -> int:
        return 2 if self.job.distributed_optimizer else 1

    def place(self, comm_hash: int, seq: int, op: CollOp, sender: int) -> Position | None:
        """:meth:`position` of a collective instance (``sender`` -1 for collectives)."""
        stage = self.coords(sender)[0] if sender >= 0 else None
        return self.position(comm_hash, seq, op, stage)

    def position(
        self, comm_hash: int, seq: int, op: CollOp, sender_stage: int | None = None
    ) -> Position | None:
        """Where (comm, seq) sits in the schedule, or None for an unknown communicator."""
        info = self.comms.get(comm_hash)
        if info is None:
            return None
        stage = info.pp_stage
        M = self.job.num_microbatches
        if info.role == CommRole.TP and self.tp_ops_per_step:
            step, i = divmod(seq, self.tp_ops_per_step)
            node, k = divmod(i, self.tp_ops_per_node)
            phase, mb = self.stage_order(stage or 0)[node]
            per_layer = 2 * (2 if self.job.sequence_parallel else 1)
            return Position(step, phase, mb, stage, k // per_layer)
        if info.role is CommRole.EP or info.role is CommRole.CP:  # n per layer, every node
            n = self.ep_ops_per_node if info.role is CommRole.EP else self.cp_ops_per_node
            if not n:
                return Position(0, Phase.UNKNOWN.value, None, stage)
            step, i = divmod(seq, 2 * M * n)
            node, k = divmod(i, n)
            phase, mb = self.stage_order(stage or 0)[node]
            return Position(step, phase, mb, stage, k // 2)
        if info.role == CommRole.PP:
            step, mb = divmod(seq, M)
            downward = sender_stage is None or sender_stage == stage
            return Position(step, FWD if downward else BWD, mb, stage)
        if info.role == CommRole.DP:
            return Position(seq // self.dp_ops_per_step, Phase.DP_SYNC.value, None, stage)
        return Position(0, Phase.UNKNOWN.value, None, stage)
