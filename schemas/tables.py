"""ClickHouse tables, derived from the record types so each type is defined once.

Every table is a ``ReplacingMergeTree`` ordered by the record's natural key, so
replaying the same input (an at-least-once restart) never duplicates a row
once merged; queries that must be exact read with ``FINAL``. Verdicts replace
by ``revision``, so the latest update of an incident wins. Timestamps become
``DateTime64(9, 'UTC')``; enums ``LowCardinality(String)``; nested records
named tuples; each table is partitioned by day and expires by TTL.

>>> print(TABLES["heartbeats"].ddl("mt", retention_days=7))  # doctest: +NORMALIZE_WHITESPACE
CREATE TABLE IF NOT EXISTS mt.heartbeats (
  v Int64, job String, node String, rank Int64, clock LowCardinality(String),
  ts_ns DateTime64(9, 'UTC'), pid Int64, step Nullable(Int64),
  comms Array(Tuple(comm_hash UInt64, issued_seq Int64, completed_seq Int64))
) ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(ts_ns)
ORDER BY (job, rank, ts_ns)
TTL toDateTime(ts_ns) + INTERVAL 7 DAY
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import msgspec.inspect as mi

from schemas.records import (
    AlignedCollective,
    Collective,
    CommInfo,
    DeadLetter,
    FaultLabel,
    Heartbeat,
    JobInfo,
    Kernel,
    LinkSample,
    ProxySummary,
    RankInfo,
    RankStep,
    StepSummary,
    Verdict,
)

_DATETIME = "DateTime64(9, 'UTC')"


def _ch_type(t: mi.Type) -> str:
    """The ClickHouse column type of a msgspec type."""
    if isinstance(t, mi.Metadata):
        if t.extra and "clickhouse" in t.extra:
            return t.extra["clickhouse"]
        return _ch_type(t.type)
    if isinstance(t, mi.UnionType):
        inner = [x for x in t.types if not isinstance(x, mi.NoneType)]
        if len(inner) != 1 or len(inner) == len(t.types):
            raise TypeError(f"only `T | None` unions map to ClickHouse, got {t}")
        base = _ch_type(inner[0])
        if base.startswith("LowCardinality("):
            return f"LowCardinality(Nullable({base[len('LowCardinality(') : -1]}))"
        return f"Nullable({base})"
    if isinstance(t, mi.BoolType):
        return "Bool"
    if isinstance(t, mi.IntType):
        return "Int64"
    if isinstance(t, mi.FloatType):
        return "Float64"
    if isinstance(t, mi.StrType | mi.BytesType):
        return "String"
    if isinstance(t, mi.EnumType):
        return "LowCardinality(String)"
    if isinstance(t, mi.ListType):
        return f"Array({_ch_type(t.item_type)})"
    if isinstance(t, mi.DictType):
        return f"Map({_ch_type(t.key_type)}, {_ch_type(t.value_type)})"
    if isinstance(t, mi.StructType):
        parts = ", ".join(f"{f.name} {_ch_type(f.type)}" for f in t.fields)
        return f"Tuple({parts})"
    raise TypeError(f"no ClickHouse type for {t}")


def _to_value(t: mi.Type) -> Callable[[Any], Any]:
    """A converter from a record attribute to what clickhouse-connect inserts."""
    if isinstance(t, mi.Metadata):
        return _to_value(t.type)
    if isinstance(t, mi.UnionType):
        (inner,) = [x for x in t.types if not isinstance(x, mi.NoneType)]
        conv = _to_value(inner)
        return lambda x: None if x is None else conv(x)
    if isinstance(t, mi.EnumType):
        return lambda x: x.value
    if isinstance(t, mi.ListType):
        conv = _to_value(t.item_type)
        return lambda xs: [conv(x) for x in xs]
    if isinstance(t, mi.StructType):
        convs = [(f.name, _to_value(f.type)) for f in t.fields]
        return lambda s: tuple(c(getattr(s, n)) for n, c in convs)
    return lambda x: x


@dataclass(frozen=True)
class Table:
    """One ClickHouse table holding one record type."""

    name: str
    record: type[msgspec.Struct]
    order_by: tuple[str, ...]
    time_column: str
    version_column: str | None = None
    _columns: list[tuple[str, str]] = field(init=False, repr=False)
    _nested: list[tuple[int, Callable[[Any], Any]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        info = mi.type_info(self.record)
        assert isinstance(info, mi.StructType)
        object.__setattr__(self, "_columns", [(f.name, _ch_type(f.type)) for f in info.fields])
        nested = [(i, _to_value(f.type)) for i, f in enumerate(info.fields) if _has_struct(f.type)]
        object.__setattr__(self, "_nested", nested)

    @property
    def columns(self) -> list[tuple[str, str]]:
        """(name, ClickHouse type) for every column, in record order."""
        return list(self._columns)

    @property
    def column_names(self) -> list[str]:
        return [n for n, _ in self._columns]

    def ddl(self, database: str, retention_days: int) -> str:
        """``CREATE TABLE IF NOT EXISTS`` for this table; ``retention_days=0`` keeps forever."""
        cols = ", ".join(f"{n} {t}" for n, t in self._columns)
        engine = (
            f"ReplacingMergeTree({self.version_column})"
            if self.version_column
            else ("ReplacingMergeTree")
        )
        ttl = (
            f"\nTTL toDateTime({self.time_column}) + INTERVAL {retention_days} DAY"
            if retention_days > 0
            else ""
        )
        return (
            f"CREATE TABLE IF NOT EXISTS {database}.{self.name} (\n  {cols}\n) "
            f"ENGINE = {engine}\nPARTITION BY toYYYYMMDD({self.time_column})\n"
            f"ORDER BY ({', '.join(self.order_by)}){ttl}"
        )

    def to_row(self, record: msgspec.Struct) -> list[Any]:
        """The row to insert for a record, in :attr:`column_names` order."""
        if type(record) is not self.record:
            raise TypeError(f"table {self.name} holds {self.record.__name__}, got {record!r}")
        row = list(msgspec.structs.astuple(record))
        for i, conv in self._nested:  # only nested records need converting
            row[i] = conv(row[i])
        return row

    def select_list(self) -> str:
        """Columns to select so that :meth:`from_row` rebuilds the exact record."""
        return ", ".join(
            f"toUnixTimestamp64Nano({n}) AS {n}"
            if t.endswith(_DATETIME) or t == (f"Nullable({_DATETIME})")
            else n
            for n, t in self._columns
        )

    @property
    def bytes_columns(self) -> list[str]:
        """Columns holding raw bytes (read back as bytes, not text)."""
        info = mi.type_info(self.record)
        assert isinstance(info, mi.StructType)
        return [f.name for f in info.fields if _is_bytes(f.type)]

    def from_row(self, row: Mapping[str, Any]) -> Any:
        """The record a selected row (as a name -> value mapping) stands for."""
        return msgspec.convert(dict(row), self.record, strict=False)


def _has_struct(t: mi.Type) -> bool:
    if isinstance(t, mi.Metadata):
        return _has_struct(t.type)
    if isinstance(t, mi.UnionType):
        return any(_has_struct(x) for x in t.types)
    if isinstance(t, mi.ListType):
        return _has_struct(t.item_type)
    return isinstance(t, mi.StructType)


def _is_bytes(t: mi.Type) -> bool:
    if isinstance(t, mi.Metadata):
        return _is_bytes(t.type)
    if isinstance(t, mi.UnionType):
        return any(_is_bytes(x) for x in t.types)
    return isinstance(t, mi.BytesType)


_TABLE_LIST: Sequence[Table] = (
    Table("jobs", JobInfo, ("job",), "ts_ns"),
    Table("ranks", RankInfo, ("job", "rank"), "ts_ns"),
    Table("comms", CommInfo, ("job", "comm_hash"), "ts_ns"),
    Table("collective_events", Collective, ("job", "comm_hash", "seq", "rank"), "enqueue_ns"),
    Table(
        "proxy_events",
        ProxySummary,
        ("job", "comm_hash", "seq", "rank", "channel", "peer", "direction"),
        "first_ns",
    ),
    Table(
        "kernel_events", Kernel, ("job", "node", "rank", "start_ns", "correlation_id"), "start_ns"
    ),
    Table("heartbeats", Heartbeat, ("job", "rank", "ts_ns"), "ts_ns"),
    Table("link_samples", LinkSample, ("job", "src_rank", "dst_rank", "nic", "ts_ns"), "ts_ns"),
    Table("collectives", AlignedCollective, ("job", "comm_hash", "seq"), "first_arrival_ns"),
    Table("rank_steps", RankStep, ("job", "step", "rank"), "start_ns"),
    Table("steps", StepSummary, ("job", "step"), "start_ns"),
    Table("verdicts", Verdict, ("job", "verdict_id"), "detected_ns", version_column="revision"),
    Table("fault_labels", FaultLabel, ("job", "fault_id"), "onset_ns"),
    Table(
        "dead_letters",
        DeadLetter,
        ("topic", "partition", "offset", "ts_ns", "cityHash64(raw)"),
        "ts_ns",
    ),
)

#: Every table by name.
TABLES: dict[str, Table] = {t.name: t for t in _TABLE_LIST}
#: The table holding each record type.
TABLE_FOR: dict[type[msgspec.Struct], Table] = {t.record: t for t in _TABLE_LIST}


def table_for(record: msgspec.Struct) -> Table:
    try:
        return TABLE_FOR[type(record)]
    except KeyError:
        raise TypeError(f"no ClickHouse table holds {type(record).__name__}") from None


__all__ = ["TABLES", "TABLE_FOR", "Table", "table_for"]
