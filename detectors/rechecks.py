"""A rank named from a shift's first steps, checked again once the shift settled.

In a shift's first steps a held-up peer can come as late as the rank holding it up,
so a rank named then is reported at once and localised again once the shift has
lasted ``settle_steps``: another rank or host found then takes over the incident (the
same verdict, revised). Where that culprit is another open incident's already, the
two told one fault twice: the later of them is closed, the earlier takes the culprit.
A later shift whose culprit is not open has such ranks checked again before it opens
an incident, so that a fault seen first on a peer stays one incident.

:class:`Rechecks` is the part of :class:`~detectors.slowdown_tracker.SlowdownTracker`
that does this; it uses the tracker's verdict book, ledger and localisation.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from detectors.incidents import Culprit, Incident, StepTimeLedger
from detectors.steps import StepReport
from detectors.topology import Topology
from detectors.verdicts import VerdictBook


class Rechecks:
    """Ranks named before their shift settled, localised again (the attributes below are
    the tracker's)."""

    book: VerdictBook
    ledger: StepTimeLedger
    open: list[Culprit]
    settle_steps: int
    _unsettled: dict[Culprit, int] | None

    locate: Callable[[list[StepReport], Topology, Culprit | None], Incident | None]
    _slowdown: Callable[..., list[msgspec.Struct]]

    def _recheck(self, rep: StepReport, topo: Topology) -> list[msgspec.Struct]:
        """Ranks named from a shift's first steps, localised again once it has lasted
        ``settle_steps``: another rank or host found then takes over the incident (in
        the first steps, a held-up peer can look as late as the rank that holds it up)."""
        assert self._unsettled is not None
        out: list[msgspec.Struct] = []
        for culprit, onset in list(self._unsettled.items()):
            reps = self.ledger.since(onset)
            if len(reps) < self.settle_steps:
                continue
            del self._unsettled[culprit]
            found = self.locate(reps, topo, culprit) if culprit in self.open else None
            if (
                found is None
                or found.culprit == culprit
                or found.culprit.kind not in ("rank", "node")
            ):
                continue
            if found.culprit in self.open:  # one fault told twice: the later one goes
                later = max(culprit, found.culprit, key=self.ledger.onset_ns)
                out += self._fold(later, rep)
                if later == culprit:
                    continue
            self.book.rename(culprit.verdict_kind.value, culprit.key, found.culprit.key)
            self.ledger.rename(culprit, found.culprit)
            self.open[self.open.index(culprit)] = found.culprit
            ratio = self.ledger.ratio_since(onset) or 1.0
            out += self._slowdown(rep, ratio, onset, topo, located=found)
        return out

    def _fold(self, culprit: Culprit, rep: StepReport) -> list[msgspec.Struct]:
        """Incident ``culprit`` was another's, told again: it is resolved (its alert
        was sent; the other one goes on)."""
        assert self._unsettled is not None
        self.open.remove(culprit)
        self.ledger.forget(culprit)
        self._unsettled.pop(culprit, None)
        v = self.book.resolve(culprit.verdict_kind.value, culprit.key, rep.end_ns)
        return [v] if v is not None else []


__all__ = ["Rechecks"]
