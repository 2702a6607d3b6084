"""Checkpoint saves per rank, from the save counters its heartbeats carry.

A rank saving a checkpoint is out of the collectives: its peers wait for it at their
next one (PyTorch's DDP tutorial and Megatron have every rank wait at a barrier while
the writers save). To the step times that is a straggler, and to a watchdog a hang.
Where a source sees the saves (:class:`~schemas.records.Heartbeat` ``save_ns``, how long
the rank spent saving so far, and ``saving_since_ns``), :class:`Saves` keeps, per rank,
the spans between heartbeats over which that count grew, and whether a save is under
way: :meth:`Saves.saved` is how long a rank saved around a window of the job's time (the
spans that overlap it, whole: a save began or ended between two heartbeats, no closer),
which the straggler judgement weighs against the time a burst lost.

>>> saves, ms = Saves(), 10**6
>>> # rank 0 beats every 250 ms; a save began at 1005 ms, its heartbeat went out at 1010
>>> saves.update(0, 1010 * ms, 5 * ms, 1005 * ms, before=(1000 * ms, 0))
>>> saves.saving(0)
1005000000
>>> saves.update(0, 1330 * ms, 320 * ms, None, before=(1010 * ms, 5 * ms))  # over at 1325
>>> saves.saving(0) is None, saves.saved(0, 1000 * ms, 1400 * ms) / ms
(True, 320.0)
>>> saves.saved(0, 1500 * ms, 1600 * ms), saves.saved(1, 1000 * ms, 1400 * ms)
(0, 0)
"""

from __future__ import annotations

from collections import deque


class Saves:
    """Checkpoint saves per rank (see the module docstring). ``keep``: the spans kept a
    rank, one a heartbeat that saw it save: a burst is judged a few steps after it, and
    a flow may have read the heartbeats seconds ahead of the steps by then (saves are
    minutes apart in training, seconds apart in the lab's)."""

    def __init__(self, keep: int = 32) -> None:
        self.keep = keep
        self.spans: dict[int, deque[tuple[int, int, int]]] = {}  # (from, to, saved in it)
        # rank -> (when its save under way began, its heartbeat that said so)
        self.under_way: dict[int, tuple[int, int]] = {}

    def update(
        self, rank: int, ts_ns: int, save_ns: int, since_ns: int | None, before: tuple[int, int]
    ) -> None:
        """A heartbeat of ``rank`` that may show it saving: its save count ``save_ns`` at
        ``ts_ns``, when the save under way began (None: none), and ``before``, the time
        and count of the rank's heartbeat before (the caller passes only those whose
        count or save under way changed: a job beats thousands of times a save)."""
        if since_ns is not None:
            self.under_way[rank] = (since_ns, ts_ns)
        elif self.under_way:
            self.under_way.pop(rank, None)
        if ts_ns <= before[0]:
            return
        # (a count that went down is a new process's, the job started again: from 0)
        grew = save_ns - before[1] if save_ns >= before[1] else save_ns
        if grew > 0:
            spans = self.spans.get(rank)
            if spans is None:
                spans = self.spans[rank] = deque(maxlen=self.keep)
            spans.append((before[0], ts_ns, grew))

    def saving(self, rank: int) -> int | None:
        """When the save ``rank``'s latest heartbeat said was under way began (None:
        none)."""
        got = self.under_way.get(rank)
        return got[0] if got is not None else None

    def saved(self, rank: int, start_ns: int, end_ns: int) -> int:
        """How long ``rank`` saved around ``start_ns`` to ``end_ns`` (ns): the spans between
        its heartbeats that overlap it, and a save under way since its latest."""
        total = sum(n for a, b, n in self.spans.get(rank, ()) if a < end_ns and b > start_ns)
        got = self.under_way.get(rank)
        if got is not None and got[0] < end_ns:
            total += max(0, end_ns - max(start_ns, got[1]))
        return total

    def most(self, start_ns: int, end_ns: int) -> int:
        """The longest any rank saved around ``start_ns`` to ``end_ns`` (:meth:`saved`; 0
        where none saved)."""
        ranks = {*self.spans, *self.under_way}
        return max((self.saved(r, start_ns, end_ns) for r in ranks), default=0)


__all__ = ["Saves"]
