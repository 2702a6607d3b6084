"""Bytewax sinks: ClickHouse (embedded or server) for batches of schema records.

Each worker's partition inserts everything Bytewax hands it, one insert per
table, before returning: nothing is held back between batches, so a crash
loses nothing that Bytewax considers written. Tables are ReplacingMergeTree on
natural keys, so an at-least-once replay after recovery does not duplicate.
Items are ``(records, produced_ms)``: the producer time of the oldest record,
or 0, lets a caller measure end-to-end latency through ``on_write``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
from bytewax.outputs import DynamicSink, StatelessSinkPartition

from infra.clickhouse import connect, insert_records

Timed = tuple[list[msgspec.Struct], int]


class _ClickHousePartition(StatelessSinkPartition[Timed]):
    def __init__(
        self, url: str, database: str, on_write: Callable[[int, int, int], None] | None
    ) -> None:
        self._client: Any = connect(url)
        self._database = database
        self._on_write = on_write

    def write_batch(self, items: list[Timed]) -> None:
        records = [r for batch, _ in items for r in batch]
        if records:
            insert_records(self._client, self._database, records)
        if self._on_write is not None:
            now_ms = time.time_ns() // 1_000_000
            for batch, produced_ms in items:
                self._on_write(len(batch), produced_ms, now_ms)


class ClickHouseSink(DynamicSink[Timed]):
    """Writes batches of schema records, each record into its table."""

    def __init__(
        self, url: str, database: str, on_write: Callable[[int, int, int], None] | None = None
    ) -> None:
        self.url = url
        self.database = database
        self.on_write = on_write

    def build(self, step_id: str, worker_index: int, worker_count: int) -> _ClickHousePartition:
        return _ClickHousePartition(self.url, self.database, self.on_write)
