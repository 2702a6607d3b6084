"""The job's own step folders, for communicators whose instances reach it unfolded.

The flow folds each communicator's instances into step parts in that communicator's
worker. Some reach the job unfolded all the same: the instances of a communicator whose
worker had no schedule for it for too long (or a partial instance's completion, from a
worker of a version that did not fold those). The job folds
those with a :class:`~detectors.folder.StepFolder` of its own per communicator, which
learns what the communicator's worker would have: the layout's schedule, the job's
iteration markers and the step structure the communicator's calls showed.

>>> from detectors.topology import Position, Topology
>>> from schemas.records import CommInfo, Iteration, JobInfo
>>> topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=2, dp=2))
>>> topo.add(CommInfo(job="j", ts_ns=0, comm_hash=7, ranks=[0, 1], role="dp"))
>>> own = JobFolders()
>>> list(own.mark(Iteration(job="j", rank=0, step=3, end_ns=9)))
[]
>>> folder, unknown = own.folder(7, topo), own.folder(8, topo)  # made when first needed
>>> sorted(own.folders), unknown, own.marks
([7], None, {3: (9, 0)})
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from detectors.align import Instance
from detectors.folder import StepFolder
from detectors.hang import HangDiagnosis
from detectors.schedule import CommSchedule, ScheduleBook
from detectors.topology import Position, Topology
from schemas.enums import CollOp
from schemas.records import Iteration
from schemas.results import AlignedCollective, CommStructure

Folded = tuple[list[AlignedCollective], list[Any]]


class JobFolders:
    """Per communicator the job has the record of: its folder, made when first needed."""

    #: the end of the newest iteration marker dropped (only the newest are kept): a call
    #: made before it is in a step the markers kept cannot say
    forgot_ns: int = 0

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        #: (comm, sender, receiver) -> its step as its calls show it
        self.structure: dict[tuple[int, int, int], CommStructure] = {}
        self.folders: dict[int, StepFolder] = {}
        self.elsewhere: set[int] = set()  # communicators folded by their own worker
        self.marks: dict[int, tuple[int, int]] = {}  # iteration markers: step -> (end, rank)

    def folder(self, comm_hash: int, topo: Topology) -> StepFolder | None:
        """The folder of a communicator (None: the job has no record of it)."""
        folder = self.folders.get(comm_hash)
        if folder is None:
            info = topo.comms.get(comm_hash)
            if info is None:
                return None
            folder = self.folders[comm_hash] = StepFolder()
            folder.learn(CommSchedule(topo.job, info))
            for step, (end, rank) in self.marks.items():
                folder.mark(step, end, rank)
            for (h, _, _), note in self.structure.items():
                if h == comm_hash:
                    folder.adopt(note)
        return folder

    def noted(self, note: CommStructure) -> Folded:
        """A communicator's step structure (not a ``learning`` one): kept, and what its
        folder held waiting for it placed now."""
        self.structure[(note.comm_hash, note.sender, note.receiver)] = note
        folder = self.folders.get(note.comm_hash)
        return folder.adopt(note) if folder is not None else ([], [])

    def note_of(self, comm_hash: int) -> CommStructure | None:
        return next((n for (h, _, _), n in self.structure.items() if h == comm_hash), None)

    def hung_at(
        self,
        topo: Topology,
        diag: HangDiagnosis,
        partial: Instance | None,
        op: CollOp | None,
        stages: tuple[int | None, int | None],
        at_ns: int,
    ) -> Position | None:
        """Where a hung call that began at ``at_ns`` sits (``stages``: its sender's and
        receiver's): where its folder places its partial instance, else the layout's
        schedule where the calls follow it. Where nothing said yet whether they do (the
        calls' topic read behind the heartbeats'), the job's iteration markers say which
        step it began in, and the layout's place is kept only if it says the same step;
        not for a call made before the markers kept (they are read far ahead of it)."""
        folder = self.folder(diag.comm_hash, topo)
        note = self.note_of(diag.comm_hash)
        if partial is not None and folder is not None:
            return folder.position(partial, now=True)
        if note is not None and not note.agrees:
            return None
        pos = topo.position(diag.comm_hash, diag.seq, op or CollOp.ALL_REDUCE, *stages)
        if note is None and folder is not None and at_ns:
            if at_ns <= self.forgot_ns:  # before the markers kept: the layout's, if it knows
                return pos
            marked = folder.position_at(at_ns)
            if marked is not None and (pos is None or pos.step != marked.step):
                return marked
        return pos

    def mark(self, it: Iteration) -> Iterator[Folded]:
        """One of the job's iteration markers, to each folder in turn (what one gives is
        taken before the next is told)."""
        if it.step in self.marks:
            return
        self.marks[it.step] = (it.end_ns, it.rank)
        if len(self.marks) > ScheduleBook.recent_marks:
            end, _ = self.marks.pop(min(self.marks))
            self.forgot_ns = max(self.forgot_ns, end)
        for folder in self.folders.values():
            yield folder.mark(it.step, it.end_ns, it.rank)

    def flush(self) -> Iterator[Folded]:
        """What each folder still holds (the input ended)."""
        for folder in self.folders.values():
            yield folder.flush()


__all__ = ["JobFolders"]
