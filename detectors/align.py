"""Gather every member's record of each collective instance of one communicator.

An instance is ``(comm_hash, seq)`` for collectives and ``(comm_hash, sender,
receiver, seq)`` for point-to-point transfers (the n-th Send from A to B meets
the n-th Recv at B from A; a communicator may carry transfers between more
than two ranks, as a pipeline group does with batched sends).
:meth:`CollectiveAligner.update` returns the instances that became complete
(every member arrived and finished); :meth:`expire` returns partial instances
that have been open longer than a timeout derived from the
communicator's recent completion times, naming who is missing and who joined
but did not finish. An instance whose missing members all went on to later
calls of the same stream is not a hang: sequence numbers run in order, so they
joined it and their records of it were lost on the way (a source's buffer that
overflowed); it is counted in :attr:`~CollectiveAligner.lost` and evicted, not
reported. Completed instances are evicted at once, so state stays bounded by
what is genuinely in flight.

>>> from schemas.records import Collective
>>> from schemas.enums import CollOp, DType
>>> al = CollectiveAligner()
>>> def rec(rank, a, e):
...     return Collective(job="j", node="n", rank=rank, comm_hash=9, comm_size=2,
...         rank_in_comm=rank, op=CollOp.ALL_REDUCE, seq=0, count=1, size_bytes=2,
...         dtype=DType.BFLOAT16, enqueue_ns=a, start_ns=a, end_ns=e)
>>> al.update(rec(0, 100, 500))
[]
>>> (inst,) = al.update(rec(1, 300, 500))
>>> inst.last_rank, inst.wait_ns(0), inst.transfer_ns
(1, 200, 200)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from types import ModuleType
from typing import NamedTuple

from schemas.enums import CollOp
from schemas.records import Collective

Key = tuple[int, int, int, int]  # (comm_hash, sender, receiver, seq); -1, -1 for collectives
_SEND, _RECV = CollOp.SEND, CollOp.RECV


class Instance(NamedTuple):
    """One collective instance with its members' arrivals (ns; end -1 = not finished).

    A named tuple: one is built per collective instance, so construction must be cheap.
    """

    job: str
    comm_hash: int
    seq: int
    op: CollOp
    sender: int
    comm_size: int
    size_bytes: int
    ranks: tuple[int, ...]
    enqueue: tuple[int, ...]
    arrival: tuple[int, ...]
    end: tuple[int, ...]
    #: the receiving rank of a transfer on a communicator of more than two ranks (on a
    #: pair's, the sender implies it); -1 otherwise
    receiver: int = -1

    @property
    def key(self) -> Key:
        """What identifies the instance in its job: (comm, sender, receiver, seq)."""
        return (self.comm_hash, self.sender, self.receiver, self.seq)

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.comm_size and min(self.end) >= 0

    @property
    def first_arrival_ns(self) -> int:
        return min(self.arrival)

    @property
    def last_arrival_ns(self) -> int:
        return max(self.arrival)

    @property
    def last_rank(self) -> int:
        return self.ranks[self.arrival.index(max(self.arrival))]

    @property
    def end_ns(self) -> int | None:
        return max(self.end) if self.complete else None

    @property
    def transfer_ns(self) -> int | None:
        """Pure transfer time: end after the last member arrived."""
        end = self.end_ns
        return None if end is None else max(0, end - self.last_arrival_ns)

    def wait_ns(self, rank: int) -> int:
        """How long ``rank`` waited for the last member: max_j a_j - a_r."""
        return self.last_arrival_ns - self.arrival[self.ranks.index(rank)]

    def unfinished(self) -> list[int]:
        return [r for r, e in zip(self.ranks, self.end, strict=True) if e < 0]


class Passed(NamedTuple):
    """An instance reported partial whose missing members went past it since: its records
    were lost on the way, it is no hang's evidence any more."""

    job: str
    key: Key


class OpenTimes(NamedTuple):
    """How long a communicator's completed calls stayed open at most, from the first
    member's arrival to the last end (its first calls, which absorb the start's own
    waits, left out), told at the end of a recording: the yardstick of a call it ended in
    (:meth:`~detectors.hang_pace.HangPace.outwaited`)."""

    job: str
    comm_hash: int
    longest_ns: int


