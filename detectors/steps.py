"""Assemble a job's step parts into per-iteration reports.

Every communicator's instances are placed in the schedule
(:class:`~detectors.topology.Topology`, or the steps its calls show) and folded into
parts (:class:`~detectors.parts.StepPart`); the job's :class:`StepAssembler` merges a
step's parts and closes it when every communicator that keeps up sent its part (or the
layout's count of instances came), or when later steps show it never will, as a
:class:`StepReport`: per-rank lateness, blame, waits and host lead, node spans of each
(pipeline replica, stage, phase, micro-batch) for the critical path, and transfer times.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from detectors.align import Instance
from detectors.critical_path import critical_path
from detectors.merge import StepWatermark
from detectors.parts import NodeKey, StepPart
from detectors.rank_figures import dense_ranks
from detectors.topology import Position, Topology
from schemas.results import RankStep, StepSummary


@dataclass
class StepReport:
    """One iteration's cross-rank account (times in ns, arrays indexed by global rank).

    ``spans`` holds each pipeline replica's node spans, ``replica_end`` when each
    replica's last node ended (the slowest replica is the one ending last)."""

    step: int
    start_ns: int
    end_ns: int
    duration_ns: int
    complete: bool
    n_instances: int
    lateness_ns: np.ndarray
    blame_ns: np.ndarray
    #: the last arriver's exclusive blame summed over every collective of two or more
    #: members, whatever its role (who made the others wait, layout or none)
    blame_any_ns: np.ndarray
    wait_ns: np.ndarray
    host_lead_ns: np.ndarray
    first_ns: np.ndarray
    last_end_ns: np.ndarray
    spans: dict[int, dict[NodeKey, list[int]]]
    replica_end: dict[int, int]
    transfer_ns: dict[int, int]
    #: per communicator, its instances' transfer times (after the last arrival) summed
    transfer_sum_ns: dict[int, int] = field(default_factory=dict)

    def node_durations(self, replica: int) -> dict[NodeKey, float]:
        return {k: float(e - b) for k, (b, e) in self.spans.get(replica, {}).items()}

    def slowest_replicas(self, n: int) -> list[int]:
        """The ``n`` pipeline replicas whose last node ended last, slowest first."""
        ends = self.replica_end
        return sorted(ends, key=ends.__getitem__, reverse=True)[:n]


