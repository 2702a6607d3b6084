"""The records producers publish, and the base every record shares, defined once.

Records are frozen :class:`msgspec.Struct` types tagged by a ``type`` field and
versioned by a ``v`` field. Timestamps are integer nanoseconds since the Unix
epoch; durations end in ``_ns``; sizes end in ``_bytes``. Relations go by ids
(job, rank, communicator hash, sequence number), never by nesting.

Groups:

* job metadata: :class:`JobInfo`, :class:`RankInfo`, :class:`CommInfo`;
* node events: :class:`Collective`, :class:`ProxySummary`, :class:`Kernel`,
  :class:`Heartbeat`, :class:`LinkSample`, and :class:`Iteration` markers;
* refused input: :class:`DeadLetter`.

What the analysis produces (aligned instances, step figures, verdicts, alerts, ground
truth) is :mod:`schemas.results`'s.

>>> c = Collective(job="j1", node="n0", rank=3, comm_hash=7, comm_size=8, rank_in_comm=3,
...                op=CollOp.ALL_REDUCE, seq=12, count=1024, size_bytes=2048,
...                dtype=DType.BFLOAT16, enqueue_ns=1_000, end_ns=2_000)
>>> c.duration_ns
1000
"""

from __future__ import annotations

from msgspec import Struct, field

from schemas.enums import (
    ClockSource,
    CollOp,
    CommRole,
    DeadLetterReason,
    Direction,
    DType,
    KernelKind,
    Schedule,
)
from schemas.units import (
    COMM_HASH_END,
    SCHEMA_VERSION,
    CommHash,
    Count,
    DurationNs,
    JobId,
    NodeName,
    Positive,
    Rank,
    Seq,
    SeqOrNone,
    Tag,
    TimeNs,
    Version,
)


def _u64(name: str, value: int | None) -> None:
    """A communicator hash must fit its unsigned 64-bit column (msgspec bounds stop at
    int64)."""
    if value is not None and value >= COMM_HASH_END:
        raise ValueError(f"{name} {value} does not fit in 64 bits")


class Record(Struct, frozen=True, kw_only=True, tag_field="type", gc=False):
    """Base of every job-scoped record.

    Records are not tracked by Python's cyclic garbage collector (``gc=False``): they
    hold plain values and never a reference back to one another, so they cannot be
    part of a cycle, and a flow decodes hundreds of thousands a second: tracked, each
    would be walked by every collection while it lives (``megatrace bench pipeline``
    shows what the flow spends).
    """

    v: Version = SCHEMA_VERSION
    job: JobId


class NodeEvent(Record, frozen=True, kw_only=True):
    """Base of records emitted by one rank's process on one node."""

    node: NodeName
    rank: Rank
    clock: ClockSource = ClockSource.HOST_REALTIME


# --------------------------------------------------------------------------- metadata


class JobInfo(Record, frozen=True, kw_only=True, tag="job"):
    """The training job's parallel layout and schedule (one per job)."""

    ts_ns: TimeNs
    name: str = ""
    source: str = "unknown"
    world_size: Positive
    tp: Positive = 1
    pp: Positive = 1
    dp: Positive = 1
    cp: Positive = 1
    ep: Positive = 1
    vpp: Positive = 1
    num_layers: Count = 0
    global_batch_size: Count = 0
    micro_batch_size: Count = 0
    num_microbatches: Positive = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    gpus_per_node: Positive = 8

    def __post_init__(self) -> None:
        if self.tp * self.pp * self.dp * self.cp > self.world_size:
            raise ValueError(
                f"tp*pp*dp*cp = {self.tp * self.pp * self.dp * self.cp} exceeds "
                f"world_size {self.world_size}"
            )


class RankInfo(Record, frozen=True, kw_only=True, tag="rank"):
    """Where one global rank runs and its coordinates in the parallel grid."""

    ts_ns: TimeNs
    rank: Rank
    node: NodeName
    gpu: Count
    nic: str = ""
    tp_rank: Count = 0
    pp_stage: Count = 0
    dp_rank: Count = 0
    cp_rank: Count = 0
    ep_rank: Count = 0


class CommInfo(Record, frozen=True, kw_only=True, tag="comm"):
    """A communicator: its members (in communicator-rank order) and its role."""

    ts_ns: TimeNs
    comm_hash: CommHash
    role: CommRole
    ranks: list[Rank]
    name: str = ""
    pp_stage: Count | None = None
    inferred: bool = False

    def __post_init__(self) -> None:
        _u64("comm_hash", self.comm_hash)
        if not self.ranks:
            raise ValueError("a communicator needs at least one member rank")


