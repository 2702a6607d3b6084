"""Run the detectors over a stream of records, offline or in tests.

:class:`Replay` does what the dataflow does, in one process: one
:class:`~detectors.comm.CommAnalyzer` per (job, communicator) fed the
communicator's records and schedule, one :class:`~detectors.job.JobAnalyzer`
per job, and the hang watchdog driven by event time (the newest timestamp
seen) every ``tick_ns``.

>>> from producers.sim.scenarios import build
>>> run = build("missing-recv", scale="tiny", seed=0, steps=20)
>>> verdicts = [v for v in Replay().run(run.records()) if type(v).__name__ == "Verdict"]
>>> (verdicts[0].kind.value, verdicts[0].rank, verdicts[0].phase.value, verdicts[0].microbatch)
('hang', 7, 'forward', 3)
>>> run.faults[0].rank
7
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from detectors.comm import CommAnalyzer
from detectors.job import JobAnalyzer
from detectors.merge import CommLiveness, PartMerger, shard_of
from detectors.parts import StepPart
from detectors.schedule import ScheduleBook, StepMark
from schemas.config import DetectSettings
from schemas.records import Collective, ProxySummary


class Replay:
    def __init__(self, settings: DetectSettings | None = None, tick_ns: int = 50_000_000) -> None:
        self.settings = settings or DetectSettings()
        self.tick_ns = tick_ns
        self.comms: dict[tuple[str, int], CommAnalyzer] = {}
        self.books: dict[str, ScheduleBook] = {}
        self.jobs: dict[str, JobAnalyzer] = {}
        self.mergers: dict[tuple[str, int], PartMerger] = {}
        self._next_tick = 0
        self.now_ns = 0

    def _job(self, job: str) -> JobAnalyzer:
        a = self.jobs.get(job)
        if a is None:
            a = self.jobs[job] = JobAnalyzer(job, self.settings)
        return a

    def update(self, rec: Any) -> list[msgspec.Struct]:
        out: list[msgspec.Struct] = []
        job = getattr(rec, "job", None)
        if job is None:
            return out
        analyzer = self._job(job)
        if isinstance(rec, Collective | ProxySummary):
            out += self._comm(job, rec.comm_hash, rec)
        else:
            out += analyzer.update(rec)
            for sched in self.books.setdefault(job, ScheduleBook()).update(rec):
                h = sched.comm_hash if isinstance(sched, StepMark) else sched.comm.comm_hash
                out += self._comm(job, h, sched)
        self.now_ns = max(self.now_ns, analyzer.now_ns)
        if self.now_ns >= self._next_tick:
            out += self.tick(self.now_ns)
            self._next_tick = self.now_ns + self.tick_ns
        return out

    def _comm(self, job: str, comm_hash: int, item: Any) -> list[msgspec.Struct]:
        comm = self.comms.get((job, comm_hash))
        if comm is None:
            comm = self.comms[(job, comm_hash)] = CommAnalyzer(
                min_timeout_ns=int(self.settings.partial_timeout_ms * 1e6)
            )
        rows, forward = comm.update([item])
        out: list[msgspec.Struct] = list(rows)
        out += self._to_job(job, forward)
        return out

    def _to_job(self, job: str, items: Iterable[Any]) -> list[msgspec.Struct]:
        """A communicator's items to its job; step parts and progress merged per shard, as
        the flow does."""
        out: list[msgspec.Struct] = []
        analyzer = self.jobs[job]
        for x in items:
            if isinstance(x, StepPart | CommLiveness):
                key = (job, shard_of(x.comm_hash, self.settings.part_shards))
                merger = self.mergers.get(key) or self.mergers.setdefault(key, PartMerger())
                for merged in [*merger.update(x), *merger.progress()]:
                    out += analyzer.update(merged)
            else:
                out += analyzer.update(x)
        return out

    def tick(self, now_ns: int) -> list[msgspec.Struct]:
        out: list[msgspec.Struct] = []
        for (job, _), comm in self.comms.items():
            rows, items = comm.expire(now_ns)
            out += rows
            out += self._to_job(job, items)
            out += comm.stats()
        for a in self.jobs.values():
            out += a.tick(now_ns)
        return out

    def finish(self) -> list[msgspec.Struct]:
        out = self.tick(self.now_ns)
        for (job, _), comm in self.comms.items():
            rows, items = comm.flush()  # held and open instances, as they stand
            out += rows
            out += self._to_job(job, items)
            out += comm.stats(final=True)
        for (job, _), merger in self.mergers.items():
            for x in merger.flush():
                out += self.jobs[job].update(x)
        for a in self.jobs.values():
            out += a.finish()
        return out

    def run(self, records: Iterable[Any]) -> Iterator[msgspec.Struct]:
        for rec in records:
            yield from self.update(rec)
        yield from self.finish()