class StepAssembler:
    """Per-job: instances in, closed :class:`StepReport` out (in step order)."""

    #: a communicator this many steps behind the newest is not waited for (it went
    #: quiet, or its steps are not known yet: its instances are held until they are)
    behind_steps = 4

    def __init__(self, topology: Topology, max_open_steps: int = 64) -> None:
        self.topo = topology
        self.max_open_steps = max_open_steps
        self._reset()

    def _reset(self) -> None:
        self._acc: dict[int, StepPart] = {}
        self._parts: dict[int, list[StepPart]] = {}  # parts merged at the close (dense_ranks)
        self._closed_upto = -1
        self._prev_end: int | None = None
        self.late_instances = 0
        self._seen = StepWatermark()  # the step each communicator reached
        self._expected = (-1, 0)
        self._known = -1
        self._reported: dict[int, set[int]] = {}  # step -> the communicators whose part came
        self._learning: set[int] = set()  # communicators that said parts will come, none yet

    def expected_instances(self) -> int:
        """Instances one complete step has (cached; recomputed when communicators are added)."""
        t = self.topo
        if self._expected[0] == len(t.comms):
            return self._expected[1]
        n = sum(t.instances_per_step(h) for h in t.comms)
        self._expected = (len(t.comms), n)
        return n

    def add(self, inst: Instance, pos: Position | None) -> list[StepReport]:
        """Fold a complete instance placed at ``pos`` (:meth:`Topology.place`)."""
        topo = self.topo
        if pos is None:
            return []
        if pos.step <= self._closed_upto:
            self.late_instances += 1
            return []
        acc = self._acc.get(pos.step)
        if acc is None:
            acc = self._acc[pos.step] = StepPart(pos.step)
        acc.fold(inst, pos.phase, pos.microbatch, topo.role(inst.comm_hash), topo)
        return self._after(acc, (inst.comm_hash,))

    def add_part(self, part: StepPart) -> list[StepReport]:
        """Merge a communicator's part of a step, or several merged (see :class:`StepPart`)."""
        if part.step <= self._closed_upto:
            self.late_instances += part.n
            return []
        acc = self._acc.get(part.step)
        if acc is None:
            acc = self._acc[part.step] = StepPart(part.step)
        acc.merge_shape(part)
        self._parts.setdefault(part.step, []).append(part)
        comms = part.comms or (part.comm_hash,)
        self._reported.setdefault(part.step, set()).update(comms)
        ends, end = self.__dict__.setdefault("_comm_end", {}), part.end
        low, high = self._end_bounds()
        for c in comms:
            was = ends.get(c, 0)
            if end > was:
                ends[c] = end
                high = max(high, end)
                if not was:  # a communicator's first: the lowest may be lower now
                    low = end if low is None else min(low, end)
        self._ends_seen = (low, high)
        if self._learning:
            if isinstance(self._learning, frozenset):
                self._learning = set(self._learning)
            self._learning.difference_update(comms)
        return self._after(acc, comms, by_count=False)

    #: (at most the lowest, the highest) of the communicators' newest part ends: a
    #: communicator's only grows, so the highest is kept exactly and the lowest read
    #: again only when it would matter (thousands of communicators, a part at a time)
    _ends_seen: tuple[int | None, int] | None = None

    def _end_bounds(self, exact: bool = False) -> tuple[int | None, int]:
        """(the lowest, or at most it; the highest) of the communicators' newest part ends
        (None, 0 before any part): the lowest exactly with ``exact``."""
        seen = self._ends_seen
        if seen is None or exact:
            ends = self.__dict__.setdefault("_comm_end", {})
            low, high = min(ends.values(), default=None), max(ends.values(), default=0)
            seen = self._ends_seen = (low, high)
        return seen

    #: for one pickled by a version without them
    _learning: frozenset[int] | set[int] = frozenset()
    _typical_ns = 0  # the latest step's duration

    def expect(self, comm_hash: int) -> None:
        """A communicator said it will send parts (its steps are being learned): steps wait
        for it until its first part comes."""
        if comm_hash not in self._seen.newest or self._seen.newest[comm_hash] < 0:
            if isinstance(self._learning, frozenset):
                self._learning = set(self._learning)
            self._learning.add(comm_hash)
            self._seen.advance((comm_hash,), -1)

    def _all_reported(self, step: int) -> bool:
        """Every communicator that keeps up sent its part of ``step`` (each tells its own
        step's end: the count of instances a step holds is the communicators' to know),
        and none is still learning its steps."""
        got = self._reported.get(step)
        if not got or self._learning:
            return False
        waited = self._waited(step)
        if waited is None:  # every one heard from
            waited = self._seen.newest
            return len(got) >= len(waited) and got.issuperset(waited)
        return got.issuperset(waited)

    #: a communicator whose newest part ended this long (event time) before the newest
    #: any communicator's did is not waited for: it went quiet (at least this many steps)
    quiet_ns, quiet_steps = 30_000_000_000, 16

    def _waited(self, step: int) -> Collection[int] | None:
        """The communicators a step waits for: those that reported lately (in event time:
        a topic's partitions are read at different paces, so a communicator many steps
        behind may only be read later), those learning their steps, and those not heard
        from whose layout gives them instances every step. None: every one heard from
        (the usual)."""
        topo, learning = self.topo, self._learning
        ends = self.__dict__.setdefault("_comm_end", {})
        low, newest_end = self._end_bounds()
        typical = self._prev_end and self._typical_ns
        cut = newest_end - max(self.quiet_ns, self.quiet_steps * (typical or 0))
        if -1 not in self._seen.steps_held():
            if low is not None and low < cut:  # a lower bound: the exact one may be above
                low = self._end_bounds(exact=True)[0]
            if low is None or low >= cut:
                return None  # every one heard from, none quiet
        return [
            c
            for c, s in self._seen.newest.items()
            if c in learning
            or (s < 0 and topo.instances_per_step(c) > 0)
            or (s >= 0 and ends.get(c, newest_end) >= cut)
        ]

    def _after(
        self, acc: StepPart, comms: tuple[int, ...], by_count: bool = True
    ) -> list[StepReport]:
        """After an instance (``by_count``: the layout's count of a step's instances closes
        it) or a part (every communicator's part does: a communicator knows its step)."""
        out = []
        self._advance_only(comms, acc.step)
        if (by_count and acc.n >= self.expected_instances()) or self._all_reported(acc.step):
            out += self._close_through(acc.step)
        out += self._advance()
        if len(self._acc) > self.max_open_steps:  # bounded state, whatever is missing
            out += self._close_through(min(self._acc))
        return out

    def _advance(self) -> list[StepReport]:
        """Per-communicator watermark over *every* communicator of the job (the newest
        communicators' steps noted already, by :meth:`_advance_only`).

        A step is given up on (closed incomplete) only when all communicators have
        moved two steps past it: partitions of a topic are read at different paces,
        so the communicators seen so far say nothing about the others. One more than
        :attr:`behind_steps` behind the newest is not waited for.
        """
        if self._learning:  # a communicator's steps are not known yet: its parts will come
            return []
        newest = self._seen.newest
        waited = self._waited(self._seen.high())
        if waited is None:  # every communicator's newest step: the lowest is kept
            watermark = self._seen.low() - 2 if newest else -3
        else:
            watermark = min(map(newest.__getitem__, waited), default=-1) - 2
        if watermark > self._closed_upto:
            return self._close_through(watermark)
        return []

    def _advance_only(self, comms: tuple[int, ...], step: int) -> bool:
        """Note that ``comms`` reached ``step``; whether any moved."""
        if len(self.topo.comms) != self._known:
            self._known = len(self.topo.comms)
            # those not heard from yet hold the watermark at -1 (until far behind)
            self._seen.advance((c for c in self.topo.comms if c not in self._seen.newest), -1)
        return self._seen.advance(comms, step)

    def _close_through(self, step: int) -> list[StepReport]:
        out = []
        for s in sorted(k for k in self._acc if k <= step):
            acc = self._acc.pop(s)
            world = self.topo.job.world_size
            if acc.n == 0:  # every communicator said it had nothing in this step
                end = start = self._prev_end if self._prev_end is not None else 0
            else:
                end = acc.dp_end or acc.end
                start = self._prev_end if self._prev_end is not None else acc.start
                self._prev_end = end
                self._typical_ns = end - start
            parts = self._parts.get(s)
            whole = acc.n > 0 and (
                self._all_reported(s) if parts else acc.n >= self.expected_instances()
            )
            self._reported.pop(s, None)
            ranks = dense_ranks([acc, *self._parts.pop(s, [])], world)
            lead_sum, lead_n = ranks["lead_sum"], ranks["lead_n"]
            lead = np.divide(lead_sum, lead_n, out=np.zeros_like(lead_sum), where=lead_n > 0)
            out.append(
                StepReport(
                    step=s,
                    start_ns=start,
                    end_ns=end,
                    duration_ns=max(0, end - start),
                    complete=whole,
                    n_instances=acc.n,
                    lateness_ns=ranks["lateness"],
                    blame_ns=ranks["blame"],
                    blame_any_ns=ranks["blame_any"],
                    wait_ns=ranks["wait"],
                    host_lead_ns=lead,
                    first_ns=ranks["first"],
                    last_end_ns=ranks["last_end"],
                    spans=acc.spans,
                    replica_end=acc.replica_end,
                    transfer_ns=acc.transfer,
                    transfer_sum_ns=acc.transfer_sum,
                )
            )
            self._closed_upto = max(self._closed_upto, s)
        return out

    def flush(self) -> list[StepReport]:
        """Close every open step (end of input)."""
        if not self._acc:
            return []
        return self._close_through(max(self._acc))

    @property
    def open_steps(self) -> list[int]:
        return sorted(self._acc)

    def last_seen(self) -> np.ndarray:
        """Each rank's newest call end in the steps still open (0: none there): which
        ranks were seen calling lately, when the job stopped."""
        world = self.topo.job.world_size
        parts = [p for s, acc in self._acc.items() for p in (acc, *self._parts.get(s, []))]
        return dense_ranks(parts, world)["last_end"] if parts else np.zeros(world, np.int64)


