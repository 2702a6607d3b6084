"""Merging the step parts of many communicators before the job sees them.

:class:`PartMerger` merges a shard of a job's communicators' parts into one part per
step (the flow keys it by job and :func:`shard_of` the communicator), keeping only the
newest :class:`CommLiveness` of them; :class:`StepWatermark` tells which step every
communicator reached (the merger and the job's assembler wait on it).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import NamedTuple

from detectors.parts import StepPart


class CommLiveness(NamedTuple):
    """The newest arrival and completion a communicator has seen (the job's liveness)."""

    job: str
    comm_hash: int
    last_arrival_ns: int
    last_end_ns: int


class StepWatermark:
    """The newest step each communicator reached, and how many are at each step, so the
    lowest is known at once (a job has thousands of communicators, a handful of steps).

    >>> w = StepWatermark()
    >>> w.advance((1, 2), 4), w.advance((1,), 5), w.advance((1,), 3), w.low()
    (True, True, False, 4)
    """

    def __init__(self) -> None:
        self.newest: dict[int, int] = {}  # communicator -> its newest step
        self._at: dict[int, int] = {}  # step -> how many communicators have it as newest

    def advance(self, comms: Iterable[int], step: int) -> bool:
        """``comms`` reached ``step``; whether any of them moved."""
        moved = False
        for comm in comms:
            prev = self.newest.get(comm)
            if prev is not None and step <= prev:
                continue
            moved = True
            self.newest[comm] = step
            self._at[step] = self._at.get(step, 0) + 1
            if prev is not None:
                self._drop(prev)
        return moved

    def low(self, within: int | None = None) -> int:
        """The lowest newest step; with ``within``, of the communicators at most that
        many steps behind the highest (those further behind are not waited for)."""
        if within is None:
            return min(self._at)
        high = self.high()
        return min(s for s in self._at if s >= high - within)

    def steps_held(self) -> Collection[int]:
        """The steps some communicator has as its newest."""
        return self._at.keys()

    def high(self) -> int:
        """The highest step a communicator reached."""
        return max(self._at)

    def forget_before(self, step: int) -> None:
        """Communicators whose newest step is older than ``step`` are gone."""
        if not self._at or min(self._at) >= step:
            return
        for comm in [c for c, s in self.newest.items() if s < step]:
            self._drop(self.newest.pop(comm))

    def _drop(self, step: int) -> None:
        if self._at[step] == 1:
            del self._at[step]
        else:
            self._at[step] -= 1


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

    >>> from detectors.parts import StepPart
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
        self._progress = CommLiveness("", -1, 0, 0)  # the newest of its communicators'
        self._reported = self._progress

    def update(self, part: StepPart | CommLiveness) -> list[StepPart]:
        """Take a part; return the merged parts now complete, oldest first.

        A communicator's progress is kept as the newest of all (see :meth:`progress`)."""
        if isinstance(part, CommLiveness):
            now = self._progress
            self._progress = CommLiveness(
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

    def progress(self) -> list[CommLiveness]:
        """Its communicators' newest arrival and completion, when they moved since the
        last call: each communicator reports after every batch it reads, some 100,000
        reports a step at 4,096 ranks; the job needs only the newest."""
        if self._progress == self._reported:
            return []
        self._reported = self._progress
        return [self._progress]


__all__ = ["CommLiveness", "PartMerger", "StepWatermark", "shard_of"]
