"""ClickHouse tables, derived from the record types so each type is defined once.

Every table is a ``ReplacingMergeTree`` ordered by the record's natural key, so
replaying the same input (an at-least-once restart) never duplicates a row
once merged; queries that must be exact read with ``FINAL``. Verdicts replace
by ``revision``, so the latest update of an incident wins. Rows are inserted
as ``RowBinary`` written from the records by these column types
(``infra/rowbinary.py``), or as the records' own JSON (``JSONEachRow``).
Timestamps are kept as ``Int64`` nanoseconds exactly as on the wire, and each
gets a ``DateTime64(9, 'UTC')`` column materialized from it (``ts_ns`` ->
``ts``) for partitioning, TTL and Grafana's time filters. Enums are
``LowCardinality(String)``; nested records named tuples.

>>> print(TABLES["heartbeats"].ddl("mt", retention_days=7))  # doctest: +NORMALIZE_WHITESPACE
CREATE TABLE IF NOT EXISTS mt.heartbeats (
  v Int64, job String, node String, rank Int64, clock LowCardinality(String), ts_ns Int64,
  pid Int64, step Nullable(Int64),
  comms Array(Tuple(comm_hash UInt64, issued_seq Int64, completed_seq Int64)),
  cpu_ns Nullable(Int64), cpu_wait_ns Nullable(Int64), cpu_throttled_ns Nullable(Int64),
  save_ns Nullable(Int64), saving_since_ns Nullable(Int64), exiting Bool,
  ts DateTime64(9, 'UTC') MATERIALIZED fromUnixTimestamp64Nano(ts_ns, 'UTC'),
  saving_since Nullable(DateTime64(9, 'UTC')) MATERIALIZED
    if(isNull(saving_since_ns), NULL,
       fromUnixTimestamp64Nano(assumeNotNull(saving_since_ns), 'UTC'))
) ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (job, rank, ts_ns)
TTL toDateTime(ts) + INTERVAL 7 DAY
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import msgspec.inspect as mi

from schemas.records import (
    Collective,
    CommInfo,
    DeadLetter,
    Heartbeat,
    Iteration,
    JobInfo,
    Kernel,
    LinkSample,
    ProxySummary,
    RankInfo,
)
from schemas.results import (
    AlignedCollective,
    AlignStats,
    CommStructure,
    FaultLabel,
    RankStep,
    StepSummary,
    Verdict,
)

_DATETIME = "DateTime64(9, 'UTC')"


_TIME = "time"  # marker for timestamp fields (Int64 ns + a materialized DateTime64)


def _is_time(t: mi.Type) -> bool:
    if isinstance(t, mi.Metadata):
        return bool(t.extra and t.extra.get("clickhouse", "").startswith("DateTime64"))
    if isinstance(t, mi.UnionType):
        return any(_is_time(x) for x in t.types)
    return False


def _ch_type(t: mi.Type) -> str:
    """The ClickHouse column type of a msgspec type (timestamps: Int64 ns)."""
    if isinstance(t, mi.Metadata):
        if t.extra and "clickhouse" in t.extra and not _is_time(t):
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


def time_column(field_name: str) -> str:
    """The DateTime64 column materialized from a ``*_ns`` field: ``ts_ns`` -> ``ts``."""
    return field_name[:-3] if field_name.endswith("_ns") else f"{field_name}_time"


@dataclass(frozen=True)
class Table:
    """One ClickHouse table holding one record type."""

    name: str
    record: type[msgspec.Struct]
    order_by: tuple[str, ...]
    time_field: str
    version_column: str | None = None
    _columns: list[tuple[str, str]] = field(init=False, repr=False)
    _times: list[tuple[str, bool]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        info = mi.type_info(self.record)
        assert isinstance(info, mi.StructType)
        object.__setattr__(self, "_columns", [(f.name, _ch_type(f.type)) for f in info.fields])
        times = [
            (f.name, isinstance(f.type, mi.UnionType)) for f in info.fields if _is_time(f.type)
        ]
        object.__setattr__(self, "_times", times)

    @property
    def columns(self) -> list[tuple[str, str]]:
        """(name, ClickHouse type) of the record's columns, in record order."""
        return list(self._columns)

    @property
    def column_names(self) -> list[str]:
        return [n for n, _ in self._columns]

    @property
    def time_columns(self) -> list[str]:
        """The materialized DateTime64(9) columns (for Grafana's time filters)."""
        return [time_column(n) for n, _ in self._times]

    def ddl(self, database: str, retention_days: int) -> str:
        """``CREATE TABLE IF NOT EXISTS`` for this table; ``retention_days=0`` keeps forever."""
        cols = [f"{n} {t}" for n, t in self._columns]
        for n, nullable in self._times:
            expr = f"fromUnixTimestamp64Nano({n}, 'UTC')"
            if nullable:
                expr = f"if(isNull({n}), NULL, fromUnixTimestamp64Nano(assumeNotNull({n}), 'UTC'))"
                typ = f"Nullable({_DATETIME})"
            else:
                typ = _DATETIME
            cols.append(f"{time_column(n)} {typ} MATERIALIZED {expr}")
        engine = (
            f"ReplacingMergeTree({self.version_column})"
            if self.version_column
            else ("ReplacingMergeTree")
        )
        t = time_column(self.time_field)
        ttl = f"\nTTL toDateTime({t}) + INTERVAL {retention_days} DAY" if retention_days else ""
        return (
            f"CREATE TABLE IF NOT EXISTS {database}.{self.name} (\n  {', '.join(cols)}\n) "
            f"ENGINE = {engine}\nPARTITION BY toYYYYMMDD({t})\n"
            f"ORDER BY ({', '.join(self.order_by)}){ttl}"
        )

    def time_ns(self, row: msgspec.Struct | bytes) -> int:
        """The row's time (its ``time_field``, ns), which its partition and retention go
        by; a row of JSON is read for it. 0 where it has none."""
        if isinstance(row, bytes):
            value = msgspec.json.decode(row).get(self.time_field)
        else:
            value = getattr(row, self.time_field, None)
        return value if isinstance(value, int) else 0

    def select_list(self) -> str:
        return ", ".join(self.column_names)

    def from_row(self, row: Mapping[str, Any]) -> Any:
        """The record a selected row (as a name -> value mapping) stands for."""
        return msgspec.convert(dict(row), self.record, strict=False)


