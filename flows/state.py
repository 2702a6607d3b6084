"""Keyed state for the dataflow: thin wrappers that hand items to the detectors.

Each logic owns one detector object (pure, picklable) and adds only what the
stream needs: timers (``notify_at``) so that silence is noticed, and an
event-time clock that advances with the wall clock once the input goes
quiet (a hung job may send nothing at all).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from itertools import chain
from typing import Any, NamedTuple

import msgspec
from bytewax.operators import StatefulBatchLogic

from detectors.comm import CommAnalyzer
from detectors.job import JobAnalyzer
from detectors.merge import CommLiveness, PartMerger
from detectors.node import NodeAnalyzer, NodeDigest
from detectors.parts import StepPart
from detectors.schedule import CommSchedule, ScheduleBook, StepMark
from flows.kafka_source import BrokerHealth
from schemas.config import DetectSettings
from schemas.records import Collective
from schemas.results import AlignedCollective, AlignStats

#: How often timers fire, and how long the input must be quiet before the
#: event-time clock starts following the wall clock.
TICK = timedelta(milliseconds=100)
QUIET_NS = 1_000_000_000


class _Clock:
    """Event time that keeps moving when records stop arriving, except while the
    broker is away (``health``): that silence is the pipeline's, not the jobs'.

    >>> from flows.kafka_source import BrokerHealth
    >>> health = BrokerHealth()
    >>> clock, blind = _Clock(health), _Clock()
    >>> for c in (clock, blind):
    ...     c.saw(10**9)
    ...     c.wall_ns -= 5 * 10**9  # the last record came 5 s ago
    >>> health.lost(clock.wall_ns + 2 * 10**9)  # and the broker went away 3 s ago
    >>> round((blind.now() - 10**9) / 1e9), round((clock.now() - 10**9) / 1e9)
    (4, 1)
    """

    def __init__(self, health: BrokerHealth | None = None) -> None:
        self.event_ns = 0
        self.wall_ns = time.monotonic_ns()
        self.health = health

    def saw(self, event_ns: int) -> None:
        self.event_ns = max(self.event_ns, event_ns)
        self.wall_ns = time.monotonic_ns()

    def moved(self, event_ns: int) -> None:
        """Like :meth:`saw`, but only time that moved on counts as news: the clock runs
        on by the wall while the input shows nothing newer (only old records, or none)."""
        if event_ns > self.event_ns:
            self.saw(event_ns)

    def now(self) -> int:
        wall = time.monotonic_ns()
        quiet = wall - self.wall_ns
        if self.health is not None:
            quiet -= self.health.away_ns(self.wall_ns, wall)
        return self.event_ns + max(0, quiet - QUIET_NS)


def _one(items: list[Any]) -> list[list[Any]]:
    """Emit a whole batch as one item (Bytewax's cost is per item, not per record)."""
    return [items] if items else []


def _next_tick() -> datetime:
    return datetime.now(UTC) + TICK


class AlignOut(NamedTuple):
    """One batch's output of a communicator: stored rows (its aligned collectives, and
    its counts when they changed), and items for the job's analysis."""

    rows: list[AlignedCollective | AlignStats]
    forward: list[Any]


class AlignLogic(StatefulBatchLogic[list[Any], AlignOut, tuple[CommAnalyzer, int]]):
    """Per (job, communicator): records and schedules in, :class:`AlignOut` batches out."""

    def __init__(
        self,
        settings: DetectSettings,
        resume: tuple[CommAnalyzer, int] | None,
        health: BrokerHealth | None = None,
    ) -> None:
        self.clock = _Clock(health)
        if resume is None:
            self.comm = CommAnalyzer(min_timeout_ns=int(settings.partial_timeout_ms * 1e6))
        else:
            self.comm, event_ns = resume
            self.clock.saw(event_ns)
        self.ended = False

    def on_batch(self, values: list[list[Any]]) -> tuple[list[AlignOut], bool]:
        items = values[0] if len(values) == 1 else [x for batch in values for x in batch]
        rows, forward = self.comm.update(items)
        for rec in reversed(items):
            if isinstance(rec, Collective):
                self.clock.saw(rec.arrival_ns)
                break
        more, expired = self.comm.expire(self.clock.now())
        forward += expired
        return _out([*rows, *more, *self.comm.stats()], forward), StatefulBatchLogic.RETAIN

    def on_notify(self) -> tuple[list[AlignOut], bool]:
        rows, forward = self.comm.expire(self.clock.now())
        return _out([*rows, *self.comm.stats()], forward), StatefulBatchLogic.RETAIN

    def on_eof(self) -> tuple[list[AlignOut], bool]:
        """End of a bounded input: whatever is still open is reported as it stands."""
        self.ended = True
        rows, forward = self.comm.flush()
        return _out([*rows, *self.comm.stats(final=True)], forward), StatefulBatchLogic.RETAIN

    def notify_at(self) -> datetime | None:
        # no timer after the end of a bounded input: a pending timer keeps the flow alive
        busy = self.comm.n_open or self.comm.folder.n_held
        return _next_tick() if busy and not self.ended else None

    def snapshot(self) -> tuple[CommAnalyzer, int]:
        # Bytewax pickles a snapshot at the epoch boundary, before this logic runs again,
        # so the live object is safe to hand over (a deep copy would cost every epoch a
        # copy of every communicator's state).
        return self.comm, self.clock.event_ns


def _out(rows: list[AlignedCollective | AlignStats], forward: list[Any]) -> list[AlignOut]:
    return [AlignOut(rows, forward)] if rows or forward else []


def schedules(
    book: ScheduleBook | None, meta: list[Any]
) -> tuple[ScheduleBook, list[CommSchedule | StepMark]]:
    """Per job: the communicator schedules its metadata records complete or change, and
    its iteration markers for every communicator."""
    book = book or ScheduleBook()
    out: list[CommSchedule | StepMark] = []
    for rec in meta:
        out += book.update(rec)
    return book, out


Merged = StepPart | CommLiveness


class MergeLogic(StatefulBatchLogic[list[Merged], list[Merged], PartMerger]):
    """Per (job, shard): communicators' step parts and progress in; one merged part per
    step, and the newest progress once per batch, out."""

    def __init__(self, resume: PartMerger | None) -> None:
        self.merger = resume or PartMerger()

    def on_batch(self, values: list[list[Merged]]) -> tuple[list[list[Merged]], bool]:
        out: list[Merged] = []
        for batch in values:
            for part in batch:
                out += self.merger.update(part)
        out += self.merger.progress()
        return _one(out), StatefulBatchLogic.RETAIN

    def on_eof(self) -> tuple[list[list[Merged]], bool]:
        return _one([*self.merger.flush(), *self.merger.progress()]), StatefulBatchLogic.RETAIN

    def snapshot(self) -> PartMerger:
        return self.merger  # pickled at the epoch boundary, before the next batch (see above)


class NodeLogic(StatefulBatchLogic[list[Any], list[NodeDigest], NodeAnalyzer]):
    """Per (job, node): link samples in, one digest per batch out."""

    def __init__(self, settings: DetectSettings, resume: NodeAnalyzer | None) -> None:
        self.node = resume or NodeAnalyzer(settings.warmup_steps, settings.link_drop)

    def on_batch(self, values: list[list[Any]]) -> tuple[list[list[NodeDigest]], bool]:
        digest = self.node.update(x for batch in values for x in batch)
        return ([[digest]] if digest is not None else []), StatefulBatchLogic.RETAIN

    def snapshot(self) -> NodeAnalyzer:
        return self.node  # pickled at the epoch boundary, before the next batch (see above)


class AnalyzeLogic(StatefulBatchLogic[list[Any], list[msgspec.Struct], tuple[JobAnalyzer, int]]):
    """Per job: instances and records in, tables and verdicts out; the hang watchdog.

    Bytewax builds keyed state without telling it the key, so the analyzer is
    created with the job id of the first item it receives. The watchdog's clock
    is the collectives' (see :meth:`JobAnalyzer.tick`): topics are read at
    different paces, and other records running ahead are not the job's silence.
    """

    def __init__(
        self,
        settings: DetectSettings,
        resume: tuple[JobAnalyzer, int] | None,
        health: BrokerHealth | None = None,
    ) -> None:
        self.settings = settings
        self.clock = _Clock(health)
        self.analyzer: JobAnalyzer | None = None
        self.ended = False
        if resume is not None:
            self.analyzer, event_ns = resume
            self.clock.saw(event_ns)

    def on_batch(self, values: list[list[Any]]) -> tuple[list[list[msgspec.Struct]], bool]:
        if self.analyzer is None:
            self.analyzer = JobAnalyzer(values[0][0].job, self.settings)
        # every batch at once, in order: the job takes a run of items together
        out = self.analyzer.update_many(chain.from_iterable(values))
        self.clock.moved(self.analyzer.coll_now_ns)
        out += self.analyzer.tick(self.clock.now())
        return _one(out), StatefulBatchLogic.RETAIN

    def on_notify(self) -> tuple[list[list[msgspec.Struct]], bool]:
        if self.analyzer is None:
            return [], StatefulBatchLogic.RETAIN
        return _one(self.analyzer.tick(self.clock.now())), StatefulBatchLogic.RETAIN

    def on_eof(self) -> tuple[list[list[msgspec.Struct]], bool]:
        self.ended = True
        if self.analyzer is None:
            return [], StatefulBatchLogic.RETAIN
        return _one(self.analyzer.finish()), StatefulBatchLogic.RETAIN

    def notify_at(self) -> datetime | None:
        return None if self.ended else _next_tick()

    def snapshot(self) -> tuple[JobAnalyzer, int] | None:
        if self.analyzer is None:
            return None
        return self.analyzer, self.analyzer.coll_now_ns


#: one table's rows (records; JSON in a snapshot of an older version), the oldest producer
#: time (ms, 0: none)
TableRows = tuple[list[Any], int]


class RowBatchLogic(StatefulBatchLogic[TableRows, TableRows, TableRows]):
    """Per ClickHouse table: the flow's own rows gathered into few, large inserts.

    Emits once ``max_rows`` are gathered, when the oldest has waited ``max_ms``, and at
    the end of a bounded input. What it holds is in its snapshot, so a flow restarted
    from its recovery store inserts it then (each insert is a part in ClickHouse: a
    step's one row of a job, inserted alone, would make a part a step).
    """

    def __init__(self, max_rows: int, max_ms: int, resume: TableRows | None) -> None:
        self.max_rows = max_rows
        self.max_wait = timedelta(milliseconds=max_ms)
        self.rows, self.produced_ms = resume if resume is not None else ([], 0)
        self.since = datetime.now(UTC) if self.rows else None

    def on_batch(self, values: list[TableRows]) -> tuple[list[TableRows], bool]:
        for rows, produced_ms in values:
            self.rows += rows
            if produced_ms and (not self.produced_ms or produced_ms < self.produced_ms):
                self.produced_ms = produced_ms
        if self.since is None:
            self.since = datetime.now(UTC)
        if len(self.rows) >= self.max_rows:
            return self._emit(), StatefulBatchLogic.RETAIN
        return [], StatefulBatchLogic.RETAIN

    def on_notify(self) -> tuple[list[TableRows], bool]:
        return self._emit(), StatefulBatchLogic.RETAIN

    def on_eof(self) -> tuple[list[TableRows], bool]:
        return self._emit(), StatefulBatchLogic.RETAIN

    def notify_at(self) -> datetime | None:
        return None if self.since is None else self.since + self.max_wait

    def snapshot(self) -> TableRows:
        return list(self.rows), self.produced_ms

    def _emit(self) -> list[TableRows]:
        out = [(self.rows, self.produced_ms)] if self.rows else []
        self.rows, self.produced_ms, self.since = [], 0, None
        return out
