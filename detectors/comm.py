"""Everything megatrace does per communicator, before the job's analysis.

:class:`CommAnalyzer` composes the :class:`~detectors.align.CollectiveAligner`
(every member's record of each instance) and the
:class:`~detectors.folder.StepFolder` (complete instances folded into one part
per step), and passes on only the proxy summaries the job needs (stuck ones,
and the completion of one that was stuck: a network hang's evidence), plus
each edge's throughput over every ``edge_window`` completed sends
(:class:`~detectors.edges.EdgeThroughput`), and, from :meth:`CommAnalyzer.stats`,
its account of how the records met (:class:`~schemas.results.AlignStats`). The
flow keeps one per (job, communicator) key; the offline
:class:`~detectors.replay.Replay` keeps one per communicator too, so both hand
the job's analyzer the same items.

>>> from schemas.records import Collective
>>> from schemas.enums import CollOp, DType
>>> comm = CommAnalyzer()
>>> def rec(rank, a, e):
...     return Collective(job="j", node="n", rank=rank, comm_hash=9, comm_size=2,
...         rank_in_comm=rank, op=CollOp.ALL_REDUCE, seq=0, count=1, size_bytes=2,
...         dtype=DType.BFLOAT16, enqueue_ns=a, start_ns=a, end_ns=e)
>>> rows, forward = comm.update([rec(0, 100, 500), rec(1, 300, 500)])
>>> rows, [type(x).__name__ for x in forward]  # no schedule yet: the instance waits for it
([], ['CommLiveness'])
>>> _, forward = comm.flush()  # none came: it goes to the job as it is
>>> [type(x).__name__ for x in forward]
['Instance']
>>> rows, _ = comm.update([rec(1, 300, 500)])  # rank 1's record again: late, ignored
>>> (s,) = comm.stats()
>>> s.records, s.late_records, s.out_of_order_records, s.open_instances
(3, 1, 0, 0)
>>> comm.stats()  # nothing new to tell
[]
"""

from __future__ import annotations

from typing import Any

from detectors.align import CollectiveAligner, Passed
from detectors.edges import EdgeThroughput, StuckProxies
from detectors.folder import StepFolder
from detectors.schedule import CommSchedule, StepMark
from schemas.enums import Direction
from schemas.records import Collective, ProxySummary
from schemas.results import AlignedCollective, AlignStats


