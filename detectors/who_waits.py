"""Localise a slowdown in any layout: who made the others wait, or the network.

Where no schedule can be walked (a data-parallel job, a layout its calls do not
follow), or nothing on it explains the time added, :meth:`WhoWaits.who_waits` names
who makes the others wait: of the ranks that spent a good share of the time added busy
while the others waited, every rank of one node is its host, else the one that held the
others up most; and where nobody waited, :meth:`WhoWaits.slow_transfers` names the
network between the nodes whose transfers grew.

:class:`WhoWaits` is the part of :class:`~detectors.slowdown.SlowdownLocalizer` that
does this over the baselines it keeps (the attributes below).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from detectors.steps import StepReport
from detectors.topology import Topology
from schemas.enums import Cause

#: a rank whose lateness grew this much of the latest arriver's is a culprit with it
TOGETHER = 0.5
#: the share of the step time added a rank's own lateness (or blame) must have grown by to
#: be told apart from others the evidence names with it
APART = 0.25


@dataclass(frozen=True)
class SlowdownFinding:
    cause: Cause
    rank: int | None
    node: str | None
    stage: int | None
    phase: str | None
    microbatch: int | None
    critical: bool
    evidence: dict[str, float] = field(default_factory=dict)
    link: str | None = None  # the network between nodes, where that is the cause
    #: ranks the evidence cannot tell ``rank`` apart from: one incident names them all
    together: tuple[int, ...] = ()


class WhoWaits:
    """Who made the others wait, and slower transfers, over the localiser's baselines."""

    #: the last arrivers' blame, each rank's time waiting in collectives, and per
    #: communicator a step's transfer time (the localiser keeps them)
    base_blame: np.ndarray | None
    base_wait: np.ndarray | None
    base_xsum: dict[int, float]

    def who_waits(
        self, reports: Sequence[StepReport], topo: Topology, increase: float, share: float = 0.3
    ) -> list[SlowdownFinding]:
        """Who made the others wait, in any layout. The ranks split where how much longer
        they waited (for others, in collectives or for a pipeline stage's input) breaks
        widest, by ``share`` of the step time added or more: those below the break stayed
        busy, doing their own part slower, while the others waited for them by ``share``
        or more. Of the busy ranks, every rank of one node (two or more): that node's
        host; else the one that made the others wait most as the last to arrive (its
        exclusive blame grew most: the members of its own collectives that it held up
        are busy in them with it), with those its blame does not tell it apart from.
        Nobody where nobody waited for the time added (it went into transfers: a
        network, or, where the collectives run on the CPU, as Gloo's do, a rank slow at
        them too), or where the busy ranks are many (a quarter of the job; half, all on
        one node)."""
        reps = [r for r in reports if r.complete] or list(reports)
        base = getattr(self, "base_wait", None)
        if not reps or base is None or increase <= 0 or len(base) < 2:
            return []
        grew = np.mean([r.wait_ns for r in reps], axis=0) - base
        # the ranks on either side of the widest break in how much longer they waited,
        # the busy ones at most half the job (one that waited far longer is no break)
        order = np.argsort(grew, kind="stable")
        gaps = np.diff(grew[order])[: max(1, len(grew) // 2)]
        cut = int(np.argmax(gaps)) + 1
        busy = sorted(order[:cut].tolist())
        waited = grew[order[cut:]].tolist()
        if gaps[cut - 1] < share * increase or waited[0] < share * increase:
            return []  # nobody stands apart, or the others hardly waited longer
        if too_many(busy, topo):
            return []
        nodes = {topo.node(r) for r in busy}
        evidence = {
            "others_wait_growth_ns": float(np.median(waited)),
            "step_time_added_ns": float(increase),
            "busy_ranks": float(len(busy)),
        }
        (node, *more) = nodes
        on_node = [r for r in range(len(grew)) if topo.node(r) == node]
        if not more and len(busy) >= 2 and busy == on_node:
            return [SlowdownFinding(Cause.HOST_CPU, None, node, None, None, None,
                                    critical=True, evidence=evidence)]  # fmt: skip
        r, together = (busy[0], ()) if len(busy) == 1 else self._most_blamed(reps, busy, increase)
        if r is None:
            return []
        evidence["rank_wait_growth_ns"] = float(grew[r])
        return [SlowdownFinding(Cause.COMPUTE, r, topo.node(r), None, None, None,
                                critical=True, evidence=evidence, together=together)]  # fmt: skip

    def _most_blamed(
        self, reps: Sequence[StepReport], busy: list[int], increase: float
    ) -> tuple[int | None, tuple[int, ...]]:
        """Of several ``busy`` ranks, the one whose exclusive blame as the last arriver grew
        most (None: none grew), and those it cannot be told apart from: every one of them
        where that growth is under :data:`APART` of the step time added, else those whose
        blame grew nearly as much (:data:`TOGETHER`). Ranks held up together inside one
        collective (one of them stopped in the middle of a transfer) come to the next ones
        within moments of each other, and who came last by those moments says nothing of
        who held the job up."""
        blame = self.blame_grew(reps)
        if blame is None:
            return None, ()
        top = max(busy, key=lambda r: blame[r])
        if blame[top] <= 0:
            return None, ()
        if blame[top] < APART * increase:
            return top, tuple(busy)
        # any nearly as blamed as the most (two held the others up as much)
        with_top = tuple(r for r in busy if r == top or blame[r] >= TOGETHER * blame[top])
        return top, (with_top if len(with_top) > 1 else ())

    def blame_grew(self, reps: Sequence[StepReport]) -> np.ndarray | None:
        """Per rank, how much longer a step it made the others wait as the last to arrive
        over ``reps`` than it usually does (ns; None: no baseline yet, or no step)."""
        base = self.base_blame
        if base is None or not reps:
            return None
        return np.mean([r.blame_any_ns for r in reps], axis=0) - base

    def slow_transfers(
        self,
        reports: Sequence[StepReport],
        topo: Topology,
        increase: float,
        share: float = 0.8,
        cpu_bound: Callable[[set[int], int], bool] | None = None,
    ) -> list[SlowdownFinding]:
        """The network, where the step time added went into transfers between nodes: the
        communicators spanning nodes whose instances' transfer times (after everyone
        came) grew by ``share`` of it or more: a slower network adds its transfers' time
        and little else (where every rank computes slower too, as on a busy host, the
        transfers are not the cause). The culprit is the node every one of them
        has in common, if one; else the network between their nodes (a collective's
        timings cannot tell which node's link is slow when it spans only those). Not
        where their members were kept from a CPU through those steps
        (``cpu_bound(ranks, since_ns)``): they moved the data late."""
        reps = [r for r in reports if r.complete] or list(reports)
        base = getattr(self, "base_xsum", {})
        if not reps or not base or increase <= 0:
            return []
        growth: dict[int, float] = {}
        for c in {c for r in reps for c in r.transfer_sum_ns}:
            info = topo.comms.get(c)
            if info is None or len({topo.node(r) for r in info.ranks}) < 2:
                continue
            g = float(np.mean([r.transfer_sum_ns.get(c, 0) for r in reps])) - base.get(c, 0.0)
            if g > 0:
                growth[c] = g
        total = sum(growth.values())
        if total < share * increase:
            return []
        grown = [c for c, g in growth.items() if g >= 0.2 * total]
        members = set().union(*(topo.comms[c].ranks for c in grown))
        if cpu_bound is not None and cpu_bound(members, reps[0].start_ns):
            return []
        node_sets = [{topo.node(r) for r in topo.comms[c].ranks} for c in grown]
        common = set.intersection(*node_sets)
        nodes = sorted(set.union(*node_sets))
        node = next(iter(common)) if len(common) == 1 else None
        top = max(grown, key=growth.__getitem__)
        before = base.get(top, 0.0)
        return [
            SlowdownFinding(
                Cause.NETWORK_LINK,
                None,
                node,
                None,
                None,
                None,
                critical=True,
                evidence={
                    "transfer_growth_ns": total,
                    "step_time_added_ns": float(increase),
                    "transfer_ratio": (before + growth[top]) / before if before else 0.0,
                    "communicators": float(len(grown)),
                },
                link=f"{node}" if node else "<->".join(nodes),
            )
        ]


def too_many(ranks: Sequence[int], topo: Topology) -> bool:
    """Whether ``ranks`` are too much of the job to be a slowdown's culprits: more than a
    quarter of it (half, all on one node: its host). What that many ranks share is the
    job's own (a step's pause on every rank of one role, a busy shared host), not a fault
    of theirs.

    >>> from schemas.records import JobInfo
    >>> topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=8, gpus_per_node=4))
    >>> too_many([1, 2], topo), too_many([0, 2, 4, 6], topo), too_many([4, 5, 6, 7], topo)
    (False, True, False)
    """
    nodes = {topo.node(r) for r in ranks}
    return len(ranks) > max(1, topo.job.world_size // (2 if len(nodes) == 1 else 4))


__all__ = ["APART", "TOGETHER", "SlowdownFinding", "WhoWaits", "too_many"]
