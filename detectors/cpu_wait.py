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
CPU the quota held back, so a busy rank on several CPUs can pass 1): below that the
quota cost less than the least slowdown worth a verdict. A quota that held ranks back
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
#: how far back the share before the shift is taken
BEFORE_NS = 5 * 10**9
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


class CpuWaits:
    """Per rank, its heartbeats' run-queue wait and throttled counters over time (pure;
    bounded: the last ``keep`` of each rank's, half a minute at two heartbeats a second;
    an older shift start is taken from the oldest kept).

    Kept as one row per rank, a ring of ``keep`` columns each (a heartbeat writes three
    numbers in place; thousands of ranks beat every step), read in time order only when
    a shift's shares are asked for: a few array operations, not a loop over ranks."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self.ts = np.zeros((0, keep), dtype=np.int64)  # ns
        self.waits = np.zeros((0, keep), dtype=np.int64)
        self.throttled = np.zeros((0, keep), dtype=np.int64)
        self.count: list[int] = []  # each row's samples
        self.head: list[int] = []  # each row's next column to write (its oldest, once full)
        # each row's newest time and throttled counter, read by every heartbeat: as plain
        # numbers, not from the arrays (an element read there costs what a write does)
        self.last_ts: list[int] = []
        self.last_throttled: list[int] = []

    def __getstate__(self) -> dict[str, object]:
        caches = ("_ordered", "_intervals")
        return {k: v for k, v in self.__dict__.items() if k not in caches}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        # pickled before: rows newest last (a ring whose next column is 0), no throttled
        if "throttled" not in state:
            self.throttled = np.zeros_like(self.waits)
        self.count = [int(n) for n in self.count]
        if "head" not in state:
            self.head = [0] * len(self.count)
        if "last_ts" not in state:
            newest = [(h or self.keep) - 1 for h in self.head]
            self.last_ts = [int(self.ts[r, c]) for r, c in enumerate(newest)]
            self.last_throttled = [int(self.throttled[r, c]) for r, c in enumerate(newest)]

    @property
    def empty(self) -> bool:
        return not any(self.count)

    def update(self, rank: int, ts_ns: int, wait_ns: int, throttled_ns: int | None = None) -> None:
        """A heartbeat's counters. One without the throttled counter (not readable this
        time) keeps the rank's last: a gap is not a quota that held it back."""
        if rank >= len(self.count):  # room for this rank (doubling: ranks come in any order)
            grow = max(rank + 1, 2 * len(self.count)) - len(self.count)
            pad = np.zeros((grow, self.keep), dtype=np.int64)
            self.ts = np.vstack([self.ts, pad])
            self.waits = np.vstack([self.waits, pad])
            self.throttled = np.vstack([self.throttled, pad])
            for row in (self.count, self.head, self.last_ts, self.last_throttled):
                row += [0] * grow
        n = self.count[rank]
        if n and ts_ns <= self.last_ts[rank]:
            return
        if throttled_ns is None:
            throttled_ns = self.last_throttled[rank]  # 0 before its first
        col = self.head[rank]
        self.ts[rank, col] = ts_ns
        self.waits[rank, col] = wait_ns
        self.throttled[rank, col] = throttled_ns
        self.last_ts[rank] = ts_ns
        self.last_throttled[rank] = throttled_ns
        self.head[rank] = col + 1 if col + 1 < self.keep else 0
        if n < self.keep:
            self.count[rank] = n + 1

    def _in_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rings (times, waits, throttled) oldest to newest, the newest in the last
        column; kept until the next heartbeat (a shift's shares ask several times)."""
        key = (tuple(self.head), tuple(self.count))
        if getattr(self, "_ordered", (None,))[0] != key:
            order = (np.asarray(self.head)[:, None] + np.arange(self.keep)) % self.keep
            rings = (self.ts, self.waits, self.throttled)
            self._ordered = (key, tuple(np.take_along_axis(x, order, axis=1) for x in rings))
        return self._ordered[1]

    def rates(self, start_ns: int, end_ns: int, throttled: bool = False) -> np.ndarray:
        """Every rank's seconds waited (or ``throttled``) per second from its sample
        nearest ``start_ns`` to its last one at or before ``end_ns`` (NaN: no such
        interval). A thread that ended takes its counts with it, and a process moved to
        another cgroup takes up that group's, so a counter that went down adds nothing."""
        ts, waits, held = self._in_order()
        counter = held if throttled else waits
        cols = np.arange(self.keep)
        kept = cols >= (self.keep - np.asarray(self.count, dtype=np.int64))[:, None]
        a = np.argmin(np.where(kept, np.abs(ts - start_ns), np.iinfo(np.int64).max), axis=1)
        upto = kept & (ts <= end_ns)
        b = self.keep - 1 - np.argmax(upto[:, ::-1], axis=1)
        ok = upto.any(axis=1) & (b > a)
        grew = np.where(kept[:, 1:], np.clip(np.diff(counter, axis=1), 0, None), 0)
        waited = np.concatenate([np.zeros((len(b), 1)), np.cumsum(grew, axis=1)], axis=1)
        rows = np.arange(len(b))
        span = (ts[rows, b] - ts[rows, a]).astype(float)
        done = waited[rows, b] - waited[rows, a]
        return np.where(ok, done / np.where(ok, span, 1.0), np.nan)

    def held_through(self, start_ns: int, end_ns: int, q: float = 0.5) -> np.ndarray:
        """Every rank's throttled share over most of the time from ``start_ns`` to
        ``end_ns``: the lower median of its shares between consecutive heartbeats that
        end in it (at least half of them, and more than half of an even number, reach
        it; NaN: none). A quota that held a rank back for a step or two shows in one or
        two such intervals, one that holds it back still in most of them. (``q``: that
        quantile of them instead of the median.)"""
        ends, span, grew, ok = self._held_intervals()
        pair = ok & (ends > start_ns) & (ends <= end_ns)
        out = np.where(pair.any(axis=1), 0.0, np.nan)
        held_back = np.flatnonzero((pair & (grew > 0)).any(axis=1))  # the few a quota held
        if len(held_back):
            p, g, d = pair[held_back], grew[held_back], span[held_back]
            rate = np.where(p, g / np.where(p, d, 1), np.nan)
            out[held_back] = np.nanquantile(rate, q, axis=1, method="lower")
        return out

    def _held_intervals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Between each rank's consecutive heartbeats kept: when the interval ended, how
        long it was, how long the rank was throttled in it, and whether it is one (both
        heartbeats kept, time moved); kept with the rings' order (a shift's shares and a
        step's quota ask several times between two heartbeats)."""
        ts, _, held = self._in_order()
        cached = getattr(self, "_intervals", None)
        if cached is None or cached[0] is not ts:
            kept = np.arange(self.keep) >= (self.keep - np.asarray(self.count))[:, None]
            span = np.diff(ts, axis=1)
            ok = kept[:, 1:] & kept[:, :-1] & (span > 0)
            grew = np.clip(np.diff(held, axis=1), 0, None)
            self._intervals = (ts, (ts[:, 1:], span, grew, ok))
            cached = self._intervals
        return cached[1]

    def beats(self, ranks: Sequence[int], start_ns: int, end_ns: int) -> int:
        """The fewest heartbeats kept of any of ``ranks`` from ``start_ns`` to ``end_ns``
        (their shares over that span are as fine as these are many)."""
        if not ranks or max(ranks) >= len(self.count):
            return 0
        ts = self.ts[list(ranks)]
        return int(((ts >= start_ns) & (ts <= end_ns) & (ts > 0)).sum(axis=1).min())

    def share(self, rank: int, start_ns: int, end_ns: int) -> float | None:
        """Rank ``rank``'s :meth:`rates` (None: no interval)."""
        x = self.rates(start_ns, end_ns)[rank] if rank < len(self.count) else np.nan
        return None if np.isnan(x) else float(x)

    def shares(
        self, start_ns: int, end_ns: int, throttled: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's wait (or ``throttled``) share from ``start_ns`` to ``end_ns``, and
        before it (over :data:`BEFORE_NS`); NaN where unknown. Ranks are 0..the highest
        seen."""
        n = int(np.flatnonzero(self.count).max()) + 1 if not self.empty else 0  # ranks heard
        after = self.rates(start_ns, end_ns, throttled)[:n]
        return after, self.rates(start_ns - BEFORE_NS, start_ns, throttled)[:n]


def _held_before(cpu: CpuWaits, start_ns: int, n: int) -> np.ndarray:
    """Ranks 0..n-1's own throttled share before ``start_ns``: over the seconds before
    it, or in their quieter times where those were held back already (a quota that
    began a few steps before a shift did)."""
    before = cpu.rates(start_ns - BEFORE_NS, start_ns, throttled=True)[:n]
    return np.fmin(before, cpu.held_through(0, start_ns, QUIET)[:n])


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
    cpu: CpuWaits, start_ns: int, end_ns: int, nodes: Sequence[str], apart: float = APART
) -> tuple[CpuStarved, ...]:
    """The ranks starved of CPU from ``start_ns`` to ``end_ns`` (``nodes[r]``: rank r's
    node), most starved first: those whose wait share stands ``apart`` or more above the
    job's usual one (the median of its lower half: at most half the job is starved), and
    grew by ``apart`` or more over their own before (where that is known); or whose
    throttled share does so by :data:`THROTTLED_APART`. Every rank of one node (two or
    more) is that host; otherwise a quarter of the job at most, each a rank of its own,
    once its node-mates' shares are known. Nothing where a share is missing for half the
    job or more."""
    after, before = cpu.shares(start_ns, end_ns)
    n = len(nodes)
    if len(after) < n or n < 2:
        return ()
    s, b = np.array(after[:n]), np.array(before[:n])
    known = np.flatnonzero(~np.isnan(s))
    if len(known) * 2 <= n:
        return ()
    waiting, usual = _standing(s, b, known, apart)
    t = np.array(cpu.rates(start_ns, end_ns, throttled=True)[:n])
    t_before = _held_before(cpu, start_ns, n)
    # a quota already holding a rank back varies with what it runs: it began at the
    # shift only where it at least doubled
    held, usual_t = _standing(t, t_before, known, THROTTLED_APART, doubled=True)
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
    held, _ = _standing(now, _held_before(cpu, start_ns, n), known, THROTTLED_APART, doubled=True)
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
    cpu: CpuWaits, reps: Sequence[StepReport], topo: Topology, start_ns: int | None = None
) -> list[SlowdownFinding]:
    """The hosts and ranks starved of CPU over ``reps`` (a shift's steps so far; from
    ``start_ns`` where given, its onset), as localised causes of the step time added."""
    if not reps or cpu.empty:
        return []
    nodes = [topo.node(r) for r in range(topo.job.world_size)]
    out = []
    start = reps[0].start_ns if start_ns is None else start_ns
    found = starved(cpu, start, reps[-1].end_ns, nodes)
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
