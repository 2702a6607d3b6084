"""What a rank or host starved of CPU cannot explain, looked for once its shares settled.

A rank or host starved of CPU is a shift's culprit wherever it holds
(:func:`~detectors.culprits.first_culprit`): it does its part late, and where its
collectives run on the CPU it moves their data slowly too. But it explains only as
much of the step as it was kept from running: a quota that held a rank back a tenth
of a second a second cannot make every step three times slower. Behind it there may
be a second fault the collectives show as well (a slow link that its transfers cross),
and the starved culprit, found first, would hide it.

So once the starved culprit's shares are read over enough heartbeats to be sure of
(``look_beats``), the step time its incident added is set against the share of the time
it was kept from running above the job's usual (its run-queue wait or its quota's
throttling, whichever is more). Where the step lost more than ``amplifies`` times that,
and by the least slowdown worth a verdict, the remainder is localised again without
that culprit, to the network between nodes or a host (never a rank of its own: every
rank waits for the starved one through some group, so who came late says nothing more):
what is found opens an incident of its own beside it, and the starved
one is charged no more than it explains (:meth:`~detectors.incidents.StepTimeLedger.cap`;
its verdict's evidence says how much: ``step_share_explained``).
A rank kept from running a share of the time, on the critical path all along, makes
the step longer by at most that share of the new step; a quota can cost a little more
than it holds back (a transfer stalls while its throttled end cannot drain it, and TCP
waits out its backoff), hence ``amplifies``: a quarter over once, under what a second
fault behind the starved one adds and over what a quota alone was seen to cost
(``docs/lab.md``).

:class:`Remainders` is the part of :class:`~detectors.slowdown_tracker.SlowdownTracker`
that does this; it uses the tracker's ledger, localisation and CPU waits.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np

from detectors.cpu_wait import CpuWaits
from detectors.cpu_wait import findings as cpu_findings
from detectors.culprits import first_culprit
from detectors.incidents import Culprit, Incident, StepTimeLedger
from detectors.link_tracker import LinkTracker
from detectors.steps import StepReport
from detectors.topology import Topology
from detectors.who_waits import SlowdownFinding
from schemas.enums import Cause


class Remainders:
    """Starved culprits' incidents, looked at again once their shares settled (the
    attributes below are the tracker's)."""

    ledger: StepTimeLedger
    links: LinkTracker
    open: list[Culprit]
    cpu: CpuWaits | None
    amplifies: float
    look_beats: int
    #: starved culprits whose incidents wait for their look -> the incident's onset step
    _looks: dict[Culprit, int] | None = None

    _slowdown: Callable[..., list[msgspec.Struct]]
    findings: Callable[..., list[SlowdownFinding]]

    def _look_later(self, inc: Incident, onset: int) -> None:
        """Incident ``inc`` opened at step ``onset``: looked at again if it is a starved
        rank's or host's."""
        if inc.cause is Cause.HOST_CPU and "cpu_wait_share" in inc.evidence:
            if self._looks is None:  # pickled before it had them
                self._looks = {}
            self._looks[inc.culprit] = onset

    def _look(self, rep: StepReport, topo: Topology) -> list[msgspec.Struct]:
        """The starved culprits with ``look_beats`` heartbeats or more since their onset:
        what the step lost beyond what they explain, localised."""
        assert self._looks is not None and self.cpu is not None
        out: list[msgspec.Struct] = []
        for culprit, onset in list(self._looks.items()):
            if culprit not in self.open:
                del self._looks[culprit]
                continue
            start = self.ledger.onset_ns(culprit)
            if self.cpu.beats(_ranks(culprit, topo), start, rep.end_ns) < self.look_beats:
                continue
            del self._looks[culprit]
            if reps := [r for r in self.ledger.since(onset) if r.complete]:
                out += self._remainder(culprit, onset, reps, rep, topo)
        return out

    def _remainder(
        self, culprit: Culprit, onset: int, reps: list[StepReport], rep: StepReport,
        topo: Topology,
    ) -> list[msgspec.Struct]:  # fmt: skip
        """What starved ``culprit``'s incident (since step ``onset``; ``reps``: its steps
        kept) added beyond what it explains: localised, and opened beside it."""
        assert self.cpu is not None
        start = self.ledger.onset_ns(culprit)
        cpu = cpu_findings(self.cpu, reps, topo, start)
        starved = [f for f in cpu if _names(f, culprit, topo)]
        mean = float(np.mean([r.duration_ns for r in reps]))
        increase = mean - self.ledger.level(culprit)
        if not starved or mean <= 0 or increase <= 0:
            return []  # no longer starved: the checks of its own shift tell
        ev = starved[0].evidence
        held = max(
            ev["cpu_wait_share"] - ev["usual_cpu_wait_share"],
            ev.get("cpu_throttled_share", 0.0) - ev.get("usual_cpu_throttled_share", 0.0),
        )
        explained = min(1.0, max(0.0, held))
        added = increase / mean  # of the step, what the incident added
        if added < max(self.amplifies * explained, explained + self.ledger.min_shift):
            return []
        rest = increase * (added - explained) / added
        # a rank of its own is no second culprit: every rank waits for the starved one
        # through some group (its pipeline, its tensor- and data-parallel peers), and a
        # quota's stalls stop their collectives whole (TCP then waits out its backoff), so
        # who came late says nothing more; the network between nodes, and a host, do
        found = [
            f for f in self.findings(reps, topo, rest, cpu)
            if not _names(f, culprit, topo) and f.rank is None
        ]  # fmt: skip
        inc = first_culprit(found, self.links.ends_before(start), rest, topo)
        if inc is None or inc.culprit in self.open:
            return []
        inc.evidence["step_share_unexplained_by_cpu"] = added - explained
        self.ledger.cap(culprit, explained)
        return self._slowdown(rep, mean / (self.ledger.baseline or mean), onset, topo, located=inc)


def _ranks(culprit: Culprit, topo: Topology) -> list[int]:
    """The ranks a starved culprit (a rank, or every rank of a host) names."""
    if culprit.kind == "rank":
        return [int(culprit.name)]
    nodes, _ = topo.rank_rows()
    return [r for r, node in enumerate(nodes) if node == culprit.name]


def _names(f: SlowdownFinding, culprit: Culprit, topo: Topology) -> bool:
    """Whether CPU finding ``f`` names starved ``culprit``: its rank, or its host (a
    host's ranks late together cannot be told from one of them starved)."""
    if f.cause is not Cause.HOST_CPU:
        return False
    if culprit.kind == "rank":
        return f.rank == int(culprit.name) or (
            f.rank is None and f.node == topo.node(int(culprit.name))
        )
    return f.node == culprit.name


__all__ = ["Remainders"]
