"""A step's parts: what some of one step's collective instances say, per rank.

A communicator's folder (:mod:`detectors.folder`) folds its instances into one
:class:`StepPart` per step; parts of several communicators merge (per shard of
them, :mod:`detectors.merge`, then in the job's :class:`~detectors.steps.StepAssembler`),
and :func:`dense_ranks` turns a step's parts into per-rank figures: lateness in TP
collectives (the cross-rank wait-time model), exclusive blame of the last arriver,
the host's lead over the GPU, waits, first arrival and last end.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields
from operator import attrgetter, itemgetter

import numpy as np

from detectors.align import Instance
from detectors.topology import Topology
from schemas.enums import CommRole

NodeKey = tuple[int, str, int]  # (stage, phase, micro-batch) of one pipeline replica
_NEVER = 1 << 62
#: the per-rank sums a part carries, in the rows of :attr:`StepPart.sealed`
_SUMS = ("lead_sum", "lead_n", "wait", "lateness", "blame", "blame_any")
#: what a folded instance adds besides arrivals and host lead: its members' wait for the
#: last to arrive (not a pipeline transfer), the TP wait-time model (lateness, blame),
#: the last arriver's blame in any collective (who makes the others wait, in any layout)
_WAITS, _WAIT_MODEL, _ANY = 1, 2, 4


@dataclass(slots=True, eq=False)
class StepPart:
    """What some of one step's collective instances say, per rank (sparse, ns).

    The job's assembler folds instances into one part per step; a communicator's
    :class:`~detectors.folder.StepFolder` folds its own instances into a part
    that the job's assembler merges, so the per-instance work runs where the
    communicator's records are (one flow worker per communicator) and the job
    sees one item per (communicator, step). Folding and merging commute.

    A folder seals a part (:meth:`seal`) before sending it: its per-rank figures become
    one small array, which the job concatenates with thousands of others a step.
    """

    step: int
    comm_hash: int = -1  # the communicator whose instances these are, or -1 for several
    job: str = ""
    comms: tuple[int, ...] = ()  # the communicators of a part merged from several
    n: int = 0
    start: int = _NEVER
    end: int = 0
    dp_end: int = 0
    last_arrival: int = 0
    spans: dict[int, dict[NodeKey, list[int]]] = field(default_factory=dict)
    replica_end: dict[int, int] = field(default_factory=dict)
    transfer: dict[int, int] = field(default_factory=dict)
    transfer_sum: dict[int, int] = field(default_factory=dict)
    #: the per-rank figures once sealed, one column per rank (see :meth:`seal`)
    sealed: np.ndarray | None = None
    #: instances folded since, with what they add (see :meth:`fold`), until :func:`_figures`
    folded: list[tuple[Instance, int]] = field(default_factory=list, repr=False)
    #: replicas whose spans are another part's (merge_shape copies them before a change)
    _borrowed: set[int] | None = field(default=None, compare=False, repr=False)

    def fold(
        self,
        inst: Instance,
        phase: str,
        mb: int | None,
        role: CommRole,
        topo: Topology,
        extent: tuple[int, int, int] | None = None,
    ) -> None:
        """Add one complete instance placed at (phase, micro-batch) of this step.

        The step's extent, transfers and node spans are updated at once; the instance's
        per-rank figures (arrivals, host lead, waits, the TP wait-time model) are
        computed for all the part's instances together, as arrays, when they are read
        (:func:`_figures`): a part folds hundreds of instances a step. ``extent`` is the
        instance's (first arrival, last arrival, last end) where the caller has it."""
        if self.sealed is not None:
            raise ValueError(f"step {self.step}'s part was sealed: it takes no more instances")
        self.n += 1
        if extent is None:
            arr = inst.arrival
            a_min, a_max, e_max = min(arr), max(arr), max(inst.end)
        else:
            a_min, a_max, e_max = extent
        if a_min < self.start:
            self.start = a_min
        if e_max > self.end:
            self.end = e_max
        if a_max > self.last_arrival:
            self.last_arrival = a_max
        if role is CommRole.DP and e_max > self.dp_end:
            self.dp_end = e_max
        x = e_max - a_max if e_max > a_max else 0  # the transfer after the last arrival
        if x:
            self.transfer_sum[inst.comm_hash] = self.transfer_sum.get(inst.comm_hash, 0) + x
        if (role is CommRole.DP or role is CommRole.PP) and x >= self.transfer.get(
            inst.comm_hash, 0
        ):
            self.transfer[inst.comm_hash] = x
        several = len(inst.ranks) >= 2
        grouped = role is CommRole.TP and several
        adds = (_WAITS if role is not CommRole.PP else 0) | (_WAIT_MODEL if grouped else 0)
        if several and inst.sender < 0 and role is not CommRole.PP:
            adds |= _ANY
        self.folded.append((inst, adds))
        if not grouped:
            return
        stage, replica, _ = topo.coords(inst.ranks[0])
        key = (stage, phase, mb if mb is not None else -1)
        # the node runs from the moment its whole TP group met at a collective: a member
        # that came early (its peer was held up upstream) waited, it did not compute
        nodes = self.spans.get(replica)
        if nodes is None:
            nodes = self.spans[replica] = {}
        elif self._borrowed and replica in self._borrowed:  # another part's: copy first
            nodes = self.spans[replica] = {k: list(v) for k, v in nodes.items()}
            self._borrowed.discard(replica)
        span = nodes.get(key)
        if span is None:
            nodes[key] = [a_max, e_max]
        else:
            if a_max < span[0]:
                span[0] = a_max
            if e_max > span[1]:
                span[1] = e_max
        if e_max > self.replica_end.get(replica, 0):
            self.replica_end[replica] = e_max

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepPart):
            return NotImplemented
        plain = all(
            getattr(self, f.name) == getattr(other, f.name)
            for f in fields(self)
            if f.compare and f.name != "sealed"
        )
        a, b = self.sealed, other.sealed
        if a is None or b is None:
            return plain and a is b
        return plain and np.array_equal(a, b)

    def seal(self) -> StepPart:
        """Compute the per-rank figures of the folded instances into one array
        (:func:`_figures`; a part about to be sent) and let the instances go. Returns self."""
        if self.sealed is None:
            self.sealed = _figures(self)
            self.folded = []
        return self

    @classmethod
    def merged(cls, parts: list[StepPart]) -> StepPart:
        """One sealed part that holds several parts of one step (merging commutes)."""
        out = cls(parts[0].step, job=parts[0].job)
        comms: list[int] = []
        for p in parts:
            out.merge_shape(p)
            comms += p.comms or (p.comm_hash,)
        out.comms = tuple(comms)
        base = out.start if out.start != _NEVER else 0
        cols = []
        for p in parts:
            col = p.sealed if p.sealed is not None else _figures(p)
            shift = (p.start if p.start != _NEVER else 0) - base
            if shift:  # times are offsets from the part's start: from the merged start now
                col = col.copy()
                col[-2:] += shift
            cols.append(col)
        out.sealed = np.concatenate(cols, axis=1)
        return out

    def merge_shape(self, other: StepPart) -> None:
        """Add another part's count, extent, transfers and node spans, leaving its
        per-rank figures to :func:`dense_ranks` (the job merges thousands of parts
        a step: per-rank figures are summed once, as arrays, at the close)."""
        self.n += other.n
        if other.start < self.start:
            self.start = other.start
        if other.end > self.end:
            self.end = other.end
        if other.dp_end > self.dp_end:
            self.dp_end = other.dp_end
        if other.last_arrival > self.last_arrival:
            self.last_arrival = other.last_arrival
        for c, x in other.transfer.items():
            self.transfer[c] = max(self.transfer.get(c, 0), x)
        for c, x in other.transfer_sum.items():
            self.transfer_sum[c] = self.transfer_sum.get(c, 0) + x
        for replica, nodes in other.spans.items():
            mine = self.spans.get(replica)
            if mine is None:  # the usual case: one TP group's nodes, met here first
                self.spans[replica] = nodes  # borrowed: copied before it would change
                if self._borrowed is None:
                    self._borrowed = set()
                self._borrowed.add(replica)
                continue
            if self._borrowed and replica in self._borrowed:
                mine = self.spans[replica] = {k: list(v) for k, v in mine.items()}
                self._borrowed.discard(replica)
            for key, (b, e) in nodes.items():
                span = mine.get(key)
                if span is None:
                    mine[key] = [b, e]
                else:
                    span[0], span[1] = min(span[0], b), max(span[1], e)
        for replica, e in other.replica_end.items():
            if e > self.replica_end.get(replica, 0):
                self.replica_end[replica] = e


