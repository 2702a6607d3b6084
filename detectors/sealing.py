"""When a communicator's step parts are done and go to the job.

Where the job's iteration markers place its steps, a marked step's part is done once
the communicator's calls (or its clock) went past the step's end; where only its calls'
recurring pattern does, once the part holds a step's instances, or an instance some
steps later came. Each sequence's step structure, once learned, is told first.

:class:`PartSealing` is the part of :class:`~detectors.folder.StepFolder` that does
this, over the folder's parts and clock (the attributes below).
"""

from __future__ import annotations

from typing import Any

from detectors.parts import StepPart
from detectors.step_clock import StepClock, structure_note
from schemas.enums import CommRole


class PartSealing:
    """The parts a :class:`~detectors.folder.StepFolder` sends, and when."""

    clock: StepClock
    job: str
    comm_hash: int
    role: CommRole
    give_up_steps: int
    max_open_steps: int
    idle_ns: int
    _parts: dict[int, StepPart]
    _newest: int
    _last_arrival: int
    _last_call_ns: int
    _clock_ns: int
    _sealed_upto: int
    _sent: set[int]

    def _done(self, final: bool = False) -> list[Any]:
        """The structure notes learned since, then the parts done (every one: ``final``)."""
        marks = bool(self.clock.mark_ends)
        out: list[Any] = [
            structure_note(self.job, self.comm_hash, self.role, self._last_call_ns, *told, marks)
            for told in self.clock.told_now(final)
        ]  # each sequence's step, once learned, told once; whether the layout holds
        if marks:
            return out + self._sealed_by_marks(final)
        return out + self._sealed_by_counts()

    def _sealed_by_counts(self) -> list[StepPart]:
        """Cycles: a part is done when it holds a step's instances, or given up on once
        an instance ``give_up_steps`` later came."""
        per_step = self.clock.per_step()
        done = {s for s, p in self._parts.items() if per_step and p.n >= per_step}
        done.update(s for s in self._parts if s <= self._newest - self.give_up_steps)
        while len(self._parts) - len(done) > self.max_open_steps:
            done.add(min(s for s in self._parts if s not in done))
        # in step order: the job takes a communicator's later step for a sign that it is
        # done with the earlier ones
        return [self._parts.pop(s).seal() for s in sorted(done)]

    def _sealed_by_marks(self, final: bool) -> list[StepPart]:
        """Marks: a marked step's part is done once the communicator's calls went past its
        end, or its clock did by ``idle_ns`` (it was idle); never because later steps'
        markers came (they come on another topic, read at its own pace: steps ahead of a
        communicator read late). A step it had nothing in since it first took part is
        sent empty, so that the job need not wait for it; a part of a step already sent
        (an instance completed late) goes at once."""
        if self._newest < 0:
            return []  # it took part in no step yet
        passed = max(self._last_arrival, self._clock_ns - self.idle_ns)
        done_upto = self.clock.marked_upto(passed, final)  # -1: none ended before
        # every sequence numbered by its cycle: a step is done when it holds a step's
        # instances; the marks only give up on it a step later
        whole = self.clock.numbered() and not final
        per_step = self.clock.per_step() if whole else 0
        if per_step:
            done_upto -= 1
        full = [s for s, p in self._parts.items() if per_step and p.n >= per_step]
        out = [self._parts.pop(s).seal() for s in sorted(self._parts)
               if s <= self._sealed_upto or s in full]  # fmt: skip
        self._sent.update(p.step for p in out if p.step > self._sealed_upto)
        if self._sealed_upto < 0 and (self._parts or out):
            self._sealed_upto = min([*self._parts, *(p.step for p in out)]) - 1
        for s in range(self._sealed_upto + 1, done_upto + 1):
            part = self._parts.pop(s, None)
            if part is not None or s not in self._sent:
                out.append((part or StepPart(s, self.comm_hash, self.job)).seal())
            self._sent.discard(s)
        self._sealed_upto = max(self._sealed_upto, done_upto)
        while len(self._parts) > self.max_open_steps:  # bounded, whatever the marks say
            out.append(self._parts.pop(min(self._parts)).seal())
        return out


__all__ = ["PartSealing"]
