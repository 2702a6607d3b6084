"""A poll's messages decoded (:class:`Decoded`; a refused one becomes a dead letter,
stamped with its Kafka time so that refusing it again gives the same row), and its
records per raw table.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from flows.kafka_source import RawBatch, part_name
from infra.clickhouse import Rows
from infra.rowbinary import plan_for
from schemas.codec import SchemaError, dead_letter, decode_input
from schemas.enums import DeadLetterReason
from schemas.records import (
    DeadLetter,
)
from schemas.tables import TABLE_FOR


@dataclass
class Decoded:
    """One poll's records, decoded; refused ones kept as dead letters.

    ``raw`` keeps each valid record's original JSON (what the raw tables store where
    the RowBinary encoder was not built; elsewhere they are written from the records).
    """

    records: list[msgspec.Struct]
    raw: list[bytes]
    dead: list[DeadLetter]
    produced_ms: int
    kinds: frozenset[type] = frozenset()  # the record types present (a topic holds few)
    part: str = ""  # the source partition they were read from


def decode_batch(batch: RawBatch, retention_days: int = 0) -> Decoded:
    """Decode a poll's messages; a refused one becomes a dead letter stamped with its
    Kafka time, so refusing it again (a replay, another role) gives the same row.

    With ``retention_days``, a record older than the tables' retention is refused too
    (reason ``retention``): ClickHouse would drop it at insert, and nothing derived from
    it would be kept either."""
    records: list[msgspec.Struct] = []
    kept: list[bytes] = []
    dead: list[DeadLetter] = []
    cutoff = time.time_ns() - retention_days * _DAY_NS if retention_days else 0
    time_of = _TIME_OF

    def refuse(m: Any, raw: bytes, err: SchemaError) -> None:
        produced_ms = m.timestamp()[1]
        dead.append(
            dead_letter(
                raw,
                err,
                now_ns=produced_ms * 1_000_000 if produced_ms > 0 else time.time_ns(),
                step_id="decode",
                topic=batch.topic,
                partition=batch.partition,
                offset=m.offset(),
                key=m.key(),
            )
        )

    for m in batch.messages:
        if m.error() is not None:  # an event, no record: the source counted and said it
            continue
        raw = m.value() or b""
        try:
            rec = decode_input(raw)
        except Exception as exc:  # a SchemaError; anything else too: never a poison pill
            refuse(m, raw, exc if isinstance(exc, SchemaError) else _undecodable(exc))
            continue
        if cutoff and time_of[type(rec)](rec) < cutoff:
            refuse(m, raw, _expired(rec, retention_days))
            continue
        records.append(rec)
        kept.append(raw)
    kinds = frozenset(map(type, records))
    part = part_name(batch.topic, batch.partition)
    return Decoded(records, kept, dead, batch.produced_ms, kinds, part)


_DAY_NS = 86_400_000_000_000


#: each record type's time, which its table's partition and retention go by
_TIME_OF = {cls: operator.attrgetter(t.time_field) for cls, t in TABLE_FOR.items()}


def _expired(rec: Any, retention_days: int) -> SchemaError:
    table = TABLE_FOR[type(rec)]
    return SchemaError(
        DeadLetterReason.RETENTION,
        f"{table.time_field} is older than the tables' retention of {retention_days} days "
        f"(clickhouse.retention_days): ClickHouse would drop it at insert; set it to 0, or "
        f"longer, to keep old recordings",
        table.time_field,
    )


def _undecodable(exc: Exception) -> SchemaError:
    return SchemaError(
        DeadLetterReason.MALFORMED, f"could not be decoded ({type(exc).__name__}: {exc})"[:500]
    )


def rows_of(d: Decoded) -> tuple[str, tuple[dict[str, Rows], int]]:
    """The records per ClickHouse table, keyed by the partition read: the records
    themselves where the table is written as ``RowBinary``, else their original JSON."""
    if len(d.kinds) == 1:  # one kind of record, as most topics hold: one table
        (kind,) = d.kinds
        table = TABLE_FOR[kind].name
        return d.part, ({table: d.records if plan_for(table) else d.raw}, d.produced_ms)
    tables = {kind: TABLE_FOR[kind].name for kind in d.kinds}
    binary = {name: plan_for(name) is not None for name in tables.values()}
    rows: dict[str, list[Any]] = {name: [] for name in binary}
    if all(binary.values()):  # every table written from the records
        for rec in d.records:
            rows[tables[type(rec)]].append(rec)
    else:
        for rec, raw in zip(d.records, d.raw, strict=True):
            table = tables[type(rec)]
            rows[table].append(rec if binary[table] else raw)
    return d.part, (rows, d.produced_ms)


def dead_of(d: Decoded) -> list[DeadLetter]:
    return d.dead


def has_dead(d: Decoded) -> bool:
    return bool(d.dead)
