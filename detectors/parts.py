"""What passes between a job's communicators and its analysis, besides the records.

:class:`CommSchedule` (the job and communicator records a communicator's folder
places its instances by) and :class:`StepMark` (one of the job's iteration markers)
go from the job's :class:`ScheduleBook` to each communicator;
:class:`CommProgress`, :class:`EdgeThroughput` and the folders' step parts go to
the job, the parts merged per shard of communicators by :class:`PartMerger`.
"""

from __future__ import annotations

from typing import NamedTuple

from detectors.steps import StepPart, StepWatermark
from schemas.records import CommInfo, Iteration, JobInfo, ProxySummary


class CommSchedule(NamedTuple):
    """What a communicator's folder needs: the job record and the communicator's record."""

    job: JobInfo
    comm: CommInfo


class StepMark(NamedTuple):
    """One of the job's iteration markers, for one of its communicators: ``step`` ended
    at ``end_ns`` (see :mod:`detectors.folder`)."""

    job: str
    comm_hash: int
    step: int
    end_ns: int
    rank: int = -1  # the rank that reported it


class CommProgress(NamedTuple):
    """The newest arrival and completion a communicator has seen (the job's liveness)."""

    job: str
    comm_hash: int
    last_arrival_ns: int
    last_end_ns: int


class ScheduleBook:
    """Per job: the schedules a metadata record completes or changes, and its iteration
    markers for every communicator (the first marker of each step; a communicator
    that comes later is given the recent ones).

    >>> from schemas.units import CommRole
    >>> book = ScheduleBook()
    >>> book.update(CommInfo(job="j", ts_ns=0, comm_hash=7, role=CommRole.TP, ranks=[0, 1]))
    []
    >>> [s.comm.comm_hash for s in book.update(JobInfo(job="j", ts_ns=0, world_size=2, tp=2))]
    [7]
    >>> book.update(Iteration(job="j", step=3, end_ns=50, rank=1))
    [StepMark(job='j', comm_hash=7, step=3, end_ns=50, rank=1)]
    >>> book.update(Iteration(job="j", step=3, end_ns=52, rank=0))  # the same step again
    []
    """

    #: markers given to a communicator that comes later
    recent_marks = 64

    def __init__(self) -> None:
        self.job: JobInfo | None = None
        self.comms: dict[int, CommInfo] = {}
        self.marks: dict[int, tuple[int, int]] = {}  # step -> (end ns, rank), the newest

    def update(self, rec: object) -> list[CommSchedule | StepMark]:
        if isinstance(rec, JobInfo):
            self.job = rec
            return [CommSchedule(rec, c) for c in self.comms.values()]
        if isinstance(rec, CommInfo):
            known = rec.comm_hash in self.comms
            self.comms[rec.comm_hash] = rec
            if self.job is None:
                return []
            out: list[CommSchedule | StepMark] = [CommSchedule(self.job, rec)]
            if not known:
                out += [StepMark(rec.job, rec.comm_hash, s, *m) for s, m in self.marks.items()]
            return out
        if isinstance(rec, Iteration) and rec.step not in self.marks:
            self.marks[rec.step] = (rec.end_ns, rec.rank)
            if len(self.marks) > self.recent_marks:
                del self.marks[min(self.marks)]
            if self.job is None:
                return []
            return [StepMark(rec.job, h, rec.step, rec.end_ns, rec.rank) for h in self.comms]
        return []


