"""Ranks starved of CPU, from the run-queue wait their heartbeats carry.

A rank's heartbeats may carry its process's CPU counters
(:class:`~schemas.records.Heartbeat` ``cpu_wait_ns``: the time its threads were
ready to run but waited for a CPU). Their rate, seconds waited per second, is its
*wait share*. When a step-time shift is localised, the ranks whose share stands
apart from the rest of the job's, and grew over their own from before the shift,
are starved of CPU: a host oversubscribed, a container's quota spent. That is the
cause wherever it holds, whatever the collectives look like: a starved rank does
its part late, and where its collectives run on the CPU (Gloo) it moves their
data slowly too, which from the collectives' timings alone looks like a slow
network.

Heartbeats may also carry the kernel's account of the rank's CPU quota
(``cpu_throttled_ns``: how long its cgroups were throttled). Its rate, the
*throttled share*, names a rank held back by its container's limit where the wait
share cannot: a rank that mostly sleeps in its transfers behind a slow link waits
little for a CPU, yet its quota holds back what it does compute. It stands apart
from a tenth of a second a second (:data:`THROTTLED_APART`; the kernel counts each
CPU the quota held back, so a busy rank on several CPUs can pass 1), limits that every
rank meets now and then varying by a few points of the time; from half that where no
other rank of the job is throttled at all (:data:`OWN_QUOTA_APART`: the count is exact,
and the quota is the rank's own). A quota's stalls cost more than the time they hold
the rank back where its collectives stop whole with it (a tensor-parallel all-reduce,
and TCP waiting out its backoff): a rank held just under what it uses, throttled 0.03-0.08
s a second, made a Megatron job's steps 1.3-1.4x as long. A quota that held ranks back
through most of the time a shift must last (:func:`quota_holds`) is a cause seen beside
a slower step, as a rank that holds the others up is: the change-point detector judges
the step against its least shift, not against the job's noise (a rank a little slower
than its peers, in a job whose steps vary by more than it adds, is found so). A rank's
own throttled share before is that of the seconds before, or of its quieter times where
those were held back already.

>>> cpu = CpuWaits()
>>> for t in range(9):  # 4 ranks, a heartbeat a second; rank 1 starved from t=5 s
...     for r in range(4):
...         waited = 0.3 * t if (r != 1 or t <= 5) else 1.5 + 1.8 * (t - 5)
...         cpu.update(r, t * 10**9, int(waited * 1e9))
>>> cpu.shares(5 * 10**9, 8 * 10**9)[0].round(1).tolist()
[0.3, 1.8, 0.3, 0.3]
>>> starved(cpu, 5 * 10**9, 8 * 10**9, ["n0", "n0", "n1", "n1"])
(CpuStarved(ranks=(1,), node=None, share=1.8, usual=0.3, throttled=None, usual_throttled=None),)

Rank 3 mostly asleep in its transfers, its quota holding it back 0.3 s a second from
t=5 s (its wait share like the others'):

>>> cpu = CpuWaits()
>>> for t in range(9):
...     for r in range(4):
...         held = 0.3 * max(0, t - 5) if r == 3 else 0.0
...         cpu.update(r, t * 10**9, int(0.05 * t * 1e9), int(held * 1e9))
>>> (got,) = starved(cpu, 5 * 10**9, 8 * 10**9, ["n0", "n0", "n1", "n1"])
>>> got.ranks, got.share, got.throttled
((3,), 0.05, 0.3)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from detectors.cpu_counters import BEFORE_NS, CpuWaits
from detectors.steps import StepReport
from detectors.topology import Topology
from detectors.who_waits import SlowdownFinding
from schemas.enums import Cause

#: seconds waited per second by which starved ranks stand apart from the others, and
#: by which each grew over its own share before the shift
APART = 0.5
#: seconds throttled per second by which ranks held back by their CPU quota stand apart
#: from the others, and by which each grew over its own before
THROTTLED_APART = 0.1
#: the same where no other rank of the job is throttled at all (a quota of its own)
OWN_QUOTA_APART = 0.05
#: ranks kept from a CPU wait at least this share of their wait before
STILL = 0.9
#: a rank's quieter times: this quantile of its throttled shares between heartbeats
QUIET = 0.25


@dataclass(frozen=True)
class CpuStarved:
    """Ranks starved of CPU together: one rank, or every rank of ``node`` (its host)."""

    ranks: tuple[int, ...]
    node: str | None
    share: float  # their least wait share since the shift (s/s)
    usual: float  # the job's usual wait share then (the median of its lower half, s/s)
    throttled: float | None = None  # their least throttled share, where a quota held them
    usual_throttled: float | None = None  # the job's usual throttled share then


def _held_before(cpu: CpuWaits, start_ns: int, n: int) -> np.ndarray:
    """Ranks 0..n-1's own throttled share before ``start_ns``: over the seconds before
    it, or in their quieter times where those were held back already (a quota that
    began a few steps before a shift did)."""
    before = cpu.rates(start_ns - BEFORE_NS, start_ns, throttled=True)[:n]
    return np.fmin(before, cpu.held_through(0, start_ns, QUIET)[:n])


def _quota_apart(t: np.ndarray, before: np.ndarray) -> float:
    """How far a rank's throttled share ``t`` must stand apart: :data:`OWN_QUOTA_APART`
    where at most one rank of the job was throttled at all, now or before (the kernel's
    count is exact, and nobody else's limit is met: a quota of its own), else
    :data:`THROTTLED_APART` (limits that every rank meets now and then vary by a few
    points of the time)."""
    some = (np.nan_to_num(t) > 0) | (np.nan_to_num(before) > 0)
    return OWN_QUOTA_APART if some.sum() <= 1 else THROTTLED_APART


def _standing(
    s: np.ndarray, b: np.ndarray, known: np.ndarray, apart: float, doubled: bool = False
) -> tuple[np.ndarray, float]:
    """Each rank's share above the job's usual one (the median of its lower half: at most
    half the job stands apart), in units of ``apart`` where it also grew by ``apart``
    over its own before (where that is known; and at least ``doubled`` it), else -inf;
    and the usual share."""
    usual = float(np.median(np.sort(s[known])[: (len(known) + 1) // 2]))
    with np.errstate(invalid="ignore"):
        grew = np.isnan(b) | ((s - b >= apart) & (not doubled or s >= 2 * b))
        return np.where(grew & ~np.isnan(s), (s - usual) / apart, -np.inf), usual


def starved(
    cpu: CpuWaits,
    start_ns: int,
    end_ns: int,
    nodes: Sequence[str],
    apart: float = APART,
    burst: bool = False,
) -> tuple[CpuStarved, ...]:
    """The ranks starved of CPU from ``start_ns`` to ``end_ns`` (``nodes[r]``: rank r's
    node), most starved first: those whose wait share stands ``apart`` or more above the
    job's usual one (the median of its lower half: at most half the job is starved), and
    grew by ``apart`` or more over their own before (where that is known); or whose
    throttled share does so by :data:`THROTTLED_APART`. Every rank of one node (two or
    more) is that host; otherwise a quarter of the job at most, each a rank of its own,
    once its node-mates' shares are known. Nothing where a share is missing for half the
    job or more. A ``burst`` (a step or a few, shorter than a heartbeat interval) is read
    over the heartbeat intervals that cover it (:meth:`CpuWaits.covering`)."""
    after, before = cpu.shares(start_ns, end_ns, burst=burst)
    read = cpu.covering if burst else cpu.rates
    n = len(nodes)
    if len(after) < n or n < 2:
        return ()
    s, b = np.array(after[:n]), np.array(before[:n])
    known = np.flatnonzero(~np.isnan(s))
    if len(known) * 2 <= n:
        return ()
    waiting, usual = _standing(s, b, known, apart)
    t = np.array(read(start_ns, end_ns, throttled=True)[:n])
    t_before = _held_before(cpu, start_ns, n)
    # a quota already holding a rank back varies with what it runs: it began at the
    # shift only where it at least doubled
    held, usual_t = _standing(t, t_before, known, _quota_apart(t, t_before), doubled=True)
    score = np.maximum(waiting, held)
    top = [int(r) for r in known[np.argsort(-score[known], kind="stable")] if score[r] >= 1]
    if not top:
        return ()

    def found(ranks: list[int], node: str | None) -> CpuStarved:
        quota = any(held[r] >= 1 for r in ranks)
        return CpuStarved(
            tuple(ranks), node, round(float(s[ranks].min()), 3), round(usual, 3),
            round(float(t[ranks].min()), 3) if quota else None,
            round(usual_t, 3) if quota else None,
        )  # fmt: skip

    on = {nodes[r] for r in top}
    if len(on) == 1 and len(top) >= 2:
        (node,) = on
        if sorted(top) == [r for r in range(n) if nodes[r] == node]:
            return (found(top, node),)
    if len(top) > max(1, n // 4):
        return ()
    # a rank whose node-mates' shares are unknown may be its host: their heartbeats come
    # late when their host starves them too
    top = [r for r in top if not any(np.isnan(s[q]) for q in range(n) if nodes[q] == nodes[r])]
    return tuple(found([r], None) for r in top)


def quota_holds(cpu: CpuWaits, start_ns: int, end_ns: int) -> bool:
    """Whether a CPU quota has held ranks back from ``start_ns`` to ``end_ns`` (through
    most of its heartbeat intervals: :meth:`CpuWaits.held_through`), standing apart from
    the job's usual share by :data:`THROTTLED_APART` and at least doubled over their own
    before, as :func:`starved` tells a quota's ranks.

    >>> cpu = CpuWaits()
    >>> for t in range(12):  # 4 ranks, a heartbeat a second; rank 2 held from t=6 s
    ...     for r in range(4):
    ...         cpu.update(r, t * 10**9, 0, int(0.3e9 * max(0, t - 6)) if r == 2 else 0)
    >>> quota_holds(cpu, 8 * 10**9, 11 * 10**9), quota_holds(cpu, 2 * 10**9, 5 * 10**9)
    (True, False)

    Held back for one second of three (a transient quota), it did not hold through them:

    >>> cpu = CpuWaits()
    >>> for t in range(12):
    ...     for r in range(4):
    ...         cpu.update(r, t * 10**9, 0, int(0.5e9) if r == 2 and t >= 9 else 0)
    >>> quota_holds(cpu, 8 * 10**9, 11 * 10**9)
    False
    """
    if cpu.empty or not cpu.throttled.any():  # no quota ever held a rank back: the usual
        return False
    n = int(np.flatnonzero(cpu.count).max()) + 1
    now = cpu.held_through(start_ns, end_ns)[:n]
    known = np.flatnonzero(~np.isnan(now))
    if len(known) * 2 <= n:
        return False
    before = _held_before(cpu, start_ns, n)
    held, _ = _standing(now, before, known, _quota_apart(now, before), doubled=True)
    return bool((held >= 1).any())


def cpu_bound(cpu: CpuWaits, ranks: Iterable[int], start_ns: int, end_ns: int) -> bool:
    """Whether ``ranks`` were kept from a CPU from ``start_ns`` to ``end_ns``: their wait
    share (the median of theirs) :data:`APART` or more, as a starved rank's stands apart,
    and no less than before (:data:`STILL` of it at least). Ranks that wait on a slower
    network sleep in their transfers and wait for a CPU less than they did; ranks ready
    to run and not given a CPU (a host crowded by other work) do their transfers late,
    whatever the network does: their collectives' timings tell how much CPU they got.
    False where their shares are not known.

    >>> cpu = CpuWaits()
    >>> for t in range(12):  # 2 ranks, a heartbeat a second, each ready and kept waiting
    ...     for r in range(2):  # 0.7 s a second, 0.8 from t=8 s
    ...         cpu.update(r, t * 10**9, int((0.7 * t + 0.1 * max(0, t - 8)) * 1e9))
    >>> cpu_bound(cpu, [0, 1], 8 * 10**9, 11 * 10**9)
    True

    Asleep in slower transfers from t=8 s, they wait for a CPU less than they did:

    >>> cpu = CpuWaits()
    >>> for t in range(12):
    ...     for r in range(2):
    ...         cpu.update(r, t * 10**9, int((0.7 * min(t, 8) + 0.5 * max(0, t - 8)) * 1e9))
    >>> cpu_bound(cpu, [0, 1], 8 * 10**9, 11 * 10**9)
    False
    """
    if cpu.empty:
        return False
    after, before = cpu.shares(start_ns, end_ns)
    idx = [r for r in ranks if r < len(after)]
    if not idx or np.isnan(after[idx]).any() or np.isnan(before[idx]).any():
        return False
    now, usual = float(np.median(after[idx])), float(np.median(before[idx]))
    return now >= APART and now >= STILL * usual


def cpu_bound_until(
    cpu: CpuWaits | None, end_ns: int
) -> Callable[[Iterable[int], int], bool] | None:
    """:func:`cpu_bound` up to ``end_ns`` as the network rules take it (``(ranks,
    start_ns)``), or None where the job sends no heartbeats."""
    return None if cpu is None else partial(cpu_bound, cpu, end_ns=end_ns)


def findings(
    cpu: CpuWaits,
    reps: Sequence[StepReport],
    topo: Topology,
    start_ns: int | None = None,
    burst: bool = False,
) -> list[SlowdownFinding]:
    """The hosts and ranks starved of CPU over ``reps`` (a shift's steps so far; from
    ``start_ns`` where given, its onset; a ``burst``'s, see :func:`starved`), as localised
    causes of the step time added."""
    if not reps or cpu.empty:
        return []
    nodes = [topo.node(r) for r in range(topo.job.world_size)]
    out = []
    start = reps[0].start_ns if start_ns is None else start_ns
    found = starved(cpu, start, reps[-1].end_ns, nodes, burst=burst)
    # ranks starved since the same shift are its culprits together (one incident)
    ranks = [c.ranks[0] for c in found if not c.node]
    for c in found:
        ev = {"cpu_wait_share": c.share, "usual_cpu_wait_share": c.usual}
        if c.throttled is not None and c.usual_throttled is not None:
            ev.update(cpu_throttled_share=c.throttled, usual_cpu_throttled_share=c.usual_throttled)
        rank = None if c.node else c.ranks[0]
        node = c.node or nodes[c.ranks[0]]
        several = rank is not None and len(ranks) > 1
        together = (rank, *(r for r in ranks if r != rank)) if several else ()
        out.append(SlowdownFinding(Cause.HOST_CPU, rank, node, None, None, None, critical=True,
                                   evidence=ev, together=together))  # fmt: skip
    return out


__all__ = [
    "APART",
    "BEFORE_NS",
    "OWN_QUOTA_APART",
    "STILL",
    "THROTTLED_APART",
    "CpuStarved",
    "CpuWaits",
    "cpu_bound",
    "cpu_bound_until",
    "findings",
    "quota_holds",
    "starved",
]
