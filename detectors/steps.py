"""Assemble aligned collective instances into per-iteration reports.

Every instance is placed in the schedule (:class:`~detectors.topology.Topology`)
and folded into its step's accumulator: per-rank lateness in TP collectives
(the cross-rank wait-time model), exclusive blame of the last arriver, the
host's lead over the GPU (enqueue -> start), node spans of each
(pipeline replica, stage, phase, micro-batch) for the critical path, and
transfer times. A step closes when all its expected instances arrived, or
when instances two steps later show it never will.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from detectors.align import Instance
from detectors.topology import Position, Topology
from schemas.units import CommRole

SpanKey = tuple[int, int, str, int]
_NEVER = 1 << 62  # (dp replica, stage, phase, micro-batch)


@dataclass
class StepReport:
    """One iteration's cross-rank account (times in ns, arrays indexed by global rank)."""

    step: int
    start_ns: int
    end_ns: int
    duration_ns: int
    complete: bool
    n_instances: int
    lateness_ns: np.ndarray
    blame_ns: np.ndarray
    wait_ns: np.ndarray
    host_lead_ns: np.ndarray
    first_ns: np.ndarray
    last_end_ns: np.ndarray
    spans: dict[SpanKey, list[int]]
    node_lateness: dict[SpanKey, dict[int, float]]
    transfer_ns: dict[int, int]

    def node_durations(self, replica: int) -> dict[tuple[int, str, int], float]:
        return {
            (s, ph, mb): float(e - b)
            for (d, s, ph, mb), (b, e) in self.spans.items()
            if d == replica
        }


@dataclass
class _Acc:
    world: int
    n: int = 0
    start: int = 1 << 62
    end: int = 0
    dp_end: int = 0
    lateness: list[float] = field(init=False)
    blame: list[float] = field(init=False)
    wait: list[float] = field(init=False)
    lead_sum: list[float] = field(init=False)
    lead_n: list[int] = field(init=False)
    first: list[int] = field(init=False)
    last_end: list[int] = field(init=False)
    spans: dict[SpanKey, list[int]] = field(default_factory=dict)
    node_late: dict[SpanKey, dict[int, float]] = field(default_factory=dict)
    transfer: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        w = self.world
        self.lateness = [0.0] * w
        self.blame = [0.0] * w
        self.wait = [0.0] * w
        self.lead_sum = [0.0] * w
        self.lead_n = [0] * w
        self.first = [_NEVER] * w
        self.last_end = [0] * w


