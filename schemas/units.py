"""Scalar field types shared by every record, with their units and bounds (the
enumerations are in :mod:`schemas.enums`).

Each alias carries its validation bounds (checked when a record is decoded)
and, through ``Meta.extra["clickhouse"]``, the ClickHouse column type it maps
to, so the DDL in :mod:`schemas.tables` is derived from one definition.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

#: The largest global rank we accept. Anything above is treated as corrupt input.
MAX_RANK = 1 << 20

#: Current schema version of every record type.
SCHEMA_VERSION = 1

#: The largest value of an ``Int64`` column: a larger count cannot be stored.
MAX_INT64 = (1 << 63) - 1
#: The last nanosecond ClickHouse's ``DateTime`` reaches (2106-02-07 06:28:15 UTC): the
#: tables' partitions and retention are computed in it, and a later time would wrap.
MAX_TIME_NS = (1 << 32) * 1_000_000_000 - 1

TimeNs = Annotated[
    int,
    Meta(
        ge=0,
        le=MAX_TIME_NS,
        description="Nanoseconds since the Unix epoch (host clock unless `clock` says "
        "otherwise), before 2106-02-07.",
        extra={"clickhouse": "DateTime64(9, 'UTC')"},
    ),
]
DurationNs = Annotated[int, Meta(ge=0, le=MAX_INT64, description="A duration in nanoseconds.")]
Rank = Annotated[int, Meta(ge=0, le=MAX_RANK, description="Global rank in the job.")]
#: Communicator hashes are unsigned 64-bit: below this (checked by the records that carry
#: one, as msgspec bounds stop at int64).
COMM_HASH_END = 1 << 64

CommHash = Annotated[
    int,
    Meta(
        ge=0,
        description="Unsigned 64-bit hash of the communicator's unique id.",
        extra={"clickhouse": "UInt64"},
    ),
]
#: An unsigned 64-bit tag a user attaches to a call (checked like a communicator hash).
Tag = Annotated[int, Meta(ge=0, extra={"clickhouse": "UInt64"})]
Seq = Annotated[
    int, Meta(ge=0, le=MAX_INT64, description="Per-communicator operation sequence number.")
]
#: A sequence number or -1 for none.
SeqOrNone = Annotated[int, Meta(ge=-1, le=MAX_INT64)]
Count = Annotated[int, Meta(ge=0, le=MAX_INT64)]
Positive = Annotated[int, Meta(ge=1, le=MAX_INT64)]
JobId = Annotated[str, Meta(min_length=1, max_length=128, description="Job identifier.")]
NodeName = Annotated[str, Meta(min_length=1, max_length=256, description="Host name.")]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
Version = Annotated[int, Meta(ge=1, description="Schema version of the record.")]


def __getattr__(name: str) -> object:
    """The enumerations once defined here (a flow's snapshots pickled them by this name)."""
    from schemas import enums

    if not name.startswith("__") and hasattr(enums, name):
        return getattr(enums, name)
    raise AttributeError(name)
