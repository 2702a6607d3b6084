"""A step's parts: what some of one step's collective instances say, per rank.

A communicator's folder (:mod:`detectors.folder`) folds its instances into one
:class:`StepPart` per step; parts of several communicators merge (per shard of
them, :mod:`detectors.merge`, then in the job's :class:`~detectors.steps.StepAssembler`),
and :func:`~detectors.rank_figures.dense_ranks` turns a step's parts into per-rank
figures: lateness in TP collectives (the cross-rank wait-time model), exclusive blame
of the last arriver, the host's lead over the GPU, waits, first arrival and last end.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from detectors.align import Instance
from detectors.rank_figures import ANY, NEVER, WAIT_MODEL, dense_ranks, figures
from detectors.topology import Topology
from schemas.enums import CommRole

NodeKey = tuple[int, str, int]  # (stage, phase, micro-batch) of one pipeline replica


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
    start: int = NEVER
    end: int = 0
    dp_end: int = 0
    last_arrival: int = 0
    spans: dict[int, dict[NodeKey, list[int]]] = field(default_factory=dict)
    replica_end: dict[int, int] = field(default_factory=dict)
    transfer: dict[int, int] = field(default_factory=dict)
    transfer_sum: dict[int, int] = field(default_factory=dict)
    #: the per-rank figures once sealed, one column per rank (see :meth:`seal`)
    sealed: np.ndarray | None = None
    #: instances folded since, with what they add (see :meth:`fold`), until :func:`figures`
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
        (:func:`figures`): a part folds hundreds of instances a step. ``extent`` is the
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
        adds = WAIT_MODEL if grouped else 0
        if several and inst.sender < 0 and role is not CommRole.PP:
            adds |= ANY
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
        (:func:`figures`; a part about to be sent) and let the instances go. Returns self."""
        if self.sealed is None:
            self.sealed = figures(self)
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
        base = out.start if out.start != NEVER else 0
        cols = []
        for p in parts:
            col = p.sealed if p.sealed is not None else figures(p)
            shift = (p.start if p.start != NEVER else 0) - base
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


#: where what this module once held lives now: a flow's snapshots pickled it by this name
_MOVED = {
    "_any_figures": "detectors.rank_figures",
    "_member_figures": "detectors.rank_figures",
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
