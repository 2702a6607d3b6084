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
>>> for t in range(0, 1000, 250):  # rank 0 beats every 250 ms, no save yet
...     saves.update(0, t * ms, 0, None)
>>> saves.update(0, 1010 * ms, 5 * ms, 1005 * ms)  # a save began at 1005 ms
>>> saves.saving(0)
1005000000
>>> saves.update(0, 1330 * ms, 320 * ms, None)  # and ended at 1325 ms
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
        self.seen: dict[int, tuple[int, int]] = {}  # rank -> (its latest heartbeat, count)
        self.spans: dict[int, deque[tuple[int, int, int]]] = {}  # (from, to, saved in it)
        self.under_way: dict[int, int] = {}  # rank -> when its save under way began

    def update(self, rank: int, ts_ns: int, save_ns: int, since_ns: int | None) -> None:
        """One heartbeat of ``rank``: its save count ``save_ns`` at ``ts_ns``, and when the
        save under way began (None: none)."""
        before = self.seen.get(rank)
        self.seen[rank] = (ts_ns, save_ns)
        if since_ns is not None:
            self.under_way[rank] = since_ns
        elif self.under_way:
            self.under_way.pop(rank, None)
        if before is None or ts_ns <= before[0]:
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
        return self.under_way.get(rank)

    def saved(self, rank: int, start_ns: int, end_ns: int) -> int:
        """How long ``rank`` saved around ``start_ns`` to ``end_ns`` (ns): the spans between
        its heartbeats that overlap it, and a save under way since its latest."""
        total = sum(n for a, b, n in self.spans.get(rank, ()) if a < end_ns and b > start_ns)
        since = self.under_way.get(rank)
        if since is not None and since < end_ns:
            latest = self.seen[rank][0]
            total += max(0, end_ns - max(start_ns, latest))
        return total


__all__ = ["Saves"]