class StepAssembler:
    """Per-job: instances in, closed :class:`StepReport` out (in step order)."""

    def __init__(self, topology: Topology, max_open_steps: int = 64) -> None:
        self.topo = topology
        self.max_open_steps = max_open_steps
        self._reset()

    def _reset(self) -> None:
        self._acc: dict[int, _Acc] = {}
        self._closed_upto = -1
        self._prev_end: int | None = None
        self.late_instances = 0
        self._comm_step: dict[int, int] = {}  # highest step seen per communicator
        self._at: dict[int, int] = {}  # how many communicators have that highest step
        self._min_step = -1
        self._expected = (-1, 0)
        self._known = -1

    def expected_instances(self) -> int:
        """Instances one complete step has (cached; recomputed when communicators are added)."""
        t = self.topo
        if self._expected[0] == len(t.comms):
            return self._expected[1]
        by_role = dict.fromkeys(CommRole, 0)
        for c in t.comms.values():
            by_role[c.role] += 1
        n = (
            by_role[CommRole.TP] * t.tp_ops_per_step
            + by_role[CommRole.DP] * t.dp_ops_per_step
            + by_role[CommRole.PP] * 2 * t.job.num_microbatches
        )
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
            acc = self._acc[pos.step] = _Acc(topo.job.world_size)
        self._fold(acc, inst, pos.phase, pos.microbatch, topo.role(inst.comm_hash))
        out = []
        if acc.n >= self.expected_instances():
            out += self._close_through(pos.step)
        out += self._advance(inst.comm_hash, pos.step)
        if len(self._acc) > self.max_open_steps:  # bounded state, whatever is missing
            out += self._close_through(min(self._acc))
        return out

    def _advance(self, comm: int, step: int) -> list[StepReport]:
        """Per-communicator watermark over *every* communicator of the job.

        A step is given up on (closed incomplete) only when all communicators have
        moved two steps past it: partitions of a topic are read at different paces,
        so the communicators seen so far say nothing about the others.
        """
        if len(self.topo.comms) != self._known:
            self._known = len(self.topo.comms)
            for c in self.topo.comms:
                if c not in self._comm_step:  # not heard from yet: holds the watermark at -1
                    self._comm_step[c] = -1
                    self._at[-1] = self._at.get(-1, 0) + 1
                    self._min_step = -1
        prev = self._comm_step.get(comm)
        if prev is not None and step <= prev:
            return []
        self._comm_step[comm] = step
        self._at[step] = self._at.get(step, 0) + 1
        if prev is not None:
            self._at[prev] -= 1
        elif len(self._comm_step) == 1:
            self._min_step = step
        while self._at.get(self._min_step, 0) == 0 and self._min_step < step:
            self._at.pop(self._min_step, None)
            self._min_step += 1
        watermark = self._min_step - 2
        if watermark > self._closed_upto:
            return self._close_through(watermark)
        return []

    def _fold(self, acc: _Acc, inst: Instance, phase: str, mb: int | None, role: CommRole) -> None:
        # plain Python: members are few (a TP group, a DP ring, a pair), numpy calls cost more
        acc.n += 1
        ranks, arr, end, enq = inst.ranks, inst.arrival, inst.end, inst.enqueue
        a_min, a_max, e_max = min(arr), max(arr), max(end)
        acc.start = min(acc.start, a_min)
        acc.end = max(acc.end, e_max)
        first, last_end, lead_sum, lead_n = acc.first, acc.last_end, acc.lead_sum, acc.lead_n
        wait = acc.wait if role != CommRole.PP else None
        for r, a, e, q in zip(ranks, arr, end, enq, strict=True):
            if a < first[r]:
                first[r] = a
            if e > last_end[r]:
                last_end[r] = e
            lead_sum[r] += a - q
            lead_n[r] += 1
            if wait is not None:
                wait[r] += a_max - a
        if role == CommRole.DP:
            acc.dp_end = max(acc.dp_end, e_max)
        if role is CommRole.DP or role is CommRole.PP:
            x = max(0, e_max - a_max)  # complete: the transfer after the last arrival
            acc.transfer[inst.comm_hash] = max(acc.transfer.get(inst.comm_hash, 0), x)
        if role != CommRole.TP or len(ranks) < 2:
            return
        mean = sum(arr) / len(arr)
        order = sorted(range(len(arr)), key=arr.__getitem__)
        acc.blame[ranks[order[-1]]] += float(arr[order[-1]] - arr[order[-2]])
        stage, replica, _ = self.topo.coords(ranks[0])
        key = (replica, stage, phase, mb if mb is not None else -1)
        span = acc.spans.get(key)
        if span is None:
            acc.spans[key] = [a_min, e_max]
            nl = acc.node_late[key] = dict.fromkeys(ranks, 0.0)
        else:
            span[0] = min(span[0], a_min)
            span[1] = max(span[1], e_max)
            nl = acc.node_late[key]
        lateness = acc.lateness
        for r, a in zip(ranks, arr, strict=True):
            rel = a - mean
            lateness[r] += rel
            nl[r] = nl.get(r, 0.0) + rel

    def _close_through(self, step: int) -> list[StepReport]:
        out = []
        for s in sorted(k for k in self._acc if k <= step):
            acc = self._acc.pop(s)
            end = acc.dp_end or acc.end
            start = self._prev_end if self._prev_end is not None else acc.start
            self._prev_end = end
            lead_sum = np.array(acc.lead_sum)
            lead_n = np.array(acc.lead_n)
            lead = np.divide(lead_sum, lead_n, out=np.zeros_like(lead_sum), where=lead_n > 0)
            first = np.array(acc.first, dtype=np.int64)
            first[first == _NEVER] = -1
            out.append(
                StepReport(
                    step=s,
                    start_ns=start,
                    end_ns=end,
                    duration_ns=max(0, end - start),
                    complete=acc.n >= self.expected_instances(),
                    n_instances=acc.n,
                    lateness_ns=np.array(acc.lateness),
                    blame_ns=np.array(acc.blame),
                    wait_ns=np.array(acc.wait),
                    host_lead_ns=lead,
                    first_ns=first,
                    last_end_ns=np.array(acc.last_end, dtype=np.int64),
                    spans=acc.spans,
                    node_lateness=acc.node_late,
                    transfer_ns=acc.transfer,
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
