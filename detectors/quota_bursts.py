"""Bursts a CPU quota made: the kernel's count of it, read over the heartbeats.

A rank's heartbeats may carry how long the kernel throttled its cgroup by its CPU quota
(:mod:`detectors.cpu_counters`). A burst whose rank (or host) its quota held back then,
and let go since, is that quota's straggler, whatever it cost and however noisy the job:
the kernel says why, where the job's timings alone could be a host's hiccup. A burst of
short steps is shorter than a heartbeat interval: its counters are read over the
heartbeats that cover it, and it is judged once they came.

:class:`QuotaBursts` is the part of :class:`~detectors.stragglers.Stragglers` that does
this, with the tracker's ledger, CPU counters and localisation (the attributes below).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from detectors.cpu_counters import CpuWaits
from detectors.cpu_wait import quota_holds
from detectors.incidents import Incident, StepTimeLedger
from detectors.steps import StepReport
from detectors.topology import Topology
from schemas.enums import Cause


class QuotaBursts:
    """Whether a burst waits for its CPU counters, and the quota that made it."""

    ledger: StepTimeLedger
    cpu: CpuWaits | None
    settle_s: float
    #: (steps, topology, the incident localised again or None, whether a burst's)
    locate: Callable[..., Incident | None]

    def _cpu_pending(self, onset: int, length: int, rep: StepReport) -> bool:
        """Whether, as of step ``rep``, the ranks' CPU counters have not come yet for all
        of the burst's ``length`` steps from ``onset`` (heartbeats come less often than a
        short step ends), or a CPU quota still holds ranks back since it
        (:func:`~detectors.cpu_wait.quota_holds`: a burst it began is the first of a
        slowdown, told as that once it lasted), or the ranks a quota held back in it have
        no heartbeat interval after it yet (:meth:`_quota_held` asks whether it let them
        go): waited for up to ``settle_s`` past it, and no longer than the job's recent
        steps keep its own."""
        cpu = self.cpu
        if cpu is None or cpu.empty:
            return False
        reps = [r for r in self.ledger.since(onset) if r.step < onset + length]
        end = reps[-1].end_ns if reps else rep.end_ns
        if rep.end_ns >= end + self.settle_s * 1e9 or rep.step - onset >= self.ledger.keep - 1:
            return False
        if not cpu.covered(end) or quota_holds(cpu, end, rep.end_ns):
            return True
        if not cpu.throttled.any():
            return False  # no quota ever held a rank back
        # the ranks a quota held back in it: whether it let them go needs a heartbeat
        # interval of theirs after it
        held = self._throttled_over(reps[0].start_ns if reps else rep.start_ns, end) > 0
        return bool(np.isnan(cpu.throttled_in(end, rep.end_ns))[held].any())

    def _throttled_over(self, start_ns: int, end_ns: int) -> np.ndarray:
        """Every rank's throttled share over the heartbeat intervals that cover
        ``start_ns`` to ``end_ns`` (0 where not known)."""
        assert self.cpu is not None
        return np.nan_to_num(self.cpu.covering(start_ns, end_ns, throttled=True))

    def _no_quota_over(self, onset: int, length: int) -> bool:
        """Whether the CPU counters that cover the ``length`` steps from ``onset`` came from
        every rank heard from, and show none of them throttled."""
        cpu = self.cpu
        reps = [r for r in self.ledger.since(onset) if r.step < onset + length]
        if cpu is None or not reps:
            return False
        t = cpu.covering(reps[0].start_ns, reps[-1].end_ns, throttled=True)
        t = t[np.asarray(cpu.count[: len(t)]) > 0]  # the ranks heard from
        return bool(len(t)) and not np.isnan(t).any() and not (t > 0).any()

    def _quota_held(
        self, reps: list[StepReport], rep: StepReport, topo: Topology, proven: bool = False
    ) -> Incident | None:
        """The burst of steps ``reps`` localised again by the CPU counters that cover it,
        where a CPU quota held its culprit back then and let go since (up to step ``rep``;
        the kernel's count of it, not the job's timings): None otherwise. The kernel names
        the cause, so the burst needs neither to stand out of the job's noise nor to cost
        the time a scheduler's hiccup does. A quota that holds on is a slowdown's, judged
        as any."""
        cpu = self.cpu
        if cpu is None or not reps or not cpu.throttled.any():
            return None
        end = reps[-1].end_ns
        if quota_holds(cpu, end, rep.end_ns):
            return None
        # let go: its ranks not throttled since, in a heartbeat interval of theirs after
        # it (however lightly throttled: a quota just under what a rank uses lets most
        # steps through, and holds on)
        held = self._throttled_over(reps[0].start_ns, end) > 0
        since = cpu.throttled_in(end, rep.end_ns)[held]
        if (np.nan_to_num(since) > 0).any() or (proven and np.isnan(since).any()):
            return None
        inc = self.locate(reps, topo, None, True)
        if inc is None or inc.cause is not Cause.HOST_CPU:
            return None
        return inc if "cpu_throttled_share" in inc.evidence else None


__all__ = ["QuotaBursts"]