_TABLE_LIST: Sequence[Table] = (
    Table("jobs", JobInfo, ("job",), "ts_ns"),
    Table("ranks", RankInfo, ("job", "rank"), "ts_ns"),
    Table("comms", CommInfo, ("job", "comm_hash"), "ts_ns"),
    # a rank's n-th call on a communicator; point-to-point calls count per peer
    Table(
        "collective_events",
        Collective,
        ("job", "comm_hash", "seq", "rank", "op", "ifNull(peer, -1)"),
        "enqueue_ns",
    ),
    Table(
        "proxy_events",
        ProxySummary,
        ("job", "comm_hash", "seq", "rank", "channel", "peer", "direction"),
        "first_ns",
    ),
    Table(
        "kernel_events",
        Kernel,
        ("job", "node", "rank", "device", "stream", "start_ns", "correlation_id"),
        "start_ns",
    ),
    Table("heartbeats", Heartbeat, ("job", "rank", "ts_ns"), "ts_ns"),
    Table("iterations", Iteration, ("job", "rank", "step", "source"), "end_ns"),
    Table("link_samples", LinkSample, ("job", "src_rank", "dst_rank", "nic", "ts_ns"), "ts_ns"),
    Table(
        "collectives",
        AlignedCollective,
        ("job", "comm_hash", "seq", "sender", "receiver"),
        "first_arrival_ns",
    ),
    # a communicator's cumulative counts: the newest row (largest ts_ns) is its account
    Table("align_stats", AlignStats, ("job", "comm_hash", "ts_ns"), "ts_ns"),
    Table("comm_structure", CommStructure, ("job", "comm_hash", "sender", "receiver"), "ts_ns"),
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
