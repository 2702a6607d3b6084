"""A straggler's bursts recurring: an intermittent slowdown once they cost the job what a
slowdown must (the change-point detector's least shift) since the first, or while one
is open; otherwise each was a transient straggler of its own, told already (a rank that
straggled twice in a thousand steps is two transient stragglers).

:class:`Recurrence` is the part of :class:`~detectors.stragglers.Stragglers` that judges
this, with the tracker's verdict book, ledger and change-point detector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np

from detectors import texts
from detectors.incidents import Incident, StepTimeLedger
from detectors.steps import StepReport
from detectors.verdicts import VerdictBook
from schemas.enums import VerdictKind

if TYPE_CHECKING:
    from detectors.changepoint import ShiftDetector


class Recurrence:
    """Whether a culprit's bursts recur, and the intermittent slowdown they make."""

    book: VerdictBook
    ledger: StepTimeLedger
    shift: ShiftDetector

    def _recurs(self, inc: Incident, bursts: list[tuple[int, float, int]], rep: StepReport) -> bool:
        """Whether ``inc``'s culprit bursting again (``bursts``, the newest last) is an
        intermittent slowdown: one is open already, or its bursts cost the job what a
        slowdown must (the change-point detector's least shift) since the first. If not,
        the earlier ones were stragglers of their own, told already, and are forgotten:
        a rank that straggled twice in a thousand steps is two transient stragglers."""
        if len(bursts) < 2:
            return False
        key = (VerdictKind.INTERMITTENT_SLOWDOWN.value, inc.culprit.key)
        if self.book.current(*key) is not None or _cost(bursts, rep) >= self.shift.min_shift:
            return True
        del bursts[:-1]
        return False

    def _intermittent(
        self, inc: Incident, bursts: list[tuple[int, float, int]], rep: StepReport
    ) -> list[msgspec.Struct]:
        """``inc``'s culprit burst again (``bursts``, the newest last): an intermittent
        slowdown, opened or revised."""
        first = bursts[0][0]
        severity = _cost(bursts, rep)
        mean_ratio = float(np.mean([r for _, r, _ in bursts]))
        inc.evidence = {
            **inc.evidence,
            "bursts": float(len(bursts)),
            "mean_burst_ratio": mean_ratio,
            "burst_period_steps": float(np.mean(np.diff([b[0] for b in bursts]))),
        }
        reps = [r for r in self.ledger.recent if r.step == first]
        who = inc.who
        summary = texts.intermittent_summary(
            who=who, bursts=len(bursts), mean_ratio=mean_ratio, first=first, severity=severity
        )
        v = self.book.report(
            VerdictKind.INTERMITTENT_SLOWDOWN,
            inc.cause,
            inc.culprit.key,
            onset_step=first,
            onset_ns=reps[0].start_ns if reps else rep.start_ns,
            detected_ns=rep.end_ns,
            severity=severity,
            confidence=0.8,
            step=first,
            summary=summary,
            **inc.fields(),
        )
        return [v] if v else []


def _cost(bursts: list[tuple[int, float, int]], rep: StepReport) -> float:
    """The share of the job's time that ``bursts`` (onset, ratio, steps) added from the
    first of them to step ``rep``."""
    span = max(1, rep.step - bursts[0][0] + 1)
    extra = sum((r - 1) * n for _, r, n in bursts)
    return extra / (span + extra)


__all__ = ["Recurrence"]
