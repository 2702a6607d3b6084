"""Fold one communicator's complete collective instances into per-step parts.

At 4,096 ranks a step has about 120,000 collective instances; folding each
one into the job's step account in the job's single worker costs seconds per
step. :class:`StepFolder` does that folding per communicator instead, where the
communicator's records already are (one flow worker per communicator), and
hands the job one :class:`~detectors.steps.StepPart` per (communicator, step):
the job merges about one part per communicator per step. It also builds the
stored row of each instance it folds.

The folder needs the communicator's place in the schedule (the job record and
the communicator record, :class:`CommSchedule`). Until it has them, and for
instances the job already saw as partial (a late member, a hang being
localised), it forwards instances unchanged; folding and merging commute, so
the job's step account is the same either way.

>>> from detectors.align import Instance
>>> from schemas.records import CommInfo, JobInfo
>>> from schemas.units import CollOp, CommRole
>>> job = JobInfo(job="j", ts_ns=0, world_size=4, tp=2, pp=1, dp=2, num_layers=1,
...               num_microbatches=1)
>>> folder = StepFolder()
>>> folder.learn(CommSchedule(job, CommInfo(job="j", ts_ns=0, comm_hash=7,
...     role=CommRole.DP, ranks=[0, 2], pp_stage=0)))
>>> def inst(seq):
...     return Instance("j", 7, seq, CollOp.ALL_REDUCE, -1, 2, 8, (0, 2), (10, 12), (10, 12),
...                     (20, 20))
>>> rows, forward = folder.update(inst(0))
>>> [type(x).__name__ for x in forward], forward[0].step, forward[0].n, rows[0].step
(['StepPart'], 0, 1, 0)
"""

from __future__ import annotations

from typing import Any, NamedTuple

from detectors.align import Instance, Key, instance_row
from detectors.steps import StepPart, StepWatermark
from detectors.topology import Placer, Topology
from schemas.records import AlignedCollective, CommInfo, JobInfo, ProxySummary
from schemas.units import CommRole


class CommSchedule(NamedTuple):
    """What a communicator's folder needs: the job record and the communicator's record."""

    job: JobInfo
    comm: CommInfo


class CommProgress(NamedTuple):
    """The newest arrival and completion a communicator has seen (the job's liveness)."""

    job: str
    comm_hash: int
    last_arrival_ns: int
    last_end_ns: int


class ScheduleBook:
    """Per job: the schedules a metadata record completes or changes.

    >>> book = ScheduleBook()
    >>> book.update(CommInfo(job="j", ts_ns=0, comm_hash=7, role=CommRole.TP, ranks=[0, 1]))
    []
    >>> [s.comm.comm_hash for s in book.update(JobInfo(job="j", ts_ns=0, world_size=2, tp=2))]
    [7]
    """

    def __init__(self) -> None:
        self.job: JobInfo | None = None
        self.comms: dict[int, CommInfo] = {}

    def update(self, rec: object) -> list[CommSchedule]:
        if isinstance(rec, JobInfo):
            self.job = rec
            return [CommSchedule(rec, c) for c in self.comms.values()]
        if isinstance(rec, CommInfo):
            self.comms[rec.comm_hash] = rec
            return [CommSchedule(self.job, rec)] if self.job is not None else []
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


