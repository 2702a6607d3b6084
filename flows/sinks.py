"""Bytewax sinks: ClickHouse (embedded or server) for batches of schema records.

Items carry each table's rows, as the records themselves (the insert encodes
them as ``RowBinary``, see :func:`~infra.clickhouse.insert_rows`) or as their JSON
as it came from Kafka (where the compiled encoder was not built), with the producer
time of the oldest record (or 0), which lets a caller measure end-to-end latency
through ``on_write``. Tables are ReplacingMergeTree on natural keys, so an at-least-once
replay after recovery does not duplicate.

Two sinks, one guarantee: nothing Bytewax considers written is lost.

* :class:`ClickHouseSink` (dead letters: few) inserts what it is handed, one
  insert per table, before returning.
* :class:`AsyncClickHouseSink` (every input record, the largest volume; and the
  flow's own rows, gathered per table) hands its rows to an insert thread and
  returns at once, so ClickHouse parses while the flow goes on, and a slow insert
  (a server far away, a busy engine) does not hold up detection: the embedded
  engine parses in the flow's own process and releases the GIL meanwhile. The
  thread gathers what it is handed into few, large inserts (see
  :class:`InsertThread`). The sink's partitions are named by the caller: the raw
  rows' are the source's (one per Kafka topic partition, keyed as
  :func:`~flows.kafka_source.part_name` names them), so rows stay on the worker
  that read them; the flow's own rows' are the tables. Each partition's snapshot
  waits for its rows' inserts: an epoch, and the offsets it holds, is committed
  only once everything it handed over is stored. The thread holds at most
  ``max_pending_rows`` rows; beyond that a write waits (backpressure). An insert
  that fails is raised again by the partitions' next write, snapshot or close,
  so the flow stops and resumes from its last committed epoch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from bytewax.outputs import (
    DynamicSink,
    FixedPartitionedSink,
    StatefulSinkPartition,
    StatelessSinkPartition,
)

from infra.clickhouse import (
    ClickHouseError,
    Rows,
    StoreUnavailable,
    connect,
    insert_rows,
    store_rows,
)
from schemas.codec import encode
from schemas.config import ClickHouseSettings
from schemas.enums import DeadLetterReason
from schemas.records import DeadLetter
from schemas.tables import TABLES

Timed = tuple[dict[str, Rows], int]  # rows per table, the oldest producer time (ms, 0: none)
OnWrite = Callable[[int, int, int], None]  # (records, oldest producer ms, stored ms)
_CLICKHOUSE = ClickHouseSettings()  # the defaults' one home
log = logging.getLogger(__name__)


class SinkError(RuntimeError):
    """An insert into ClickHouse failed; the flow must stop and resume from its recovery."""


def _by_table(items: list[Timed]) -> dict[str, Rows]:
    merged: dict[str, list[Any]] = {}
    for rows, _ in items:
        for table, batch in rows.items():
            merged.setdefault(table, []).extend(batch)
    return merged


def _insert(client: Any, database: str, items: list[Timed], on_write: OnWrite | None) -> None:
    """One insert per table for ``items``, then ``on_write`` per item. Rows ClickHouse
    refuses for what they hold, even alone, are kept as dead letters (reason
    ``refused_by_store``, the record's JSON as its bytes), and the rest stored; a store
    that cannot take inserts raises :class:`~infra.clickhouse.StoreUnavailable`."""
    refused: list[DeadLetter] = []
    for table, batch in _by_table(items).items():
        for row, error in store_rows(client, database, table, batch):
            refused.append(_refused(table, row, error))
    if refused:
        insert_rows(client, database, "dead_letters", refused)
        log.error(
            "ClickHouse refused %d row(s) even alone, kept as dead letters (reason "
            "refused_by_store), the first of %s: %s",
            len(refused),
            refused[0].step_id.removeprefix("store:"),
            refused[0].error,
        )
    if on_write is not None:
        now_ms = time.time_ns() // 1_000_000
        for rows, produced_ms in items:
            on_write(sum(map(len, rows.values())), produced_ms, now_ms)


def _refused(table: str, row: Any, error: str) -> DeadLetter:
    raw = row if isinstance(row, bytes) else encode(row)
    return DeadLetter(
        ts_ns=TABLES[table].time_ns(row),  # the row's own time: the same letter on a replay
        reason=DeadLetterReason.REFUSED_BY_STORE,
        error=f"ClickHouse refused this {table} row: {error}",
        step_id=f"store:{table}",
        raw=raw,
    )


class _ClickHousePartition(StatelessSinkPartition[Timed]):
    def __init__(self, url: str, database: str, on_write: OnWrite | None) -> None:
        self._client: Any = connect(url)
        self._database = database
        self._on_write = on_write

    def write_batch(self, items: list[Timed]) -> None:
        _insert(self._client, self._database, items, self._on_write)


class ClickHouseSink(DynamicSink[Timed]):
    """Writes batches of schema records, each record into its table, before returning."""

    def __init__(self, url: str, database: str, on_write: OnWrite | None = None) -> None:
        self.url = url
        self.database = database
        self.on_write = on_write

    def build(self, step_id: str, worker_index: int, worker_count: int) -> _ClickHousePartition:
        return _ClickHousePartition(self.url, self.database, self.on_write)


class InsertThread:
    """Inserts handed over by :meth:`submit`, in order, on a thread of its own.

    Submissions are gathered into one insert per table until ``batch_rows`` rows
    are queued or the oldest has waited ``batch_ms``: each insert makes a part and
    costs the engine a fixed amount of CPU whatever its size, so inserting every poll
    as it came would spend the engine's time on inserts. Rows
    gathered already go in as soon as the thread is free with ``batch_rows=1``.
    :meth:`wait` returns once a submission is stored, and inserts at once what it
    waits for; both raise :class:`SinkError` after a failed insert. The thread has a
    client of its own (a server's client must not be shared between threads) and
    stops, after inserting what is queued, when :meth:`release` has been called as
    often as :meth:`acquire`.
    """

    def __init__(
        self,
        url: str,
        database: str,
        on_write: OnWrite | None,
        *,
        max_pending_rows: int,
        batch_rows: int,
        batch_ms: int,
        outage_wait_s: float = _CLICKHOUSE.outage_wait_s,
    ) -> None:
        if max_pending_rows < 1 or batch_rows < 1 or batch_ms < 1:
            raise ValueError("max_pending_rows, batch_rows and batch_ms must be at least 1")
        self.outage_wait_s = outage_wait_s
        self.url = url
        self.database = database
        self.on_write = on_write
        self.max_pending_rows = max_pending_rows
        self.batch_rows = min(batch_rows, max_pending_rows)
        self.batch_s = batch_ms / 1000
        self._cond = threading.Condition()
        self._queue: list[tuple[int, Timed, int]] = []  # (ticket, item, rows)
        self._oldest = 0.0  # when the oldest queued submission came (monotonic s)
        self._pending_rows = 0
        self._submitted = 0
        self._stored = 0
        self._wanted = 0  # the newest ticket someone waits for: insert it now
        self._error: BaseException | None = None
        self._reported = False  # the error was raised to the flow once: never again
        self._users = 0
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        with self._cond:
            self._users += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="megatrace-clickhouse-insert", daemon=True
                )
                self._thread.start()

    def release(self) -> None:
        with self._cond:
            self._users -= 1
            self._cond.notify_all()
            thread = self._thread if self._users <= 0 else None
        if thread is not None:
            thread.join()
            with self._cond:
                if self._users <= 0 and self._thread is thread:
                    self._thread = None
        self._raise(closing=True)

    def submit(self, item: Timed) -> int:
        """Queue ``item``; return its ticket for :meth:`wait`."""
        n = sum(map(len, item[0].values()))
        with self._cond:
            self._raise()
            while (
                self._pending_rows + n > self.max_pending_rows
                and self._queue
                and self._error is None
            ):
                self._wanted = max(self._wanted, self._queue[-1][0])  # make room now
                self._cond.notify_all()
                self._cond.wait()  # backpressure: the flow waits for room
            self._raise()
            if not self._queue:
                self._oldest = time.monotonic()
            self._submitted += 1
            self._queue.append((self._submitted, item, n))
            self._pending_rows += n
            if len(self._queue) == 1 or self._pending_rows >= self.batch_rows:
                self._cond.notify_all()  # the thread times the first; inserts a full batch
            return self._submitted

    def wait(self, ticket: int, closing: bool = False) -> None:
        """Block until submission ``ticket`` (and every earlier one) is stored."""
        with self._cond:
            if self._stored < ticket:
                self._wanted = max(self._wanted, ticket)
                self._cond.notify_all()
            while self._stored < ticket and self._error is None:
                self._cond.wait()
            self._raise(closing)

    def _raise(self, closing: bool = False) -> None:
        """Raise a failed insert's error in the flow's thread: Bytewax stops the flow on it.
        Closing the sink's partitions on the way out raises it only if it was never
        raised (an error raised again while Bytewax unwinds aborts the process instead of
        ending it)."""
        if self._error is None or (closing and self._reported):
            return
        self._reported = True
        raise SinkError(f"an insert into ClickHouse failed: {self._error}") from self._error

    def _due(self) -> float:
        """Seconds until the queue is due for its insert (0: now)."""
        if self._users <= 0 or self._pending_rows >= self.batch_rows:
            return 0.0
        if self._wanted >= self._queue[0][0]:
            return 0.0
        return max(0.0, self._oldest + self.batch_s - time.monotonic())

    def _run(self) -> None:
        client: Any = None
        while True:
            with self._cond:
                while True:
                    if not self._queue:
                        if self._users <= 0:
                            return  # released by everyone and drained
                        self._cond.wait()
                        continue
                    due = self._due()
                    if due <= 0:
                        break
                    self._cond.wait(due)
                batch, self._queue = self._queue, []
            try:
                client = self._store(client, [item for _, item, _ in batch])
            except BaseException as exc:  # kept and raised in the flow's own thread
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._stored = batch[-1][0]
                self._pending_rows -= sum(n for _, _, n in batch)
                self._cond.notify_all()

    def _store(self, client: Any, items: list[Timed]) -> Any:
        """Insert ``items``, trying again while ClickHouse cannot take them, for
        ``outage_wait_s``; returns the client (made here the first time)."""
        since = time.monotonic()
        told = 0.0
        while True:
            try:
                client = client or connect(self.url)
                _insert(client, self.database, items, self.on_write)
                return client
            except (ClickHouseError, OSError) as exc:
                if isinstance(exc, StoreUnavailable) and not exc.passing:
                    raise  # an operator must act: trying again cannot help
                waited = time.monotonic() - since
                if waited >= self.outage_wait_s:
                    raise StoreUnavailable(
                        f"ClickHouse could not take inserts for {waited:.0f} s: {exc}", True
                    ) from exc
                if time.monotonic() - told >= 30:
                    told = time.monotonic()
                    log.warning(
                        "ClickHouse cannot take inserts (%s); trying again for up to %.0f s",
                        exc,
                        self.outage_wait_s - waited,
                    )
                time.sleep(min(2.0, max(0.05, self.outage_wait_s - waited)))


class _AsyncPartition(StatefulSinkPartition[Timed, None]):
    def __init__(self, inserts: InsertThread) -> None:
        self._inserts = inserts
        self._last = 0
        inserts.acquire()

    def write_batch(self, items: list[Timed]) -> None:
        if len(items) == 1:
            self._last = self._inserts.submit(items[0])
            return
        oldest = min((p for _, p in items if p > 0), default=0)
        self._last = self._inserts.submit((_by_table(items), oldest))

    def snapshot(self) -> None:
        # the epoch's offsets are committed with this snapshot: its rows must be stored
        self._inserts.wait(self._last)

    def close(self) -> None:
        try:
            self._inserts.wait(self._last, closing=True)
        finally:
            self._inserts.release()


class AsyncClickHouseSink(FixedPartitionedSink[Timed, None]):
    """Rows inserted off the flow's thread, into their tables (see the module docstring).
    ``list_parts`` lists the partitions (for raw rows the source's, for the flow's own
    rows its tables); items are keyed by partition."""

    def __init__(
        self,
        url: str,
        database: str,
        list_parts: Callable[[], list[str]],
        *,
        on_write: OnWrite | None = None,
        max_pending_rows: int = 100_000,
        batch_rows: int = _CLICKHOUSE.batch_rows,
        batch_ms: int = _CLICKHOUSE.raw_batch_ms,
        outage_wait_s: float = _CLICKHOUSE.outage_wait_s,
    ) -> None:
        self._list_parts = list_parts
        self._parts: dict[str, int] | None = None  # partition -> its place in the sorted list
        self._inserts = InsertThread(
            url,
            database,
            on_write,
            max_pending_rows=max_pending_rows,
            batch_rows=batch_rows,
            batch_ms=batch_ms,
            outage_wait_s=outage_wait_s,
        )

    def _index(self) -> dict[str, int]:
        if self._parts is None:
            self._parts = {p: i for i, p in enumerate(sorted(self._list_parts()))}
        return self._parts

    def list_parts(self) -> list[str]:
        return list(self._index())

    def part_fn(self, item_key: str) -> int:
        # the sink partition named like the source partition the rows came from: Bytewax
        # makes the same worker primary for both (the same names listed on every worker)
        return self._index()[item_key]

    def build_part(self, step_id: str, for_part: str, resume_state: None) -> _AsyncPartition:
        return _AsyncPartition(self._inserts)
