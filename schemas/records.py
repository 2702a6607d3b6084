"""Every record that crosses Kafka, a file or ClickHouse, defined once.

Records are frozen :class:`msgspec.Struct` types tagged by a ``type`` field and
versioned by a ``v`` field. Timestamps are integer nanoseconds since the Unix
epoch; durations end in ``_ns``; sizes end in ``_bytes``. Relations go by ids
(job, rank, communicator hash, sequence number), never by nesting.

Groups:

* job metadata: :class:`JobInfo`, :class:`RankInfo`, :class:`CommInfo`;
* node events: :class:`Collective`, :class:`ProxySummary`, :class:`Kernel`,
  :class:`Heartbeat`, :class:`LinkSample`, and :class:`Iteration` markers;
* analysis results: :class:`AlignedCollective`, :class:`RankStep`,
  :class:`StepSummary`, :class:`Verdict`;
* plumbing: :class:`DeadLetter`, :class:`FaultLabel` (simulator ground truth).

>>> c = Collective(job="j1", node="n0", rank=3, comm_hash=7, comm_size=8, rank_in_comm=3,
...                op=CollOp.ALL_REDUCE, seq=12, count=1024, size_bytes=2048,
...                dtype=DType.BFLOAT16, enqueue_ns=1_000, end_ns=2_000)
>>> c.duration_ns
1000
"""

from __future__ import annotations

from msgspec import Struct, field