@dataclass(slots=True)
class _Open:
    first_seen_ns: int
    members: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # rank -> (enq, a, e)
    op: CollOp = CollOp.ALL_REDUCE
    comm_size: int = 0
    size_bytes: int = 0
    job: str = ""
    reported: bool = False
    finished: int = 0  # members whose end is known


class CollectiveAligner:
    """Per-communicator alignment state (one instance of this class per key in the flow).

    Parameters
    ----------
    min_timeout_ns
        Lower bound of the time an instance may stay open before it is reported partial.
    timeout_factor
        The timeout is ``timeout_factor`` x the recent median time from an instance's
        first arrival to its completion, and at least ``min_timeout_ns``.
    max_open
        Hard bound on open instances; the oldest is dropped (and counted) beyond it.
    """

    lost = 0  # what a snapshot taken before this count existed resumes with

    def __init__(
        self, min_timeout_ns: int = 500_000_000, timeout_factor: float = 20.0, max_open: int = 4096
    ) -> None:
        if min_timeout_ns <= 0 or timeout_factor <= 0 or max_open <= 0:
            raise ValueError("min_timeout_ns, timeout_factor and max_open must be positive")
        self.min_timeout_ns = min_timeout_ns
        self.timeout_factor = timeout_factor
        self.max_open = max_open
        self._reset()

    def _reset(self) -> None:
        self._open: dict[Key, _Open] = {}  # in arrival order (a snapshot of an older
        # version holds an OrderedDict: both work)
        self._done: OrderedDict[Key, None] = OrderedDict()  # recently completed, for late dupes
        self._recent: list[int] = []
        self.late = 0
        self.dropped = 0
        self.lost = 0  # instances whose missing members went past them (records lost)
        self.out_of_order = 0
        self._last_seq: dict[tuple[int, int], int] = {}

    def timeout_ns(self) -> int:
        if not self._recent:
            return self.min_timeout_ns
        med = sorted(self._recent)[len(self._recent) // 2]
        return max(self.min_timeout_ns, int(self.timeout_factor * med))

    def update(self, rec: Collective) -> list[Instance]:
        """Add one member's record; return the instance if it just became complete."""
        return self.update_many([rec])

    def update_many(self, records: list[Collective]) -> list[Instance]:
        """:meth:`update` over a batch: the instances completed by it, in completion order.

        The compiled core (``detectors/_align.c``) does this when it was built; it does
        what :meth:`_add` does, on the same state."""
        if _native is not None:
            return _native.add_many(self, records if type(records) is list else list(records))
        add = self._add
        return [inst for rec in records if (inst := add(rec)) is not None]

    def _add(self, rec: Collective) -> Instance | None:
        # the reference of the compiled core's add(), which a differential test holds equal
        # to it: change both together
        op = rec.op
        peer = rec.peer if rec.peer is not None else -2
        if op is _SEND:
            sender, receiver = rec.rank, peer
        elif op is _RECV:
            sender, receiver = peer, rec.rank
        else:
            sender = receiver = -1
        if rec.comm_size <= 2:  # a pair's communicator: the sender implies the receiver (a
            receiver = -1  # Send that names no peer still meets its Recv)
        seq = rec.seq
        key = (rec.comm_hash, sender, receiver, seq)
        if key in self._done:
            self.late += 1
            return None
        stream = (rec.rank, sender, receiver)
        last_seq = self._last_seq
        prev = last_seq.get(stream)
        if prev is None or seq > prev:
            last_seq[stream] = seq
        elif seq < prev:
            self.out_of_order += 1
        arrival = rec.start_ns
        if arrival is None:
            arrival = rec.enqueue_ns
        entry = self._open.get(key)
        if entry is None:
            entry = _Open(
                first_seen_ns=arrival,
                op=op if sender == -1 else _SEND,
                comm_size=rec.comm_size if sender == -1 else 2,
                size_bytes=rec.size_bytes,
                job=rec.job,
            )
            self._open[key] = entry
            if len(self._open) > self.max_open:
                del self._open[next(iter(self._open))]  # the oldest
                self.dropped += 1
        end = rec.end_ns
        if end is None:
            end = -1
        members = entry.members
        before = members.get(rec.rank)
        if before is not None and before[2] >= 0:
            entry.finished -= 1
        members[rec.rank] = (rec.enqueue_ns, arrival, end)
        if end >= 0:
            entry.finished += 1
        entry.reported = False  # changed: a partial report may be due again
        size = entry.comm_size
        if entry.finished < size or len(members) < size:
            return None
        inst = self._instance(key, entry)
        del self._open[key]
        self._done[key] = None
        if len(self._done) > 4 * self.max_open:
            self._done.popitem(last=False)
        self._recent.append(max(inst.end) - min(inst.arrival))
        if len(self._recent) > 64:
            del self._recent[:32]
        return inst

    def expire(self, now_ns: int) -> list[Instance]:
        """Partial instances open longer than the timeout (each reported once until it
        changes); those whose missing members went past them are evicted and counted
        in :attr:`lost` instead (see the module docstring)."""
        # asked every tick: the timeout (a median of recent durations) is worked out only
        # for instances older than its least value
        least = self.min_timeout_ns
        old = [(key, entry) for key, entry in self._open.items()
               if not entry.reported and now_ns - entry.first_seen_ns > least]  # fmt: skip
        if not old:
            return []
        limit = self.timeout_ns()
        due = [(key, entry) for key, entry in old if now_ns - entry.first_seen_ns > limit]
        if not due:
            return []
        gone = {key for key, _ in self._evict_passed(due)}
        out = []
        for key, entry in due:
            if key not in gone:
                entry.reported = True
                out.append(self._instance(key, entry))
        return out

    def passed(self) -> list[Instance]:
        """Instances reported partial whose missing members have since gone past them:
        evicted and counted in :attr:`lost` (their records were lost, they hold nobody).
        Worth asking only after new records came."""
        reported = [(key, entry) for key, entry in self._open.items() if entry.reported]
        return [self._instance(key, entry) for key, entry in self._evict_passed(reported)]

    def _evict_passed(self, entries: list[tuple[Key, _Open]]) -> list[tuple[Key, _Open]]:
        """Of ``entries``, those whose missing members went past them: evicted, counted."""
        if not entries:
            return []
        tops = self._tops()
        gone = [(key, entry) for key, entry in entries if self._went_past(key, entry, tops)]
        for key, _ in gone:
            del self._open[key]
        self.lost += len(gone)
        return gone

    def _tops(self) -> dict[tuple[int, int], int]:
        """The newest sequence number of each stream direction, over its ranks."""
        tops: dict[tuple[int, int], int] = {}
        for (_, s, r), last in self._last_seq.items():
            if last > tops.get((s, r), -1):
                tops[(s, r)] = last
        return tops

    def _went_past(self, key: Key, entry: _Open, tops: dict[tuple[int, int], int]) -> bool:
        """Whether every member missing from the instance ``key`` has posted a later call
        of its stream (the same communicator, and for a transfer the same direction)."""
        missing = entry.comm_size - len(entry.members)
        _, sender, receiver, seq = key
        if missing <= 0 or tops.get((sender, receiver), -1) <= seq:
            return False  # everyone joined (a call still running is no loss), or nobody
        members = entry.members  # went past it
        past = 0
        for (rank, s, r), last in self._last_seq.items():
            if last > seq and s == sender and r == receiver and rank not in members:
                past += 1
        return past >= missing

    def open_instances(self) -> list[Instance]:
        """The instances open now, but those whose missing members went past them."""
        tops = self._tops()
        return [
            self._instance(k, e) for k, e in self._open.items() if not self._went_past(k, e, tops)
        ]

    @staticmethod
    def _instance(key: Key, entry: _Open) -> Instance:
        m = entry.members
        ranks = sorted(m)
        enqueue, arrival, end = zip(*[m[r] for r in ranks], strict=True)
        comm, sender, receiver, seq = key
        return Instance(
            entry.job,
            comm,
            seq,
            entry.op,
            sender,
            entry.comm_size,
            entry.size_bytes,
            tuple(ranks),
            enqueue,
            arrival,
            end,
            receiver,
        )

    @property
    def n_open(self) -> int:
        return len(self._open)


def _core() -> ModuleType | None:
    """The compiled core, configured; None where it was not built (no C compiler at
    install time: the Python code above does the same, slower)."""
    try:
        from detectors import _align
    except ImportError:
        return None
    _align.configure(Collective, _Open, Instance, _SEND, _RECV)
    return _align


_native = _core()


def core_name() -> str:
    """Which core aligns (what a benchmark's numbers were measured with)."""
    if _native is not None:
        return "compiled (detectors/_align.c)"
    return "Python (the compiled core was not built: no C compiler at install)"
