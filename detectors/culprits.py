"""Which culprit a shift's findings name: the first of them that stands.

:meth:`~detectors.slowdown_tracker.SlowdownTracker.locate` gathers a shift's candidate
culprits (the localiser's, the ranks and hosts starved of CPU, who made the others
wait, the transfers between nodes); :func:`first_culprit` picks the incident they
name. A host starved of CPU comes first (as MEGATRACE checks a host first); a rank at
the end of a degraded link is that link's, unless it is starved of CPU; a rank whose
own lateness grew by too little of the time the step lost is passed over, unless it
dominates; ranks starved of CPU together, or whose lateness grew together, are one
incident naming them all, unless they are too much of the job to be its culprits
(:func:`~detectors.who_waits.too_many`): then no rank is.

It is pure: the findings come in, an :class:`~detectors.incidents.Incident` goes out.

>>> from detectors.who_waits import SlowdownFinding
>>> from schemas.records import JobInfo
>>> topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=4, dp=4, gpus_per_node=2))
>>> late = SlowdownFinding(Cause.COMPUTE, 3, "node-1", 0, None, None, True,
...                        {"rank_lateness_growth_ns": 40e6})  # of 50 ms added a step
>>> first_culprit([late], set(), 50e6, topo).culprit
Culprit(kind='rank', name='3')
>>> host = SlowdownFinding(Cause.HOST_CPU, None, "node-0", None, None, None, True)
>>> first_culprit([late, host], set(), 50e6, topo).culprit  # a starved host first
Culprit(kind='node', name='node-0')
>>> first_culprit([late], {3}, 50e6, topo) is None  # at the end of a degraded link
True
>>> topo8 = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=8, dp=8, gpus_per_node=4))
>>> quota = [SlowdownFinding(Cause.HOST_CPU, r, f"node-{r // 4}", None, None, None, True,
...                          together=(r, 7 - r)) for r in (1, 6)]  # starved since one step
>>> first_culprit(quota, set(), 50e6, topo8).ranks  # (as cpu_wait.findings names them)
(1, 6)
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Any

from detectors.incidents import Culprit, Incident
from detectors.topology import Topology
from detectors.who_waits import APART, TOGETHER, SlowdownFinding, too_many
from schemas.enums import Cause, Phase


def first_culprit(
    found: list[SlowdownFinding],
    link_ends: set[int],
    increase: float,
    topo: Topology,
    named: AbstractSet[int] = frozenset(),
) -> Incident | None:
    """The incident the first standing finding of ``found`` names (None: none stands).
    ``link_ends``: ranks a degraded link explains; ``increase``: the step time the shift
    added (ns); ``named``: ranks open incidents name already, never slowed together with
    the first (each explains only what it added, in its own incident)."""
    # a host first (as MEGATRACE checks it first): every rank on it slowed, and the
    # one of them the critical path shows latest is only the most visible
    found.sort(key=lambda f: f.cause is not Cause.HOST_CPU)
    growths = sorted((g for f in found if (g := f.evidence.get("rank_lateness_growth_ns"))
                      is not None), reverse=True)  # fmt: skip
    spread = False
    for f in found:
        if spread and f.rank is not None:
            continue
        if f.rank is not None and f.rank in link_ends and f.cause is not Cause.HOST_CPU:
            continue  # (a slow link makes nobody wait for a CPU, nor spends a quota)
        growth = f.evidence.get("rank_lateness_growth_ns")
        if (
            growth is not None
            and growth < APART * increase
            and not _dominant(growth, growths, increase)
        ):
            continue  # too little of the lost time is this rank's own lateness
        where: dict[str, Any] = dict(pp_stage=f.stage, microbatch=f.microbatch, node=f.node,
                                     phase=Phase(f.phase) if f.phase else None,
                                     evidence=dict(f.evidence))  # fmt: skip
        if f.rank is not None:
            if f.together:  # ranks named together (starved of CPU, or not told apart),
                # less those explained: by a degraded link (a rank starved of CPU is not)
                gone = named if f.cause is Cause.HOST_CPU else link_ends | named
                ranks = tuple(r for r in f.together if r == f.rank or r not in gone)
                ranks = ranks if len(ranks) > 1 else ()
            else:
                ranks = _together(f, found, link_ends | named, APART * increase)
            if too_many(ranks, topo):
                spread = True  # the job's own: no rank found after it is its culprit
                continue
            return Incident(Culprit.rank(f.rank), f.cause, rank=f.rank,
                            gpu=topo.gpu(f.rank), ranks=ranks, **where)  # fmt: skip
        if f.link is not None:  # the network between nodes
            where["phase"] = Phase.TRANSFER
            return Incident(Culprit.network(f.link), f.cause, link=f.link, **where)
        return Incident(Culprit.node(str(f.node)), f.cause, **where)
    return None


def _together(first: Any, found: list[Any], link_ends: set[int], least: float) -> tuple[int, ...]:
    """The culprits of one incident: the ``first`` rank found and every other rank found
    whose own lateness grew ``least`` or more and nearly as much as its (two ranks
    slowed together); () where it is alone."""
    growth = first.evidence.get("rank_lateness_growth_ns")
    if growth is None or growth <= 0:
        return ()
    more = sorted({
        f.rank for f in found
        if f.rank is not None and f.rank != first.rank and f.rank not in link_ends
        and (g := f.evidence.get("rank_lateness_growth_ns")) is not None
        and g >= max(least, TOGETHER * growth)
    })  # fmt: skip
    return (first.rank, *more) if more else ()


def _dominant(growth: float, growths: list[float], increase: float) -> bool:
    """Whether a rank's lateness grew most, ``_DOMINANT`` times more than the next
    candidate's, and by a tenth of the step time added: who made the others wait,
    though waits that spread along a pipeline (each stage waits on the one before) make
    the step lose more than the rank's own lateness (``growths``: every candidate's,
    largest first)."""
    runner_up = growths[1] if len(growths) > 1 else 0.0
    return (
        growth > 0
        and growth == growths[0]
        and growth >= _DOMINANT * max(runner_up, 0.0)
        and growth >= 0.1 * increase
    )


#: a rank whose lateness grew this many times more than any other's is the culprit
_DOMINANT = 3.0


__all__ = ["first_culprit"]