from schemas.enums import (
    AlertLevel,
    Cause,
    ClockSource,
    CollOp,
    CommRole,
    DeadLetterReason,
    Direction,
    DType,
    KernelKind,
    Phase,
    Schedule,
    VerdictKind,
    VerdictStatus,
)
from schemas.units import (
    COMM_HASH_END,
    SCHEMA_VERSION,
    CommHash,
    Count,
    DurationNs,
    Fraction,
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


# --------------------------------------------------------------------------- results


class AlignedCollective(Record, frozen=True, kw_only=True, tag="aligned"):
    """One collective instance with every member's arrival gathered."""

    comm_hash: CommHash
    role: CommRole
    seq: Seq
    op: CollOp
    n_ranks: Positive
    n_arrived: Count
    size_bytes: Count
    first_arrival_ns: TimeNs
    last_arrival_ns: TimeNs
    last_rank: Rank
    end_ns: TimeNs | None = None
    transfer_ns: DurationNs | None = None
    busbw_gbps: float | None = None
    sender: int = -1  # the sending rank of a Send/Recv pair; -1 for collectives
    receiver: int = -1  # its receiving rank where the communicator has more; else -1
    missing_ranks: list[Rank] = field(default_factory=list)
    unfinished_ranks: list[Rank] = field(default_factory=list)
    step: Count | None = None
    microbatch: Count | None = None
    phase: Phase | None = None
    pp_stage: Count | None = None

    @property
    def arrival_spread_ns(self) -> int:
        return self.last_arrival_ns - self.first_arrival_ns


class AlignStats(Record, frozen=True, kw_only=True, tag="align_stats"):
    """How one communicator's records met, counted since its alignment state began
    (a flow resumed from its recovery store goes on counting): cumulative, so the
    newest row of a communicator is its account.

    ``late_records``: a member's record for a collective already complete (a
    duplicate, or a replay after a restart), ignored. ``out_of_order_records``:
    a record whose sequence number is below one its rank already sent on that
    communicator (aligned all the same). ``dropped_instances``: collectives evicted
    unfinished beyond the bound on open ones. ``partial_reports``: collectives
    reported partial after the timeout (someone never joined or never finished),
    each report counted. ``lost_instances``: collectives whose missing members went
    on to later calls of the communicator, so their records of it were lost before
    they reached the flow (a source's full buffer); not taken for a hang.
    ``open_instances``: collectives open at ``ts_ns``.
    """

    comm_hash: CommHash
    ts_ns: TimeNs
    records: Count = 0
    late_records: Count = 0
    out_of_order_records: Count = 0
    dropped_instances: Count = 0
    partial_reports: Count = 0
    open_instances: Count = 0
    lost_instances: Count = 0


class CommStructure(Record, frozen=True, kw_only=True, tag="comm_structure"):
    """What one communicator's step is, as the analysis found it from its calls.

    ``clock`` says what places its instances in steps: "marks" (the job's own
    iteration markers), "layout" (the job's layout, which its calls agree with),
    "pauses" or "calls" (learned from the calls: the pauses between steps, or the
    calls' recurring pattern). ``per_step`` is the instances a step holds (learned;
    0 where marks place them), ``layout_per_step`` what the layout says (0: it says
    nothing), ``agrees`` whether the calls agree with the layout (and where its steps
    begin); ``note`` says it in words."""

    comm_hash: CommHash
    ts_ns: TimeNs
    role: CommRole = CommRole.OTHER
    sender: int = -1  # a transfer's sequence: the sending rank (and receiver), else -1
    receiver: int = -1
    clock: str = ""
    per_step: Count = 0
    anchor: Count = 0  # the sequence number of a call that begins a step (learned clocks)
    layout_per_step: Count = 0
    agrees: bool = True
    note: str = ""


class RankStep(Record, frozen=True, kw_only=True, tag="rank_step"):
    """One rank's account of one training step."""

    step: Count
    rank: Rank
    node: NodeName
    pp_stage: Count = 0
    start_ns: TimeNs
    end_ns: TimeNs
    compute_ns: DurationNs = 0
    wait_ns: DurationNs = 0
    lateness_ns: float = 0.0
    blame_ns: DurationNs = 0


class StepSummary(Record, frozen=True, kw_only=True, tag="step"):
    """One training step of the whole job.

    ``instances`` collective instances went into its figures; the job's layout says a
    whole step has ``expected_instances`` (0: it says nothing; a job's own calls may
    differ from it, and what they show decides: each communicator's is in the
    ``comm_structure`` table). ``left_out``: the detectors left the step out, as closed
    without some of its instances (a hang, records lost, or read so late that the
    step was given up on: its figures cover only what came), or as one that spans the
    job's restart or that a rank spent saving a checkpoint (the job's own pause).
    ``late_instances`` counts the job's instances so far that came after their
    step was closed, in no step's figures (0 and 0 for both: not known, a row
    written before megatrace counted them).
    """

    step: Count
    start_ns: TimeNs
    end_ns: TimeNs
    duration_ns: DurationNs
    expected_ns: DurationNs | None = None
    throughput_ratio: float | None = None
    slowest_pp_group: Count | None = None
    critical_path: list[str] = field(default_factory=list)
    instances: Count = 0
    expected_instances: Count = 0
    late_instances: Count = 0
    left_out: bool = False


class Verdict(Record, frozen=True, kw_only=True, tag="verdict"):
    """A diagnosis: what went wrong, who is to blame, where in the schedule, and why we think so.

    ``verdict_id`` is stable for an incident, so re-processing the same input
    after a restart produces the same id; ``revision`` grows with each update.
    """

    verdict_id: str
    revision: Count = 0
    status: VerdictStatus = VerdictStatus.OPEN
    kind: VerdictKind
    cause: Cause
    rank: Rank | None = None
    #: every rank to blame where it is several (``rank`` is the first); empty for one
    culprit_ranks: list[Rank] = field(default_factory=list)
    node: str | None = None
    gpu: Count | None = None
    link: str | None = None
    src_rank: Rank | None = None
    dst_rank: Rank | None = None
    step: Count | None = None
    microbatch: Count | None = None
    phase: Phase | None = None
    pp_stage: Count | None = None
    comm_hash: CommHash | None = None
    seq: Seq | None = None
    op: CollOp | None = None
    onset_ns: TimeNs
    onset_step: Count | None = None
    detected_ns: TimeNs
    resolved_ns: TimeNs | None = None
    severity: Fraction = 0.0
    confidence: Fraction = 0.0
    summary: str = ""
    evidence: dict[str, float] = field(default_factory=dict)


class FaultLabel(Record, frozen=True, kw_only=True, tag="label"):
    """Ground truth of one injected fault (simulator and fault-injection tests)."""

    fault_id: str
    kind: VerdictKind
    cause: Cause
    rank: Rank | None = None
    node: str | None = None
    gpu: Count | None = None
    link: str | None = None
    src_rank: Rank | None = None
    dst_rank: Rank | None = None
    onset_step: Count
    onset_ns: TimeNs
    end_step: Count | None = None
    phase: Phase | None = None
    microbatch: Count | None = None
    pp_stage: Count | None = None
    magnitude: float = 0.0
    on_critical_path: bool = True
    throughput_cost: Fraction = 0.0
    note: str = ""


class Alert(Record, frozen=True, kw_only=True, tag="alert"):
    """One message about an incident to the alert webhooks.

    ``alert_id`` is stable for (incident, event, revision): receivers can drop
    repeats (delivery is at-least-once). ``suppressed`` counts the job's other
    incidents not announced because of the hourly cap.
    """

    alert_id: str
    event: VerdictStatus
    level: AlertLevel
    verdict: Verdict
    suppressed: Count = 0


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
    JobInfo,
    RankInfo,
    CommInfo,
    Collective,
    ProxySummary,
    Kernel,
    Heartbeat,
    LinkSample,
    Iteration,
)
#: Records the analysis produces.
RESULT_TYPES: tuple[type[Record], ...] = (
    AlignedCollective,
    AlignStats,
    CommStructure,
    RankStep,
    StepSummary,
    Verdict,
    FaultLabel,
)
ALL_TYPES: tuple[type[Struct], ...] = (*EVENT_TYPES, *RESULT_TYPES, DeadLetter)
