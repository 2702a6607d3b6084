"""What a communicator's folder places its instances by, from the job's records.

:class:`ScheduleBook` (per job) turns the job's metadata records into a
:class:`CommSchedule` for each communicator (the job record and the communicator's),
and its iteration markers into a :class:`StepMark` for each of them.
"""

from __future__ import annotations

from typing import NamedTuple

from schemas.records import CommInfo, Iteration, JobInfo


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


class ScheduleBook:
    """Per job: the schedules a metadata record completes or changes, and its iteration
    markers for every communicator (the first marker of each step; a communicator
    that comes later is given the recent ones).

    >>> from schemas.enums import CommRole
    >>> book = ScheduleBook()
    >>> book.update(CommInfo(job="j", ts_ns=0, comm_hash=7, role=CommRole.TP, ranks=[0, 1]))
    []
    >>> [s.comm.comm_hash for s in book.update(JobInfo(job="j", ts_ns=0, world_size=2, tp=2))]
    [7]
    >>> book.update(Iteration(job="j", step=3, end_ns=50, rank=1))
    [StepMark(job='j', comm_hash=7, step=3, end_ns=50, rank=1)]
    >>> book.update(Iteration(job="j", step=3, end_ns=52, rank=0))  # the same step again
    []

    The job's topics are read at their own paces: markers and communicators that came
    before the job record go out with it.

    >>> book = ScheduleBook()
    >>> book.update(CommInfo(job="j", ts_ns=0, comm_hash=7, role=CommRole.TP, ranks=[0, 1]))
    []
    >>> book.update(Iteration(job="j", step=0, end_ns=50, rank=0))
    []
    >>> [type(x).__name__ for x in book.update(JobInfo(job="j", ts_ns=0, world_size=2, tp=2))]
    ['CommSchedule', 'StepMark']
    """

    #: markers given to a communicator that comes later
    recent_marks = 64

    def __init__(self) -> None:
        self.job: JobInfo | None = None
        self.comms: dict[int, CommInfo] = {}
        self.marks: dict[int, tuple[int, int]] = {}  # step -> (end ns, rank), the newest

    def update(self, rec: object) -> list[CommSchedule | StepMark]:
        if isinstance(rec, JobInfo):
            first, self.job = self.job is None, rec
            out = [CommSchedule(rec, c) for c in self.comms.values()]
            if first:  # markers and communicators that came before the job record
                out += [StepMark(rec.job, h, s, *m) for h in self.comms
                        for s, m in sorted(self.marks.items())]  # fmt: skip
            return out
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


__all__ = ["CommSchedule", "ScheduleBook", "StepMark"]
