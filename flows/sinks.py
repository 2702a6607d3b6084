"""Bytewax sinks: ClickHouse (embedded or server) for schema records.

Each worker's partition inserts the whole batch Bytewax hands it, one insert
per table, before returning: nothing is held back between batches, so a crash
loses nothing that Bytewax considers written. Tables are ReplacingMergeTree on
natural keys, so an at-least-once replay after recovery does not duplicate.
"""

from __future__ import annotations

from typing import Any

import msgspec
from bytewax.outputs import DynamicSink, StatelessSinkPartition

from infra.clickhouse import connect, insert_records


class _ClickHousePartition(StatelessSinkPartition[msgspec.Struct]):
    def __init__(self, url: str, database: str) -> None:
        self._client: Any = connect(url)
        self._database = database

    def write_batch(self, items: list[msgspec.Struct]) -> None:
        if items:
            insert_records(self._client, self._database, items)


class ClickHouseSink(DynamicSink[msgspec.Struct]):
    """Writes any schema record into its table (see :mod:`schemas.tables`)."""

    def __init__(self, url: str, database: str) -> None:
        self.url = url
        self.database = database

    def build(self, step_id: str, worker_index: int, worker_count: int) -> _ClickHousePartition:
        return _ClickHousePartition(self.url, self.database)