class CommAnalyzer:
    """One communicator's aligner and step folder (see the module docstring).

    Parameters
    ----------
    min_timeout_ns, max_open
        Passed to :class:`~detectors.align.CollectiveAligner`: the least time an
        instance stays open before it is reported partial, and the most instances
        held open.
    edge_window
        Completed sends of an edge per throughput measure.
    stats_every_ns
        Event time between two :meth:`stats` rows while nothing unusual is counted
        (a late, out-of-order, dropped or partial one is told at once).
    keep_rows
        Passed to :class:`~detectors.folder.StepFolder`: each instance's stored row.
    """

    # the counts' starting values, also for one pickled by a version without them (a flow
    # resumed across an upgrade): :meth:`_reset` sets them on each instance
    _records = 0
    _partials = 0
    _told: tuple[int, ...] = (0, 0, 0, 0, 0, 0)  # the counts in the last stats row
    _told_ns = 0  # its time
    _looked = 0  # the records counted when reported partials were last checked
    keep_rows = True

    def __init__(
        self,
        min_timeout_ns: int = 500_000_000,
        max_open: int = 4096,
        edge_window: int = 16,
        stats_every_ns: int = 10_000_000_000,
        keep_rows: bool = True,
    ) -> None:
        if edge_window < 1 or stats_every_ns < 1:
            raise ValueError("edge_window and stats_every_ns must be at least 1")
        self.keep_rows = keep_rows
        self.min_timeout_ns = min_timeout_ns
        self.max_open = max_open
        self.edge_window = edge_window
        self.stats_every_ns = stats_every_ns
        self._reset()

    def _reset(self) -> None:
        self.aligner = CollectiveAligner(min_timeout_ns=self.min_timeout_ns, max_open=self.max_open)
        self.folder = StepFolder(keep_rows=self.keep_rows)
        self._stuck = StuckProxies()
        self._edges: dict[tuple[int, int], list[int]] = {}  # (src, dst) -> [n, bytes, wait, t0]
        self._records = 0
        self._partials = 0
        self._told = (0, 0, 0, 0, 0, 0)
        self._told_ns = 0
        self._looked = 0

    def update(
        self, items: list[Collective | ProxySummary | CommSchedule | StepMark]
    ) -> tuple[list[AlignedCollective], list[Any]]:
        """Records (and schedules) in; (stored rows, items for the job) out."""
        rows: list[AlignedCollective] = []
        forward: list[Any] = []
        batch: list[Collective] = []

        def align() -> None:  # the records so far, before a schedule changes how they fold
            self._records += len(batch)
            r, f = self.folder.update_many(self.aligner.update_many(batch))
            rows.extend(r)
            forward.extend(f)
            batch.clear()

        proxies: list[ProxySummary] = []
        for item in items:
            if isinstance(item, Collective):
                batch.append(item)
            elif isinstance(item, ProxySummary):
                proxies.append(item)
            elif isinstance(item, StepMark):
                align()
                r, f = self.folder.mark(item.step, item.end_ns, item.rank)
                rows.extend(r)
                forward.extend(f)
            else:
                align()
                r, f = self.folder.learn(item)
                rows.extend(r)
                forward.extend(f)
        align()
        if proxies:
            self._proxies(proxies, forward)
        return rows, forward + self.folder.progress()

    def _proxies(self, proxies: list[ProxySummary], forward: list[Any]) -> None:
        """A batch's proxy summaries: the stuck ones (and the completion of one that was)
        and each edge's throughput windows go to ``forward``."""
        stuck, send = self._stuck, Direction.SEND
        newest = 0
        for p in proxies:
            if p.last_ns > newest:
                newest = p.last_ns
            if stuck.update(p):
                forward.append(p)
            elif p.direction is send and p.size_bytes > 0 and p.send_wait_ns > 0:
                self._edge(p, forward)
        self.folder.saw_time(newest)

    def _edge(self, p: ProxySummary, forward: list[Any]) -> None:
        acc = self._edges.get((p.rank, p.peer))
        if acc is None:
            acc = self._edges[(p.rank, p.peer)] = [0, 0, 0, p.first_ns, 0]
        acc[0] += 1
        acc[1] += p.size_bytes
        acc[2] += p.send_wait_ns
        acc[4] += p.send_gpu_wait_ns
        if acc[0] < self.edge_window:
            return
        del self._edges[(p.rank, p.peer)]
        forward.append(
            EdgeThroughput(
                p.job, p.rank, p.peer, p.last_ns, max(0, p.last_ns - acc[3]), acc[1],
                acc[1] * 8 / acc[2], acc[4] // acc[0],
            )
        )  # fmt: skip

    def expire(self, now_ns: int) -> tuple[list[AlignedCollective], list[Any]]:
        """Partial instances open too long, for the job (see ``CollectiveAligner.expire``),
        and what the folder held too long to learn a step from (see
        :meth:`~detectors.folder.StepFolder.expire`): (stored rows, items for the job)."""
        out: list[Any] = []
        if self._records != self._looked:  # new records: a reported call may be passed
            self._looked = self._records
            out += [Passed(inst.job, inst.key) for inst in self.aligner.passed()]
        for inst in self.aligner.expire(now_ns):
            self._partials += 1
            out += self.folder.partial(inst)
        rows, held = self.folder.expire(now_ns)
        return rows, out + held + self.folder.progress()

    def flush(self) -> tuple[list[AlignedCollective], list[Any]]:
        """End of a bounded input: held instances and open parts, and open instances as
        they stand: (stored rows, items for the job)."""
        rows, out = self.folder.flush()
        out += [Passed(inst.job, inst.key) for inst in self.aligner.passed()]
        told = self.folder.told_partial
        for inst in self.aligner.open_instances():
            if inst.key in told:  # reported partial already, as it stands
                continue
            self._partials += 1
            out += self.folder.partial(inst)
        return rows, out + self.folder.progress()

    def stats(self, final: bool = False) -> list[AlignStats]:
        """The communicator's counts as a row, when there is news: a late, out-of-order,
        dropped, partial or lost one counted since the last row; more records and
        ``stats_every_ns`` of event time since it; or more records at the end of a
        bounded input (``final``)."""
        al = self.aligner
        counts = (self._records, al.late, al.out_of_order, al.dropped, self._partials, al.lost)
        ts_ns = self.folder.last_arrival_ns
        if len(self._told) < len(counts):  # resumed from before a count existed: it was 0
            self._told += (0,) * (len(counts) - len(self._told))
        if not self.folder.job or counts == self._told:
            return []
        unusual = counts[1:] != self._told[1:]
        if not (unusual or final or ts_ns - self._told_ns >= self.stats_every_ns):
            return []
        self._told, self._told_ns = counts, ts_ns
        return [
            AlignStats(
                job=self.folder.job,
                comm_hash=self.folder.comm_hash,
                ts_ns=ts_ns,
                records=counts[0],
                late_records=counts[1],
                out_of_order_records=counts[2],
                dropped_instances=counts[3],
                partial_reports=counts[4],
                open_instances=al.n_open,
                lost_instances=counts[5],
            )
        ]

    @property
    def n_open(self) -> int:
        return self.aligner.n_open


__all__ = ["CommAnalyzer"]
