"""Run the detectors over a stream of records, offline or in tests.

:class:`Replay` does what the dataflow does, in one process: one
:class:`~detectors.align.CollectiveAligner` per (job, communicator), one
:class:`~detectors.analyzer.JobAnalyzer` per job, and the hang watchdog
driven by event time (the newest timestamp seen) every ``tick_ns``.

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

from detectors.align import CollectiveAligner
from detectors.analyzer import JobAnalyzer
from schemas.config import DetectSettings
from schemas.records import Collective


class Replay:
    def __init__(self, settings: DetectSettings | None = None, tick_ns: int = 50_000_000) -> None:
        self.settings = settings or DetectSettings()
        self.tick_ns = tick_ns
        self.aligners: dict[tuple[str, int], CollectiveAligner] = {}
        self.jobs: dict[str, JobAnalyzer] = {}
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
        if isinstance(rec, Collective):
            key = (job, rec.comm_hash)
            al = self.aligners.get(key)
            if al is None:
                al = self.aligners[key] = CollectiveAligner(
                    min_timeout_ns=int(self.settings.partial_timeout_ms * 1e6)
                )
            for inst in al.update(rec):
                out += analyzer.update(inst)
        else:
            out += analyzer.update(rec)
        self.now_ns = max(self.now_ns, analyzer.now_ns)
        if self.now_ns >= self._next_tick:
            out += self.tick(self.now_ns)
            self._next_tick = self.now_ns + self.tick_ns
        return out

    def tick(self, now_ns: int) -> list[msgspec.Struct]:
        out: list[msgspec.Struct] = []
        for (job, _), al in self.aligners.items():
            for inst in al.expire(now_ns):
                out += self.jobs[job].update(inst)
        for a in self.jobs.values():
            out += a.tick(now_ns)
        return out

    def finish(self) -> list[msgspec.Struct]:
        out = self.tick(self.now_ns)
        for a in self.jobs.values():
            out += a.finish()
        return out

    def run(self, records: Iterable[Any]) -> Iterator[msgspec.Struct]:
        for rec in records:
            yield from self.update(rec)
        yield from self.finish()
