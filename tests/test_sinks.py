"""The raw-row sink on the real embedded ClickHouse engine: inserts run off the flow's
thread, gathered into few large ones; a partition's snapshot (the moment its epoch's
offsets are committed) returns only once its rows are stored, without waiting for a
batch to fill; a failed insert stops the flow with its cause."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from flows.sinks import AsyncClickHouseSink, SinkError
from schemas.codec import encode
from tests.examples import every_record

pytestmark = pytest.mark.integration

PARTS = ["0-megatrace.kernel", "1-megatrace.kernel", "0-megatrace.comm"]


def _rows(n: int, start: int = 0) -> dict[str, list[bytes]]:
    """``n`` distinct heartbeats as the Kafka source would hand them on."""
    hb = next(r for r in every_record() if type(r).__name__ == "Heartbeat")
    return {"heartbeats": [encode(msgspec.structs.replace(hb, ts_ns=start + i)) for i in range(n)]}


def _count(ch: Any, database: str) -> int:
    return ch.query(f"SELECT count() FROM {database}.heartbeats").result_rows[0][0]


def _parts(ch: Any, database: str) -> int:
    """How many inserts made the table's parts (a merge joins them, never splits)."""
    return ch.query(
        "SELECT count() FROM system.parts WHERE database = {db:String} "
        "AND table = 'heartbeats' AND active",
        parameters={"db": database},
    ).result_rows[0][0]


def _until(what: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not what() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_snapshot_returns_once_its_rows_are_stored(
    ch: Any, database: str, clickhouse_url: str
) -> None:
    stored: list[int] = []
    sink = AsyncClickHouseSink(
        clickhouse_url,
        database,
        lambda: list(PARTS),
        on_write=lambda n, p, s: stored.append(n),
        batch_ms=3_600_000,  # only the snapshot makes these rows go in
    )
    assert sink.list_parts() == sorted(PARTS)
    # rows are written by the partition they were read from, named as the source names it
    assert [sink.part_fn(p) for p in sorted(PARTS)] == [0, 1, 2]
    part = sink.build_part("raw", "0-megatrace.kernel", None)
    for i in range(20):
        part.write_batch([(_rows(500, start=i * 500), 0)])
    part.write_batch([(_rows(3, start=10_000), 7), (_rows(2, start=20_000), 5)])
    t0 = time.monotonic()
    part.snapshot()
    assert time.monotonic() - t0 < 30  # it did not wait for the hour
    assert _count(ch, database) == 20 * 500 + 5
    assert sum(stored) == 20 * 500 + 5
    part.write_batch([(_rows(10, start=30_000), 0)])
    part.close()  # the end of a bounded input: nothing left behind
    assert _count(ch, database) == 20 * 500 + 15


def test_rows_go_in_as_few_large_inserts(ch: Any, database: str, clickhouse_url: str) -> None:
    sink = AsyncClickHouseSink(
        clickhouse_url, database, lambda: list(PARTS), batch_rows=1000, batch_ms=3_600_000
    )
    part = sink.build_part("raw", "1-megatrace.kernel", None)
    for i in range(3):
        part.write_batch([(_rows(300, start=i * 300), 0)])
    time.sleep(0.5)
    assert _count(ch, database) == 0  # 900 rows: fewer than a batch, and not due yet
    part.write_batch([(_rows(300, start=900), 0)])
    _until(lambda: _count(ch, database) == 1200)
    assert _count(ch, database) == 1200
    assert _parts(ch, database) == 1  # the four polls went in as one insert
    part.close()


def test_rows_wait_no_longer_than_batch_ms(ch: Any, database: str, clickhouse_url: str) -> None:
    sink = AsyncClickHouseSink(clickhouse_url, database, lambda: list(PARTS), batch_ms=300)
    part = sink.build_part("raw", "1-megatrace.kernel", None)
    part.write_batch([(_rows(10), 0)])
    _until(lambda: _count(ch, database) == 10)
    assert _count(ch, database) == 10  # with no snapshot and no more rows
    part.close()


def test_a_failed_insert_is_raised_in_the_flow_with_its_cause(
    ch: Any, database: str, clickhouse_url: str
) -> None:
    sink = AsyncClickHouseSink(clickhouse_url, f"{database}_missing", lambda: list(PARTS))
    part = sink.build_part("raw", "0-megatrace.comm", None)
    part.write_batch([(_rows(5), 0)])
    with pytest.raises(SinkError, match=f"{database}_missing"):
        part.snapshot()
    with pytest.raises(SinkError):  # and again, until the flow stops
        part.write_batch([(_rows(5), 0)])
    # closing (Bytewax unwinding) does not raise what was raised already: raised again
    # there, it aborted the process instead of ending it
    part.close()


@pytest.mark.parametrize("bad", ["max_pending_rows", "batch_rows", "batch_ms"])
def test_pending_rows_and_batches_are_bounded(bad: str) -> None:
    with pytest.raises(ValueError, match="max_pending_rows, batch_rows and batch_ms"):
        AsyncClickHouseSink("chdb:///nowhere", "db", list, **{bad: 0})
