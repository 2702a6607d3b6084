"""Bytewax sinks: ClickHouse (embedded or server) for batches of schema records.

Each worker's partition inserts everything Bytewax hands it, one insert per
table, before returning: nothing is held back between batches, so a crash
loses nothing that Bytewax considers written. Tables are ReplacingMergeTree on
natural keys, so an at-least-once replay after recovery does not duplicate.
Items are ``(rows_by_table, produced_ms)``: each row is a record's JSON, as it
came from Kafka (ClickHouse parses it itself); the producer time of the oldest
record, or 0, lets a caller measure end-to-end latency through ``on_write``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bytewax.outputs import DynamicSink, StatelessSinkPartition

from infra.clickhouse import connect, insert_json

Timed = tuple[dict[str, list[bytes]], int]


class _ClickHousePartition(StatelessSinkPartition[Timed]):
    def __init__(
        self, url: str, database: str, on_write: Callable[[int, int, int], None] | None
    ) -> None:
        self._client: Any = connect(url)
        self._database = database
        self._on_write = on_write

    def write_batch(self, items: list[Timed]) -> None:
        merged: dict[str, list[bytes]] = {}
        for rows, _ in items:
            for table, batch in rows.items():
                merged.setdefault(table, []).extend(batch)
        for table, batch in merged.items():
            insert_json(self._client, self._database, table, batch)
        if self._on_write is not None:
            now_ms = time.time_ns() // 1_000_000
            for rows, produced_ms in items:
                self._on_write(sum(map(len, rows.values())), produced_ms, now_ms)


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