# --------------------------------------------------------------------------- node events


class Collective(NodeEvent, frozen=True, kw_only=True, tag="coll"):
    """One rank's view of one collective or point-to-point call.

    ``(comm_hash, seq)`` names the collective instance across all its members.
    ``enqueue_ns`` is when the host issued the call; ``start_ns``/``end_ns`` are
    the kernel's start and completion when the source knows them.
    """

    comm_hash: CommHash
    comm_size: Positive
    rank_in_comm: Count
    op: CollOp
    seq: Seq
    count: Count
    size_bytes: Count
    dtype: DType
    enqueue_ns: TimeNs
    start_ns: TimeNs | None = None
    end_ns: TimeNs | None = None
    peer: Rank | None = None
    stream: Count = 0
    algo: str | None = None
    proto: str | None = None
    nchannels: Count | None = None
    #: the kernel's phases as the GPU timed them (NCCL's profiler API v7): its initial
    #: synchronisation (waiting for the peers), the data movement, the final synchronisation
    gpu_sync_ns: DurationNs | None = None
    gpu_move_ns: DurationNs | None = None
    gpu_final_sync_ns: DurationNs | None = None
    #: the call's user profiler tag (``ncclCollConfig_t.userProfilerTag``; v7) and the
    #: kernel variant NCCL chose (v7)
    user_tag: Tag | None = None
    kernel_variant: str | None = None

    def __post_init__(self) -> None:
        _u64("comm_hash", self.comm_hash)
        _u64("user_tag", self.user_tag)
        if self.rank_in_comm >= self.comm_size:
            raise ValueError(
                f"rank_in_comm {self.rank_in_comm} is not below comm_size {self.comm_size}"
            )
        if self.end_ns is not None and self.end_ns < self.enqueue_ns:
            raise ValueError(f"end_ns {self.end_ns} is before enqueue_ns {self.enqueue_ns}")

    @property
    def arrival_ns(self) -> int:
        """When this rank joined the collective (kernel start if known, else enqueue)."""
        return self.start_ns if self.start_ns is not None else self.enqueue_ns

    @property
    def duration_ns(self) -> int | None:
        return None if self.end_ns is None else self.end_ns - self.enqueue_ns


class ProxySummary(NodeEvent, frozen=True, kw_only=True, tag="proxy"):
    """NCCL proxy steps of one (comm, seq, channel, peer, direction), summarised on the node.

    ``steps_posted`` counts steps handed to the network, ``steps_done`` those
    that completed: a network hang shows as ``steps_done < steps_posted``.
    """

    comm_hash: CommHash
    seq: Seq
    channel: Count
    peer: Rank
    direction: Direction
    steps_posted: Count
    steps_done: Count
    size_bytes: Count
    first_ns: TimeNs
    last_ns: TimeNs
    send_gpu_wait_ns: DurationNs = 0
    send_peer_wait_ns: DurationNs = 0
    send_wait_ns: DurationNs = 0
    recv_wait_ns: DurationNs = 0
    recv_flush_wait_ns: DurationNs = 0
    recv_gpu_wait_ns: DurationNs = 0
    nic: str = ""

    def __post_init__(self) -> None:
        _u64("comm_hash", self.comm_hash)
        if self.steps_done > self.steps_posted:
            raise ValueError(
                f"steps_done {self.steps_done} exceeds steps_posted {self.steps_posted}"
            )
        if self.last_ns < self.first_ns:
            raise ValueError(f"last_ns {self.last_ns} is before first_ns {self.first_ns}")


class Kernel(NodeEvent, frozen=True, kw_only=True, tag="kernel"):
    """A CUPTI kernel activity record, with NCCL metadata when it is a NCCL kernel."""

    device: Count
    stream: Count
    name: str
    kind: KernelKind
    correlation_id: Count
    start_ns: TimeNs
    end_ns: TimeNs
    comm_hash: CommHash | None = None
    coll_op: CollOp | None = None
    count: Count | None = None
    group_size: Positive | None = None
    pg_name: str | None = None

    def __post_init__(self) -> None:
        _u64("comm_hash", self.comm_hash)
        if self.end_ns < self.start_ns:
            raise ValueError(f"end_ns {self.end_ns} is before start_ns {self.start_ns}")


class CommProgress(Struct, frozen=True, kw_only=True):
    """Latest sequence numbers one rank issued and completed on one communicator (-1: none)."""

    comm_hash: CommHash
    issued_seq: SeqOrNone = -1
    completed_seq: SeqOrNone = -1

    def __post_init__(self) -> None:
        _u64("comm_hash", self.comm_hash)