class StuckProxies:
    """Proxy operations posted and not completed (a network hang's evidence), by
    (comm, seq, rank, channel, peer, direction); the oldest go beyond ``limit``."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self.ops: dict[tuple[int, ...], ProxySummary] = {}

    def update(self, p: ProxySummary) -> bool:
        """Note a summary; True when it is stuck, or completes one that was."""
        if p.steps_done < p.steps_posted:
            self.ops[(p.comm_hash, p.seq, p.rank, p.channel, p.peer, p.direction)] = p
            if len(self.ops) > self.limit:
                self.ops.pop(next(iter(self.ops)))
            return True
        if not self.ops:  # nothing stuck (nearly always): nothing to complete
            return False
        key = (p.comm_hash, p.seq, p.rank, p.channel, p.peer, p.direction)
        return self.ops.pop(key, None) is not None


class EdgeThroughput(NamedTuple):
    """Throughput of one edge over a window of its completed sends, from proxy summaries:
    bytes over time in SendWait, the measure the NCCL plugin's link samples use (the
    network's share of the transfer). The job uses it for sources that send no link
    samples of their own. ``gpu_wait_ns`` is the mean SendGPUWait per send: how long the
    sender's data was not there yet (its GPU's share; the decision table of docs/method.md)."""

    job: str
    src_rank: int
    dst_rank: int
    ts_ns: int
    window_ns: int
    size_bytes: int
    throughput_gbps: float
    gpu_wait_ns: int = 0


def shard_of(comm_hash: int, shards: int) -> int:
    """Which of a job's ``shards`` part mergers a communicator's parts and progress go to."""
    return comm_hash % shards


#: a communicator silent for this many steps is forgotten
_FORGET_STEPS = 64


class PartMerger:
    """Merges the step parts of a share of a job's communicators into one part per step.

    The flow keys these by (job, shard of the communicators), between the
    communicators and the job (their progress reports go this way too): at
    4,096 ranks a job has some 4,000 communicators, so its single worker would
    otherwise merge as many parts a step. A step's
    merged part is sent once every communicator this merger heard from is at
    that step or past it: it sent its part (a communicator's parts come in step
    order), or it has none (its instances went to the job as they were). A
    communicator more than ``give_up_steps`` behind the newest step is not
    waited for (it went quiet: a hang, a job restarted with new communicators,
    or a partition read late). What arrives later is merged again and sent on;
    the job merges any number of parts of a step.

    >>> from detectors.steps import StepPart, StepWatermark
    >>> m = PartMerger()
    >>> def part(step, comm):
    ...     return StepPart(step, comm_hash=comm, n=1, start=step).seal()
    >>> [(p.step, p.comms) for p in m.update(part(0, comm=1))]  # the only one heard from
    [(0, (1,))]
    >>> m.update(part(1, comm=2))  # waits for communicator 1's part of step 1
    []
    >>> [(p.step, p.comms, p.n) for p in m.update(part(1, comm=1))]
    [(1, (2, 1), 2)]
    """

    def __init__(self, give_up_steps: int = 2) -> None:
        if give_up_steps < 0:
            raise ValueError(f"give_up_steps must be at least 0, not {give_up_steps}")
        self.give_up_steps = give_up_steps
        self._reset()

    def _reset(self) -> None:
        self._open: dict[int, list[StepPart]] = {}  # step -> its parts so far
        self._seen = StepWatermark()  # the step each communicator reached
        self._progress = CommProgress("", -1, 0, 0)  # the newest of its communicators'
        self._reported = self._progress

    def update(self, part: StepPart | CommProgress) -> list[StepPart]:
        """Take a part; return the merged parts now complete, oldest first.

        A communicator's progress is kept as the newest of all (see :meth:`progress`)."""
        if isinstance(part, CommProgress):
            now = self._progress
            self._progress = CommProgress(
                part.job,
                -1,
                max(now.last_arrival_ns, part.last_arrival_ns),
                max(now.last_end_ns, part.last_end_ns),
            )
            return []
        step = part.step
        self._open.setdefault(step, []).append(part)
        self._seen.advance(part.comms or (part.comm_hash,), step)
        self._seen.forget_before(self._seen.high() - _FORGET_STEPS)
        # every communicator still keeping up is at this step or past it
        low = self._seen.low(within=self.give_up_steps)
        ready = sorted(s for s in self._open if s <= low)
        return [StepPart.merged(self._open.pop(s)) for s in ready]

    def flush(self) -> list[StepPart]:
        """Every open step's merged part, oldest first (end of a bounded input)."""
        return [StepPart.merged(self._open.pop(s)) for s in sorted(self._open)]

    def progress(self) -> list[CommProgress]:
        """Its communicators' newest arrival and completion, when they moved since the
        last call: each communicator reports after every batch it reads, some 100,000
        reports a step at 4,096 ranks; the job needs only the newest."""
        if self._progress == self._reported:
            return []
        self._reported = self._progress
        return [self._progress]


def __getattr__(name: str) -> object:
    if name == "StepFolder":  # where it lived: a flow's snapshots pickled it by this name
        from detectors.folder import StepFolder

        return StepFolder
    raise AttributeError(name)


__all__ = [
    "CommProgress",
    "CommSchedule",
    "EdgeThroughput",
    "PartMerger",
    "ScheduleBook",
    "StepMark",
    "shard_of",
]