def step_tables(
    job: str, topo: Topology, rep: StepReport, assembler: StepAssembler, baseline: float | None
) -> list[StepSummary | RankStep]:
    """A closed step's summary (against the healthy step time ``baseline``, with the
    slowest pipeline replica's critical path) and each rank's row in it."""
    ratio = rep.duration_ns / baseline if baseline else None
    slowest = rep.slowest_replicas(1)
    replica = slowest[0] if slowest else None
    path = []
    if replica is not None:
        cp = critical_path(rep.node_durations(replica), topo.job.pp, topo.job.num_microbatches)
        path = [f"{ph[0].upper()}{mb}s{s}" for s, ph, mb in cp.path]
    out: list[StepSummary | RankStep] = [
        StepSummary(
            job=job,
            step=rep.step,
            start_ns=rep.start_ns,
            end_ns=rep.end_ns,
            duration_ns=rep.duration_ns,
            expected_ns=int(baseline) if baseline else None,
            throughput_ratio=(1 / ratio) if ratio else None,
            slowest_pp_group=replica,
            critical_path=path,
            instances=rep.n_instances,
            expected_instances=assembler.expected_instances(),
            late_instances=assembler.late_instances,
            left_out=not rep.complete,
        )
    ]
    # a row per rank: the arrays read as lists once (numpy's per-element access is slow)
    first, last = rep.first_ns.tolist(), rep.last_end_ns.tolist()
    wait, late, blame = rep.wait_ns.tolist(), rep.lateness_ns.tolist(), rep.blame_ns.tolist()
    (nodes, stages), step = topo.rank_rows(), rep.step
    world = topo.job.world_size
    rows = zip(range(world), first, last, wait, late, blame, nodes, stages, strict=True)
    for r, f, e, w, la, b, node, stage in rows:
        if f < 0:
            continue
        out.append(
            RankStep(
                job=job,
                step=step,
                rank=r,
                node=node,
                pp_stage=stage,
                start_ns=int(f),
                end_ns=int(e if e > f else f),
                wait_ns=int(w),
                lateness_ns=float(la),
                blame_ns=int(b),
            )
        )
    return out


def __getattr__(name: str) -> object:
    """What this module once held (a flow's snapshots pickled it by this name)."""
    if name == "StepWatermark":
        return StepWatermark
    from detectors import parts, rank_figures

    if name == "StepPart":
        return parts.StepPart
    if name in ("dense_ranks", "_any_figures", "_member_figures"):
        return getattr(rank_figures, name)
    raise AttributeError(name)