class StepFolder:
    """Per-communicator pre-aggregation (see the module docstring).

    Parameters
    ----------
    give_up_steps
        A step's part is sent incomplete once an instance this many steps later
        arrives (the job's assembler gives up on a step two steps later too).
    max_open_steps
        Hard bound on the steps held open; the oldest is sent beyond it.
    """

    # the communicator's placer; also for one pickled by a version without it (a flow
    # resumed across an upgrade), which finds it in the topology
    _placer: Placer | None = None

    def __init__(self, give_up_steps: int = 2, max_open_steps: int = 8) -> None:
        if give_up_steps < 1 or max_open_steps < 1:
            raise ValueError("give_up_steps and max_open_steps must be at least 1")
        self.give_up_steps = give_up_steps
        self.max_open_steps = max_open_steps
        self._reset()

    def _reset(self) -> None:
        self.topo: Topology | None = None
        self._placer: Placer | None = None  # the communicator's, from the topology
        self.comm_hash = -1
        self.job = ""
        self.role = CommRole.OTHER
        self.per_step = 0
        self._parts: dict[int, StepPart] = {}
        self._newest = -1
        self._partial: set[Key] = set()
        self._last_arrival = 0
        self._last_end = 0
        self._reported = (0, 0)

    def learn(self, schedule: CommSchedule) -> None:
        """The communicator's schedule (again, when the job record changes)."""
        topo = Topology.from_job(schedule.job)
        topo.add(schedule.comm)
        self.topo, self.role = topo, schedule.comm.role
        self.comm_hash, self.job = schedule.comm.comm_hash, schedule.comm.job
        self.per_step = topo.instances_per_step(self.comm_hash)
        self._placer = topo.placer(self.comm_hash)

    def update(self, inst: Instance) -> tuple[list[AlignedCollective], list[Any]]:
        """A complete instance: (stored rows, items for the job)."""
        self._name(inst)
        arrival = inst.arrival
        a_min, a_max, e_max = min(arrival), max(arrival), max(inst.end)
        if a_max > self._last_arrival:
            self._last_arrival = a_max
        if e_max > self._last_end:
            self._last_end = e_max
        topo = self.topo
        if topo is None or not self.per_step or (self._partial and inst.key in self._partial):
            self._partial.discard(inst.key)
            return [], [inst]
        if inst.sender < 0 and inst.comm_hash == self.comm_hash:  # a collective: placed by seq
            placer = self._placer or topo.placer(inst.comm_hash)
            pos = None if placer is None else placer.at(inst.seq)
        else:
            pos = topo.place(inst.comm_hash, inst.seq, inst.op, inst.sender, inst.receiver)
        if pos is None:
            return [], [inst]
        part = self._parts.get(pos.step)
        if part is None:
            part = self._parts[pos.step] = StepPart(pos.step, inst.comm_hash, inst.job)
        part.fold(inst, pos.phase, pos.microbatch, self.role, topo, (a_min, a_max, e_max))
        info = topo.comms.get(inst.comm_hash)
        rows = [instance_row(inst.job, info, inst, pos, a_min, a_max, e_max)]
        if part.n >= self.per_step:
            return rows, [self._parts.pop(pos.step).seal()]
        if pos.step <= self._newest:
            return rows, []
        self._newest = pos.step  # a new step: older ones that stay open are given up on
        stale = [s for s in self._parts if s <= pos.step - self.give_up_steps]
        if len(self._parts) - len(stale) > self.max_open_steps:
            stale.append(min(s for s in self._parts if s not in stale))
        return rows, [self._parts.pop(s).seal() for s in sorted(stale)]

    def partial(self, inst: Instance) -> list[Any]:
        """A partial instance goes to the job as it is; so will its completion."""
        self._name(inst)
        self._last_arrival = max(self._last_arrival, max(inst.arrival))
        self._partial.add(inst.key)
        if len(self._partial) > 4096:
            self._partial.pop()
        return [inst]

    def progress(self) -> list[CommProgress]:
        """The communicator's liveness, when it moved since the last call."""
        now = (self._last_arrival, self._last_end)
        if now == self._reported:
            return []
        self._reported = now
        return [CommProgress(self.job, self.comm_hash, *now)]

    def flush(self) -> list[StepPart]:
        """Every open part, oldest first (end of a bounded input)."""
        out = [self._parts[s].seal() for s in sorted(self._parts)]
        self._parts = {}
        return out

    def saw_time(self, ts_ns: int) -> None:
        """Another record of the communicator's (event time moves on)."""
        self._last_arrival = max(self._last_arrival, ts_ns)

    def _name(self, inst: Instance) -> None:
        if self.comm_hash < 0:  # no schedule yet: the first instance says whose folder this is
            self.comm_hash, self.job = inst.comm_hash, inst.job

    @property
    def n_open(self) -> int:
        return len(self._parts)

    @property
    def last_arrival_ns(self) -> int:
        """The newest arrival (or proxy activity) the communicator showed."""
        return self._last_arrival


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


__all__ = [
    "CommProgress",
    "CommSchedule",
    "EdgeThroughput",
    "PartMerger",
    "ScheduleBook",
    "StepFolder",
    "shard_of",
]
