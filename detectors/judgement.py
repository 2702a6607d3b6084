"""When a confirmed shift of step time is localised, and what it is put down to.

A shift is judged once every node's link samples reached the step that confirmed it
(a degraded link explains its ends' lateness), and believed only once it settled
where its first steps name the network, a host or nobody. One that nothing localises
(no rank, host or network explains it: the whole job got slower) is the job's own
variation until it has lasted ``unexplained_steps``, is still slow, and its steps' mean
stands out of the noise as its first steps had to: a busy shared host, a checkpoint or a
collection pause slows every rank for a few steps, and Greyhound (docs/method.md)
likewise keeps only changes at least 10 iterations apart.
A fault that something localises is reported as soon as it settled.

Every shift is believed only once it has lasted ``settle_s`` of the job's time too: a
host's own hiccups (the scheduler, memory reclaim, a collection pause, a log flush) last
up to about a second whatever the job's step, and a job of 20 ms steps slowed by one
for half a second has 25 slow steps, as many as a fault would make. A shift over
sooner was a straggler for a while, judged as a burst is
(:class:`~detectors.stragglers.Stragglers`).

:class:`Judgement` is the part of :class:`~detectors.slowdown_tracker.SlowdownTracker`
that does this; it uses the tracker's ledger, links and localisation.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np

from detectors.changepoint import ShiftDetector
from detectors.cpu_wait import CpuWaits, cpu_bound_until
from detectors.cpu_wait import findings as cpu_findings
from detectors.culprits import first_culprit
from detectors.incidents import Culprit, Incident, StepTimeLedger
from detectors.link_tracker import LinkTracker
from detectors.slowdown import SlowdownLocalizer
from detectors.steps import StepReport
from detectors.topology import Topology
from detectors.who_waits import SlowdownFinding


class Judgement:
    """A pending shift judged and its candidate culprits found (the attributes below are
    the tracker's)."""

    ledger: StepTimeLedger
    links: LinkTracker
    localizer: SlowdownLocalizer
    cpu: CpuWaits | None
    pending: tuple[int, float, int] | None
    #: when the pending shift's first step began (0: a tracker pickled before it was kept;
    #: the ledger keeps a few of its steps, which a shift of short steps outlasts soon)
    pending_since_ns: int = 0
    settle_steps: int
    link_wait_ms: float
    #: for a tracker pickled before it had them
    unexplained_steps: int = 10
    settle_s: float = 1.0

    _slowdown: Callable[..., list[msgspec.Struct]]
    explained: Callable[[Culprit | None], tuple[set[int], set[str]]]

    shift: ShiftDetector

    def judge(self, rep: StepReport, topo: Topology, final: bool = False) -> list[msgspec.Struct]:
        """Localise the pending shift (as of step ``rep``, the newest) once every node's link
        samples reached the step that confirmed it, or ``link_wait_ms`` after that step
        (or now: ``final``, no more input: the links' samples will not come, nor the
        second a shift must last; one not settled on a culprit, or nothing localises and
        it has not lasted as long as such a shift must, is not believed then either).

        Topics are read at different paces: a degraded link whose samples are read a
        few steps after the collectives would otherwise leave its slowdown to the job
        (cause unknown) or to the rank at its end, and then be reported beside it."""
        assert self.pending is not None
        onset, ratio, confirmed_ns = self.pending
        waited = rep.end_ns - confirmed_ns >= self.link_wait_ms * 1e6
        if self.links.behind(confirmed_ns) and not waited and not final:
            return []
        reps = self.ledger.since(onset)
        if final:  # judged as it stands: what is not believed now never will be
            self.pending = None
        since = self.pending_since_ns or (reps[0].start_ns if reps else rep.start_ns)
        if rep.end_ns - since < self.settle_s * 1e9 and not final:
            return []  # not yet longer than a host's own hiccups last
        found = self.locate(reps, topo)
        # who waits for whom takes a few steps to show: a network, a host or nobody,
        # named from the first steps of a shift, is only believed once it settled
        settled = len(reps) >= self.settle_steps
        if not settled and (found is None or found.culprit.kind in ("nodes", "node")):
            return []
        if found is None and not self._lasted(onset, len(reps)):
            return []  # the whole job slower for a while: its own variation, so far
        self.pending = None
        # the steps' own times: the detector's ratio is of values clipped for its test
        ratio = self.ledger.ratio_since(onset) or ratio
        return self._slowdown(rep, ratio, onset, topo, located=found)

    def _lasted(self, onset: int, steps: int) -> bool:
        """A shift that nothing localises is believed once it lasted ``unexplained_steps``,
        is slow still, and its steps' mean stands out of the noise as a shift's first
        steps must (the bar): a few slow steps that began it, then steps within the noise,
        are the job's own variation too."""
        if steps < self.unexplained_steps or not self.shift.slow_now:
            return False
        ratio = self.ledger.ratio_since(onset)
        return ratio is None or ratio >= 1.0 + self.shift.bar

    def locate(
        self,
        reps: list[StepReport],
        topo: Topology,
        again: Culprit | None = None,
        burst: bool = False,
    ) -> Incident | None:
        """The first localised candidate not explained by a degraded link (MEGATRACE checks
        links first: a rank whose NIC is slow arrives late without computing slowly), nor
        by another open incident (``again``: the one localised again, whose own ranks its
        culprits may be). A ``burst``'s CPU shares are read over the heartbeat intervals
        that cover it (:func:`~detectors.cpu_wait.starved`)."""
        # a link explains its ends' lateness only from when it degraded: a GPU that slowed
        # before its own link did is still the culprit of what it began
        link_ends = self.links.ends_before(reps[0].end_ns if reps else 0)
        increase = float(np.mean([r.duration_ns for r in reps])) - self.ledger.level_before(reps)
        named, _ = self.explained(again)
        cpu = None
        if burst and self.cpu is not None:
            cpu = cpu_findings(self.cpu, reps, topo, burst=True)
        found = self.findings(reps, topo, increase, cpu)
        return first_culprit(found, link_ends, increase, topo, named)

    def findings(
        self,
        reps: list[StepReport],
        topo: Topology,
        increase: float,
        cpu: list[SlowdownFinding] | None = None,
    ) -> list[SlowdownFinding]:
        """The candidate culprits of ``increase`` ns added to the steps ``reps``, most
        telling first (``cpu``: the ranks and hosts starved of CPU, where read already)."""
        found = self.localizer.localize(reps, topo)
        if cpu is None and self.cpu is not None:
            cpu = cpu_findings(self.cpu, reps, topo)
        found += cpu or []  # starved of CPU: the cause, whatever the collectives show
        if not any(r.spans for r in reps) or not self.links.open:
            # last: who made the others wait (no schedule to walk, or nothing on it); and
            # if nobody did, the transfers between nodes that took longer
            found += self.localizer.who_waits(reps, topo, increase)
            if not self.links.open:
                bound = cpu_bound_until(self.cpu, reps[-1].end_ns)
                found += self.localizer.slow_transfers(reps, topo, increase, cpu_bound=bound)
        return found


__all__ = ["Judgement"]
