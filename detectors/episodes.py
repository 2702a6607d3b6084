"""Which bursts of slow steps are one straggler's: the episodes of
:class:`~detectors.stragglers.Stragglers`.

A rank stalled inside a collective comes out of it with its peers, so the bursts of one
stalled rank do not always name it: they name it, a peer it held inside the call, or
both, and now and then a neighbour the stall held up besides. The members of one
tensor-parallel group leave every all-reduce of theirs together (the group is the unit
the critical path is made of), so a burst naming one of them and a burst naming
another are one rank's stalls as much as two bursts naming the same rank. So are a burst
naming a rank and one naming its pipeline neighbour (the neighbour waited for it, then
came last at its own group's collectives), and a burst naming a host and one naming a
rank on it (a rank that stalls holds its host's others up with it, and a burst names
the host where they all came late).

>>> from detectors.incidents import Culprit, Incident
>>> from detectors.topology import Topology
>>> from schemas.enums import Cause, CommRole
>>> from schemas.records import CommInfo, JobInfo
>>> topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=8, tp=2, pp=2, dp=2))
>>> for h, ranks in enumerate(([0, 1], [2, 3], [4, 5], [6, 7])):
...     topo.add(CommInfo(job="j", ts_ns=0, comm_hash=h, role=CommRole.TP, ranks=ranks))
>>> def burst(*ranks):
...     return Incident(Culprit.rank(ranks[0]), Cause.COMPUTE, rank=ranks[0],
...                     node=topo.node(ranks[0]), ranks=ranks if len(ranks) > 1 else ())
>>> first = burst(5, 1)  # rank 1 stalled; its pipeline peer 5 was held up with it
>>> named, bursts = {first.culprit: first}, {first.culprit: [(9, 2.9, 1)]}
>>> later = episode(burst(0), named, bursts, topo)  # its tensor-parallel peer, alone
>>> later.culprit == first.culprit, later.rank, later.ranks
(True, 1, (1, 0))
>>> episode(burst(2), named, bursts, topo) == burst(2)  # another group: its own
True

A stalled rank's pipeline neighbour waits for its activations, then arrives last at its
own group's collectives: a burst naming it alone goes on from the stalled rank's, named
as the two (the rank they share, and the neighbour).

>>> for h, ranks in enumerate(([0, 4], [1, 5], [2, 6], [3, 7]), start=4):
...     topo.add(CommInfo(job="j", ts_ns=0, comm_hash=h, role=CommRole.PP, ranks=ranks))
>>> first = burst(0, 1)  # rank 1 stalled inside its group's all-reduce
>>> named, bursts = {first.culprit: first}, {first.culprit: [(9, 2.5, 1)]}
>>> later = episode(burst(5), named, bursts, topo)
>>> later.culprit == first.culprit, later.rank, later.ranks
(True, 1, (1, 5))
>>> episode(burst(6), named, bursts, topo) == burst(6)  # another pipeline's: its own
True

A host's burst, then one of its ranks': one episode, named as the rank.

>>> host = Incident(Culprit.node(topo.node(3)), Cause.HOST_CPU, node=topo.node(3))
>>> named, bursts = {host.culprit: host}, {host.culprit: [(13, 2.9, 1)]}
>>> later = episode(burst(3), named, bursts, topo)
>>> later.culprit == host.culprit, later.rank, later.node == topo.node(3)
(True, 3, True)
"""

from __future__ import annotations

from dataclasses import replace

from detectors.incidents import Culprit, Incident
from detectors.topology import Topology
from detectors.who_waits import too_many
from schemas.enums import CommRole


def episode(
    inc: Incident,
    named: dict[Culprit, Incident],
    bursts: dict[Culprit, list[tuple[int, float, int]]],
    topo: Topology,
) -> Incident:
    """The bursts ``inc``'s burst goes on from: those of a culprit (``named``: each
    culprit's bursts as last named; ``bursts``: theirs, kept while they may recur) that
    named a rank it names too, or a rank that a stall of one it names holds up with it
    (:func:`held_with`). Named as the ranks of both; where only held up together, as
    the ranks of the two held up with both (the first of them the incident's rank).
    Else ``inc``'s own. Not where the ranks would be too many to be culprits
    (:func:`~detectors.who_waits.too_many`): they are what the job does."""
    mine = set(inc.named)
    own = [inc.culprit] if inc.culprit in named else []  # its own bursts first
    for culprit in own + [c for c in named if c != inc.culprit]:
        earlier = named[culprit]
        if not bursts.get(culprit):
            continue
        theirs = earlier.named
        if culprit != inc.culprit and _host_and_rank(earlier, inc):
            return _on_host(earlier, inc, topo)
        if culprit != inc.culprit and not mine & set(theirs):
            group = held_with(theirs, topo) & held_with(mine, topo)
            if not group:
                continue
            theirs = tuple(r for r in theirs if r in group)
            ranks = tuple(dict.fromkeys([*theirs, *sorted(mine & group)]))
        else:
            ranks = tuple(dict.fromkeys([*theirs, *sorted(mine - set(theirs))]))
        if too_many(ranks, topo):
            continue
        out = replace(earlier, ranks=ranks if len(ranks) > 1 else (),
                      evidence={**earlier.evidence, **inc.evidence})  # fmt: skip
        if earlier.rank is not None and earlier.rank != ranks[0]:  # it named others
            r = ranks[0]
            out = replace(out, rank=r, gpu=topo.gpu(r), node=topo.node(r),
                          pp_stage=topo.coords(r)[0])  # fmt: skip
        return out
    return inc


def _host_and_rank(a: Incident, b: Incident) -> bool:
    """Whether one of ``a`` and ``b`` names a host and the other one rank on it (a rank
    that stalls holds its host's others up with it: their bursts name the host)."""
    kinds = {a.culprit.kind, b.culprit.kind}
    return kinds == {"node", "rank"} and a.node == b.node is not None


def _on_host(earlier: Incident, inc: Incident, topo: Topology) -> Incident:
    """A host's bursts and one of its ranks' as one episode (``earlier``'s), named as
    the rank: the host's others were held up with it."""
    evidence = {**earlier.evidence, **inc.evidence}
    r = earlier.rank if earlier.rank is not None else inc.rank
    assert r is not None
    return replace(earlier, rank=r, gpu=topo.gpu(r), node=topo.node(r),
                   pp_stage=topo.coords(r)[0], evidence=evidence)  # fmt: skip


def held_with(ranks: tuple[int, ...] | set[int], topo: Topology) -> set[int]:
    """The ranks a stall of one of ``ranks`` holds up with it: those of its
    tensor-parallel group, and its pipeline neighbours (they wait for its activations or
    gradients, then arrive last at their own group's collectives)."""
    mine = set(ranks)
    out: set[int] = set()
    for info in topo.comms.values():
        if info.role in (CommRole.TP, CommRole.PP) and not mine.isdisjoint(info.ranks):
            out.update(info.ranks)
    return out


def one_culprit(a: Incident | None, b: Incident) -> bool:
    """Whether ``a`` names what ``b`` does: the same culprit, or one host (it and one of
    its ranks, or two of its ranks: a starved host's ranks take turns to come last)."""
    if a is None or a.culprit == b.culprit:
        return True
    return {a.culprit.kind, b.culprit.kind} <= {"node", "rank"} and a.node == b.node is not None


__all__ = ["episode", "held_with", "one_culprit"]