def dense_ranks(parts: list[StepPart], world: int) -> dict[str, np.ndarray]:
    """The per-rank figures of several parts of one step, merged, as arrays.

    >>> from detectors.align import Instance
    >>> from schemas.enums import CollOp, CommRole
    >>> def dp(ranks, arrivals):  # a data-parallel all-reduce that ends at 70
    ...     n = len(ranks)
    ...     return Instance("j", 5, 0, CollOp.ALL_REDUCE, -1, n, 8, ranks, arrivals,
    ...                     arrivals, (70,) * n)
    >>> a, b = StepPart(0), StepPart(0)
    >>> a.fold(dp((1, 2), (50, 60)), "dp_sync", None, CommRole.DP, None)
    >>> b.fold(dp((1,), (40,)), "dp_sync", None, CommRole.DP, None)
    >>> d = dense_ranks([a, b.seal()], 3)
    >>> d["wait"].tolist(), d["first"].tolist()
    ([0.0, 10.0, 0.0], [-1, 40, 60])
    """
    sealed = [(p.sealed if p.sealed is not None else _figures(p)) for p in parts]
    cols = np.concatenate(sealed, axis=1) if sealed else np.zeros((3 + len(_SUMS), 0))
    bases = np.repeat(
        np.array([p.start if p.start != _NEVER else 0 for p in parts], dtype=np.int64),
        [s.shape[1] for s in sealed],
    )
    ranks = cols[0].astype(np.int64)
    out = {  # float even with no instances at all (parts sent empty: bincount gives ints)
        name: np.bincount(ranks, weights=cols[1 + i], minlength=world)[:world].astype(float)
        for i, name in enumerate(_SUMS)
    }
    first = np.full(world, _NEVER, dtype=np.int64)
    np.minimum.at(first, ranks, cols[-2].astype(np.int64) + bases)
    first[first == _NEVER] = -1
    out["first"] = first
    last_end = np.zeros(world, dtype=np.int64)
    np.maximum.at(last_end, ranks, cols[-1].astype(np.int64) + bases)
    out["last_end"] = last_end
    return out