class Heartbeat(NodeEvent, frozen=True, kw_only=True, tag="hb"):
    """Periodic liveness of one rank. Hangs are silence, so liveness is explicit.

    ``cpu_ns`` and ``cpu_wait_ns``, where the source can read them, are the rank's
    process's counters since it started, over all its threads: the time they ran on
    a CPU, and the time they were ready to run but waited for one (a crowded run
    queue, or a container's CPU quota spent). A rank starved of CPU does its part
    slowly, and where its collectives run on the CPU (Gloo) it moves data slowly too.
    ``cpu_throttled_ns`` is the kernel's account of the rank's CPU cgroups (its
    container's, its pod's): how long their CPU quota held them back, so far.

    ``save_ns``, where the source sees the job's checkpoints, is how long the rank spent
    saving them so far (one under way included), and ``saving_since_ns`` when the save
    under way began (None: none). A save holds the rank out of the collectives, its
    peers waiting for it, as a hang or a straggler would.

    ``exiting`` marks a process's last heartbeat: it is ending (training over, or failed
    because a peer is gone). A rank killed outright sends none.
    """

    ts_ns: TimeNs
    pid: Count = 0
    step: Count | None = None
    comms: list[CommProgress] = field(default_factory=list)
    cpu_ns: Count | None = None
    cpu_wait_ns: Count | None = None
    cpu_throttled_ns: Count | None = None
    save_ns: Count | None = None
    saving_since_ns: TimeNs | None = None
    exiting: bool = False


class LinkSample(NodeEvent, frozen=True, kw_only=True, tag="link"):
    """Throughput of one NIC towards one peer over a window of work requests.

    The link is named ``node/nic->dst_node/dst_nic`` everywhere (verdicts, views).
    """

    ts_ns: TimeNs
    window_ns: DurationNs
    nic: str
    src_rank: Rank
    dst_rank: Rank
    dst_node: str = ""
    dst_nic: str = ""
    comm_hash: CommHash | None = None
    func: CollOp | None = None
    size_bytes: Count = 0
    throughput_gbps: float
    wr_posted: Count = 0
    wr_completed: Count = 0
    outstanding_bytes: Count = 0

    def __post_init__(self) -> None:
        _u64("comm_hash", self.comm_hash)


class Iteration(Record, frozen=True, kw_only=True, tag="iter"):
    """One training iteration as the job itself reports it (an iteration marker): a
    line of the training log, the profiler's step, a step hook in the collector.

    ``step`` is the job's own number for it; ``end_ns`` when it ended and
    ``duration_ns`` how long it took, where the source says; ``rank`` the rank that
    reported it (a training log is written by one). The analysis places steps by
    these where a source has them, and reports where they disagree with the calls.
    """

    step: Count
    end_ns: TimeNs
    duration_ns: DurationNs | None = None
    rank: Rank = 0
    source: str = ""


class DeadLetter(Struct, frozen=True, kw_only=True, tag="dead", tag_field="type"):
    """A record we refused, kept with its original bytes and the reason."""

    v: Version = SCHEMA_VERSION
    ts_ns: TimeNs
    reason: DeadLetterReason
    error: str
    field: str | None = None
    step_id: str = ""
    topic: str = ""
    partition: int = -1
    offset: int = -1
    key: bytes | None = None
    raw: bytes


def event_time(record: Struct) -> int:
    """When a record happened as its producer would send it: the end of what it
    describes, else its sample time, else its start (ns; 0 if it carries no time).

    >>> event_time(Heartbeat(job="j", node="n", rank=0, ts_ns=7))
    7
    """
    for name in ("end_ns", "last_ns", "ts_ns", "start_ns", "enqueue_ns"):
        v = getattr(record, name, None)
        if v is not None:
            return int(v)
    return 0


#: Records a node (or a stand-in for one) publishes.
EVENT_TYPES: tuple[type[Record], ...] = (
    JobInfo, RankInfo, CommInfo, Collective, ProxySummary, Kernel, Heartbeat, LinkSample,
    Iteration,
)  # fmt: skip


#: the analysis' records, once defined in this module (:mod:`schemas.results` now):
#: recovery snapshots written then name them here, and still load
_MOVED_TO_RESULTS = frozenset(
    {"AlignedCollective", "AlignStats", "CommStructure", "RankStep", "StepSummary", "Verdict",
     "FaultLabel", "Alert"}
)  # fmt: skip


def __getattr__(name: str) -> object:
    if name in _MOVED_TO_RESULTS:
        from schemas import results

        return getattr(results, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
