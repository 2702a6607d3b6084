"""Each rank's CPU counters over time, as its heartbeats carry them.

A heartbeat may carry how long the rank's threads waited for a CPU (``cpu_wait_ns``)
and how long its cgroups were throttled by their quota (``cpu_throttled_ns``).
:class:`CpuWaits` keeps the last of them per rank and reads their rates over a span
of time; :mod:`detectors.cpu_wait` judges from those rates which ranks or hosts
were starved of CPU.

>>> cpu = CpuWaits()
>>> for t in range(5):  # 2 ranks, a heartbeat a second; rank 1 throttled 0.2 s from t=3
...     for r in range(2):
...         cpu.update(r, t * 10**9, int(0.1e9 * t), int(0.2e9) if r == 1 and t >= 3 else 0)
>>> cpu.rates(0, 4 * 10**9).round(2).tolist()  # waited, a second a second
[0.1, 0.1]
>>> cpu.covering(2_500_000_000, 2_600_000_000, throttled=True).tolist()  # 2.5-2.6 s
[0.0, 0.2]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: how far back the share before a shift is taken
BEFORE_NS = 5 * 10**9


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
        ts, kept, total = self._totals(throttled)
        a = np.argmin(np.where(kept, np.abs(ts - start_ns), np.iinfo(np.int64).max), axis=1)
        upto = kept & (ts <= end_ns)
        b = self.keep - 1 - np.argmax(upto[:, ::-1], axis=1)
        return _rate(ts, total, a, b, upto.any(axis=1) & (b > a))

    def covering(self, start_ns: int, end_ns: int, throttled: bool = False) -> np.ndarray:
        """Every rank's wait (or ``throttled``) share over the heartbeat intervals that
        cover ``start_ns`` to ``end_ns``: from its last heartbeat at or before the start to
        its first at or after the end (NaN: either not kept, or not come yet). A burst of
        a step or two is shorter than a heartbeat interval: :meth:`rates` over it, from
        the heartbeat nearest its start to the last before its end, has none."""
        ts, kept, total = self._totals(throttled)
        before, after = kept & (ts <= start_ns), kept & (ts >= end_ns)
        a = self.keep - 1 - np.argmax(before[:, ::-1], axis=1)
        b = np.argmax(after, axis=1)
        return _rate(ts, total, a, b, before.any(axis=1) & after.any(axis=1) & (b > a))

    def _totals(self, throttled: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rings' times oldest to newest, which columns are kept samples, and each
        rank's counter (waits, or ``throttled``) summed up to each column, what went down
        counted as nothing."""
        ts, waits, held = self._in_order()
        counter = held if throttled else waits
        kept = np.arange(self.keep) >= (self.keep - np.asarray(self.count, dtype=np.int64))[:, None]
        grew = np.where(kept[:, 1:], np.clip(np.diff(counter, axis=1), 0, None), 0)
        total = np.concatenate([np.zeros((len(ts), 1)), np.cumsum(grew, axis=1)], axis=1)
        return ts, kept, total

    def covered(self, end_ns: int) -> bool:
        """Whether every rank heard from has a heartbeat at or after ``end_ns`` (what it
        did up to then is counted)."""
        heard = [t for t, n in zip(self.last_ts, self.count, strict=True) if n]
        return bool(heard) and min(heard) >= end_ns

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

    def throttled_in(self, start_ns: int, end_ns: int) -> np.ndarray:
        """Every rank's time throttled (ns) between consecutive heartbeats of its that both
        lie from ``start_ns`` to ``end_ns`` (NaN: no such interval). A quota lifted at
        ``start_ns`` throttles nothing in them; one that holds on, however lightly (just
        under what the rank uses), throttles it in most.

        >>> cpu = CpuWaits()
        >>> for t in range(8):  # rank 1 throttled 0.2 s in its second 4 only
        ...     for r in range(2):
        ...         cpu.update(r, t * 10**9, 0, int(0.2e9) if r == 1 and t >= 4 else 0)
        >>> cpu.throttled_in(4 * 10**9, 7 * 10**9), cpu.throttled_in(3 * 10**9, 7 * 10**9)
        (array([0., 0.]), array([0.e+00, 2.e+08]))
        """
        ends, span, grew, ok = self._held_intervals()
        pair = ok & (ends - span >= start_ns) & (ends <= end_ns)
        return np.where(pair.any(axis=1), np.where(pair, grew, 0).sum(axis=1), np.nan)

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
        self, start_ns: int, end_ns: int, throttled: bool = False, burst: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's wait (or ``throttled``) share from ``start_ns`` to ``end_ns`` (for
        a ``burst``, over the heartbeat intervals that cover it: :meth:`covering`), and
        before it (over :data:`BEFORE_NS`); NaN where unknown. Ranks are 0..the highest
        seen."""
        n = int(np.flatnonzero(self.count).max()) + 1 if not self.empty else 0  # ranks heard
        read = self.covering if burst else self.rates
        after = read(start_ns, end_ns, throttled)[:n]
        return after, self.rates(start_ns - BEFORE_NS, start_ns, throttled)[:n]


def _rate(
    ts: np.ndarray, total: np.ndarray, a: np.ndarray, b: np.ndarray, ok: np.ndarray
) -> np.ndarray:
    """Each row's counter grown from column ``a`` to ``b`` per unit of time (NaN where not
    ``ok``)."""
    rows = np.arange(len(a))
    span = (ts[rows, b] - ts[rows, a]).astype(float)
    ok = ok & (span > 0)
    return np.where(ok, (total[rows, b] - total[rows, a]) / np.where(ok, span, 1.0), np.nan)


__all__ = ["BEFORE_NS", "CpuWaits"]
