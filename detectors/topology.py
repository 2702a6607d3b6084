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

from schemas.enums import CollOp, CommRole, Phase
from schemas.layout import BWD, FWD, Layout, nic_name, one_f_one_b
from schemas.records import CommInfo, JobInfo, RankInfo


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
        self.__dict__.pop("_placers", None)  # the schedule may change
        self.__dict__.pop("_members", None)
        self.__dict__.pop("_rank_rows", None)
        if isinstance(rec, JobInfo):
            self.job = rec
        elif isinstance(rec, RankInfo):
            self.ranks[rec.rank] = rec
        else:
            self.comms[rec.comm_hash] = rec

    # ------------------------------------------------------------------ ranks
    @property
    def layout(self) -> Layout:
        """The layout the job record states (:mod:`schemas.layout`)."""
        lay = self.__dict__.get("_layout")
        if lay is None or lay[0] is not self.job:
            lay = self.__dict__["_layout"] = (self.job, Layout.of(self.job))
        return lay[1]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp stage, data-axis index, tp index) from Megatron's layout (the data axis
        has dp x cp ranks; it is the dp index without context parallelism)."""
        return self.layout.coords(rank)

    def node(self, rank: int) -> str:
        info = self.ranks.get(rank)
        return info.node if info else self.layout.node(rank)

    def rank_rows(self) -> tuple[list[str], list[int]]:
        """Every rank's node and pipeline stage, as lists indexed by rank (kept until the
        topology changes: a step's table has a row per rank, thousands a step)."""
        rows = self.__dict__.get("_rank_rows")
        if rows is None or rows[0] is not self.job:
            ranks = range(self.job.world_size)
            nodes, stages = [self.node(r) for r in ranks], [self.coords(r)[0] for r in ranks]
            rows = self.__dict__["_rank_rows"] = (self.job, nodes, stages)
        return rows[1], rows[2]

    def gpu(self, rank: int) -> int:
        info = self.ranks.get(rank)
        return info.gpu if info else self.layout.gpu(rank)

    def nic(self, rank: int) -> str:
        info = self.ranks.get(rank)
        return info.nic if info and info.nic else nic_name(self.gpu(rank))

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

    def ops_per_layer(self, role: CommRole) -> int:
        """Collectives a communicator of ``role`` issues per layer of every (phase,
        micro-batch) node: TP 2 (4 with sequence parallelism), EP 2 (dispatch, combine),
        CP 2 (keys and values, or their gradients); 0 for the others."""
        j = self.job
        if role is CommRole.TP:
            return 2 * (2 if j.sequence_parallel else 1)
        if (role is CommRole.EP and j.ep > 1) or (role is CommRole.CP and j.cp > 1):
            return 2
        return 0

    def ops_per_step(self, role: CommRole) -> int:
        """Collectives (instances) a communicator of ``role`` has in one step."""
        j = self.job
        if role is CommRole.DP:
            return 2 if j.distributed_optimizer else 1
        if role is CommRole.PP:  # M activations down and M gradients up
            return 2 * j.num_microbatches
        return 2 * j.num_microbatches * self.ops_per_layer(role) * (j.num_layers // j.pp)

    def instances_per_step(self, comm_hash: int) -> int:
        """Instances the communicator has in one step: :meth:`ops_per_step` of its role; a
        pipeline communicator carries that for each pair of consecutive stages in it (two
        ranks, or a whole pipeline group when transfers are batched over it); none are
        expected of a communicator of one rank."""
        info = self.comms.get(comm_hash)
        if info is None or len(info.ranks) < 2:  # one rank waits on nobody: sources often
            return 0  # record nothing of its calls (a data-parallel group of one, dp = 1)
        per = self.ops_per_step(info.role)
        return per * max(1, len(info.ranks) - 1) if info.role is CommRole.PP else per

    def place(
        self, comm_hash: int, seq: int, op: CollOp, sender: int, receiver: int = -1
    ) -> Position | None:
        """:meth:`position` of a collective instance (``sender`` and ``receiver`` -1 for
        collectives)."""
        stage = self.coords(sender)[0] if sender >= 0 else None
        to = self.coords(receiver)[0] if receiver >= 0 else None
        return self.position(comm_hash, seq, op, stage, to)

    def position(
        self,
        comm_hash: int,
        seq: int,
        op: CollOp,
        sender_stage: int | None = None,
        receiver_stage: int | None = None,
    ) -> Position | None:
        """Where (comm, seq) sits in the schedule, or None for an unknown communicator."""
        placer = self.placer(comm_hash)
        return None if placer is None else placer.at(seq, sender_stage, receiver_stage)

    def members(self, comm_hash: int) -> frozenset[int] | None:
        """A communicator's members as a set (cached until the topology changes: a job's
        worker checks every instance it takes against them), or None for an unknown one."""
        cache = self.__dict__.setdefault("_members", {})
        found = cache.get(comm_hash)
        if found is None and (info := self.comms.get(comm_hash)) is not None:
            found = cache[comm_hash] = frozenset(info.ranks)
        return found

    def placer(self, comm_hash: int) -> Placer | None:
        """The communicator's :class:`Placer` (cached until the topology changes), or None
        for an unknown communicator."""
        cache = self.__dict__.setdefault("_placers", {})
        placer = cache.get(comm_hash)
        if placer is None and (info := self.comms.get(comm_hash)) is not None:
            j, role = self.job, info.role
            per_layer = self.ops_per_layer(role)  # TP, EP and CP: in every node's layers
            placer = cache[comm_hash] = Placer(
                role,
                info.pp_stage,
                self.ops_per_step(role),
                per_layer * (j.num_layers // j.pp),
                per_layer,
                tuple(self.stage_order(info.pp_stage or 0)) if per_layer else (),
                j.num_microbatches,
            )
        return placer


class Placer(NamedTuple):
    """Where one communicator's instances sit in the schedule (see the module docstring)."""

    role: CommRole
    stage: int | None
    per_step: int  # instances a step
    per_node: int  # instances a (phase, micro-batch) node, for TP, EP and CP
    per_layer: int
    order: tuple[tuple[str, int], ...]  # the stage's 1F1B nodes, for TP, EP and CP
    microbatches: int

    @property
    def period(self) -> int:
        """Instances after which :meth:`at` repeats itself a step later: where an instance
        sits in its step depends on its sequence number modulo this (and on a transfer's
        direction) alone."""
        if self.per_layer and self.per_step:
            return self.per_step
        if self.role is CommRole.PP:
            return max(1, self.microbatches)
        return 1

    def at(
        self, seq: int, sender_stage: int | None = None, receiver_stage: int | None = None
    ) -> Position | None:
        """The position of instance ``seq`` (a transfer's: ``seq`` counts the transfers
        from its sender to its receiver, whose stages say which way it goes), or None
        where the layout has no schedule for this communicator (its role is not one the
        schedule knows, or a data-parallel one's count a step is not known): its step is
        not known, not step 0."""
        if self.per_layer and self.per_step:
            step, i = divmod(seq, self.per_step)
            node, k = divmod(i, self.per_node)
            phase, mb = self.order[node]
            return Position(step, phase, mb, self.stage, k // self.per_layer)
        if self.role is CommRole.PP:
            step, mb = divmod(seq, self.microbatches)
            if sender_stage is not None and receiver_stage is not None:
                downward = sender_stage < receiver_stage  # activations go down the pipeline
            else:  # a pair's communicator: its stage is the lower one's, which sends down
                downward = sender_stage is None or sender_stage == self.stage
            return Position(step, FWD if downward else BWD, mb, self.stage)
        if self.role is CommRole.DP and self.per_step:
            return Position(seq // self.per_step, Phase.DP_SYNC.value, None, self.stage)
        return None
