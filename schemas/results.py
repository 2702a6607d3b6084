"""What the analysis produces, defined once: aligned collective instances and the
aligner's account (:class:`AlignedCollective`, :class:`AlignStats`), each communicator's
step structure as observed (:class:`CommStructure`), per-rank and per-step figures
(:class:`RankStep`, :class:`StepSummary`), verdicts and the alerts sent for them
(:class:`Verdict`, :class:`Alert`), and ground truth to score them against
(:class:`FaultLabel`).

They follow the conventions of :mod:`schemas.records` (frozen, tagged ``type``, versioned
``v``, times in integer ns), whose :class:`~schemas.records.Record` they extend.
"""

from __future__ import annotations

from msgspec import field

from schemas.enums import (
    AlertLevel,
    Cause,
    CollOp,
    CommRole,
    Phase,
    VerdictKind,
    VerdictStatus,
)
from schemas.records import Record
from schemas.units import (
    CommHash,
    Count,
    DurationNs,
    Fraction,
    NodeName,
    Positive,
    Rank,
    Seq,
    TimeNs,
)


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