def _figures(p: StepPart) -> np.ndarray:
    """``p``'s per-rank figures, computed from its folded instances (:meth:`StepPart.fold`)
    as one array, a column per rank (several parts' columns are concatenated: a rank's
    sums, least first arrival and greatest last end over its columns are its figures).
    Rows: rank, the sums of ``_SUMS``, first arrival and last end as offsets from the
    part's start (exact in a float up to 104 days)."""
    folded = p.folded
    if not folded:
        return np.zeros((3 + len(_SUMS), 0))
    base = p.start if p.start != _NEVER else 0
    # gathered by C-level iterators (map, attrgetter, chain): a part folds hundreds of
    # instances, and a Python generator per column cost most of this function
    insts = list(map(itemgetter(0), folded))
    n = len(insts)
    sizes = np.fromiter(map(len, map(attrgetter("ranks"), insts)), np.int64, n)
    flags = np.repeat(np.fromiter(map(itemgetter(1), folded), np.int64, n), sizes)
    m = int(sizes.sum())
    col = lambda name: np.fromiter(  # noqa: E731
        itertools.chain.from_iterable(map(attrgetter(name), insts)), np.int64, m
    )
    rank, arr, end, enq = col("ranks"), col("arrival"), col("end"), col("enqueue")
    k = int(sizes[0])
    if k and (sizes == k).all():
        by_rank = rank.reshape(n, k)
        if (by_rank == by_rank[0]).all():  # the same members in every instance: the usual
            return _member_figures(  # case, a group's part, whose figures are reductions
                by_rank[0], arr.reshape(n, k), end.reshape(n, k), enq.reshape(n, k),
                flags[::k], base,
            )  # fmt: skip
    return _any_figures(rank, arr, end, enq, flags, sizes, base)


def _any_figures(
    rank: np.ndarray,
    arr: np.ndarray,
    end: np.ndarray,
    enq: np.ndarray,
    flags: np.ndarray,
    sizes: np.ndarray,
    base: int,
) -> np.ndarray:
    """:func:`_figures` of any part: its instances' members, arrivals, ends, enqueue
    times and flags one after another, ``sizes`` members an instance."""
    m = len(rank)
    starts = np.cumsum(sizes) - sizes
    inst = np.repeat(np.arange(len(sizes)), sizes)
    a_min = np.minimum.reduceat(arr, starts)
    a_max = np.maximum.reduceat(arr, starts)
    who, at = np.unique(rank, return_inverse=True)
    k = len(who)
    first = np.full(k, _NEVER, dtype=np.int64)
    np.minimum.at(first, at, arr)
    last = np.zeros(k, dtype=np.int64)
    np.maximum.at(last, at, end)
    waits = (flags & _WAITS) > 0
    tp = (flags & _WAIT_MODEL) > 0
    anyc = (flags & _ANY) > 0
    rel = arr - a_min[inst]  # small: exact in a float
    mean = np.add.reduceat(rel, starts) / sizes
    lateness = np.where(tp, rel - mean[inst], 0.0)
    # exclusive blame: the last to arrive (the highest rank among ties) for the time
    # after the one before it
    order = np.lexsort((np.arange(m), arr, inst))
    tail = (starts + sizes)[(sizes >= 2) & tp[starts]]
    late, before = order[tail - 1], order[tail - 2]
    tail_any = (starts + sizes)[(sizes >= 2) & anyc[starts]]
    late_any, before_any = order[tail_any - 1], order[tail_any - 2]
    rows = [
        who,
        np.bincount(at, weights=arr - enq, minlength=k),
        np.bincount(at, minlength=k),
        np.bincount(at, weights=np.where(waits, a_max[inst] - arr, 0), minlength=k),
        np.bincount(at, weights=lateness, minlength=k),
        np.bincount(at[late], weights=arr[late] - arr[before], minlength=k),
        np.bincount(at[late_any], weights=arr[late_any] - arr[before_any], minlength=k),
        first - base,
        last - base,
    ]
    return np.array(rows, dtype=np.float64)


def _member_figures(
    who: np.ndarray,
    arr: np.ndarray,
    end: np.ndarray,
    enq: np.ndarray,
    flags: np.ndarray,
    base: int,
) -> np.ndarray:
    """:func:`_figures` of a part whose instances all have the members ``who``: arrivals,
    ends and enqueue times an instance a row, a member a column; ``flags`` an instance's
    (see :meth:`StepPart.fold`). Equal to the general computation, bit for bit: its sums
    of integers are exact either way, and the one sum of fractions (lateness) adds the
    instances in their order, as ``np.bincount`` does."""
    n, k = arr.shape
    waits = ((flags & _WAITS) > 0)[:, None]
    tp = (flags & _WAIT_MODEL) > 0
    anyc = (flags & _ANY) > 0
    a_min = arr.min(axis=1)
    rel = arr - a_min[:, None]  # small: exact in a float
    mean = rel.sum(axis=1) / k
    lateness = np.where(tp[:, None], rel - mean[:, None], 0.0)
    blame = np.zeros(k)
    if k >= 2 and tp.any():
        # exclusive blame: the last to arrive (the highest rank among ties) for the time
        # after the one before it
        grouped = arr[tp]
        order = np.argsort(grouped, axis=1, kind="stable")
        late, before = order[:, -1], order[:, -2]
        rows = np.arange(len(order))
        got = grouped[rows, late] - grouped[rows, before]
        blame = np.bincount(late, weights=got, minlength=k)
    blame_any = np.zeros(k)
    if k >= 2 and anyc.any():
        grouped = arr[anyc]
        order = np.argsort(grouped, axis=1, kind="stable")
        late, before = order[:, -1], order[:, -2]
        rows = np.arange(len(order))
        blame_any = np.bincount(
            late, weights=grouped[rows, late] - grouped[rows, before], minlength=k
        )
    rows_out = [
        who,
        (arr - enq).sum(axis=0),
        np.full(k, n),
        np.where(waits, arr.max(axis=1)[:, None] - arr, 0).sum(axis=0),
        np.cumsum(lateness, axis=0)[-1],  # in instance order
        blame,
        blame_any,
        arr.min(axis=0) - base,
        np.maximum(end.max(axis=0), 0) - base,
    ]
    return np.array(rows_out, dtype=np.float64)


#: where what this module once held lives now: a flow's snapshots pickled it by this name
_MOVED = {
    "CommSchedule": "detectors.schedule",
    "StepMark": "detectors.schedule",
    "ScheduleBook": "detectors.schedule",
    "StuckProxies": "detectors.edges",
    "EdgeThroughput": "detectors.edges",
    "PartMerger": "detectors.merge",
    "shard_of": "detectors.merge",
    "StepFolder": "detectors.folder",
}


def __getattr__(name: str) -> object:
    import importlib

    if name == "CommProgress":
        from detectors.merge import CommLiveness

        return CommLiveness
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(name)


__all__ = ["NodeKey", "StepPart", "dense_ranks"]
