"""How the flow keys what moves between its steps: records per communicator, node or
job, a communicator's step parts per shard of its job, results per table, verdicts
and alerts per job (:mod:`flows.main` wires them; :mod:`detectors.route` says where
each record goes).
"""

from __future__ import annotations

from typing import Any

import msgspec
from bytewax.connectors.kafka import KafkaSinkMessage

from detectors.alerting import AlertGate
from detectors.console import IncidentLog
from detectors.merge import CommLiveness
from detectors.parts import StepPart
from detectors.route import (
    comm_key,
    entry,
    job_of,
    node_key,
    schedules_it,
    shard_key,
    to_shard,
)
from detectors.schedule import CommSchedule, StepMark
from flows.decode import Decoded
from flows.state import (
    AlignOut,
    TableRows,
)
from infra.clickhouse import Rows
from schemas.codec import encode
from schemas.config import AlertSettings
from schemas.records import (
    Collective,
    CommInfo,
    DeadLetter,
    Iteration,
    JobInfo,
    Kernel,
    LinkSample,
    ProxySummary,
)
from schemas.results import Alert, Verdict
from schemas.tables import TABLE_FOR, TABLES

_COMM_KINDS = frozenset({Collective, ProxySummary})

_STORED_ONLY = frozenset({Collective, ProxySummary, Kernel})

_META_KINDS = frozenset({JobInfo, CommInfo, Iteration})

_NOT_FOR_JOB = _STORED_ONLY | {LinkSample}


def comm_records_by_comm(d: Decoded) -> list[tuple[str, list[Collective | ProxySummary]]]:
    """A poll's collectives and proxy summaries, per (job, communicator), in log order.

    >>> from schemas.records import Heartbeat
    >>> from schemas.enums import CollOp, DType
    >>> def coll(comm, seq):
    ...     return Collective(job="j", node="n", rank=0, comm_hash=comm, comm_size=2,
    ...         rank_in_comm=0, op=CollOp.ALL_REDUCE, seq=seq, count=1, size_bytes=2,
    ...         dtype=DType.BFLOAT16, enqueue_ns=1)
    >>> recs = [coll(7, 0), Heartbeat(job="j", node="n", rank=0, ts_ns=1), coll(9, 0),
    ...         coll(7, 1)]
    >>> d = Decoded(recs, [], [], 0, frozenset(map(type, recs)))
    >>> [(key, [r.seq for r in g]) for key, g in comm_records_by_comm(d)]
    [('j:0000000000000007', [0, 1]), ('j:0000000000000009', [0])]
    """
    if d.kinds.isdisjoint(_COMM_KINDS):  # another topic's batch: nothing to look at
        return []
    records: list[Any] = d.records
    if not d.kinds <= _COMM_KINDS:  # a topic holding others too
        records = [r for r in records if isinstance(r, Collective | ProxySummary)]
    groups: dict[tuple[str, int], list[Collective | ProxySummary]] = {}
    get = groups.get
    for r in records:  # the comm topic's hot loop: no list made for a key already there
        k = (r.job, r.comm_hash)
        g = get(k)
        if g is None:
            groups[k] = [r]
        else:
            g.append(r)
    return [(comm_key(*k), g) for k, g in groups.items()]


def links_by_node(d: Decoded) -> list[tuple[str, list[LinkSample]]]:
    """Link samples, per (job, node): many, small, and keyed by node on their topic.

    Heartbeats stay on the job's path: their topic keys them by job, so they arrive in
    order, and the hang watchdog compares every rank's latest one (re-keyed per node,
    one node's could lag another's and look like a rank that stopped)."""
    if LinkSample not in d.kinds:
        return []
    groups: dict[str, list[LinkSample]] = {}
    for r in d.records:
        if isinstance(r, LinkSample):
            groups.setdefault(node_key(r.job, r.node), []).append(r)
    return list(groups.items())


def others_by_job(d: Decoded) -> list[tuple[str, list[msgspec.Struct]]]:
    """What the job analysis reads directly (kernels are only stored; collectives and
    proxy summaries go through their communicator, link samples through their node)."""
    if d.kinds <= _NOT_FOR_JOB:
        return []
    groups: dict[str, list[msgspec.Struct]] = {}
    for r in d.records:
        if entry(r) == "job":
            groups.setdefault(r.job, []).append(r)  # type: ignore[attr-defined]
    return list(groups.items())


def meta_by_job(d: Decoded) -> list[tuple[str, list[JobInfo | CommInfo | Iteration]]]:
    """The records communicators' schedules are made of, and the job's iteration markers."""
    if d.kinds.isdisjoint(_META_KINDS):
        return []
    groups: dict[str, list[JobInfo | CommInfo | Iteration]] = {}
    for r in d.records:
        if schedules_it(r):
            groups.setdefault(r.job, []).append(r)  # type: ignore[attr-defined]
    return list(groups.items())


def schedules_by_comm(
    kv: tuple[str, list[CommSchedule | StepMark]],
) -> list[tuple[str, list[CommSchedule | StepMark]]]:
    return [
        (comm_key(s.job, s.comm_hash) if isinstance(s, StepMark) else
         comm_key(s.comm.job, s.comm.comm_hash), [s])
        for s in kv[1]
    ]  # fmt: skip


def aligned_by_table(kv: tuple[str, AlignOut]) -> list[tuple[str, TableRows]]:
    return by_table(kv[1].rows)


def by_table(records: list[msgspec.Struct]) -> list[tuple[str, TableRows]]:
    """Records produced here, keyed by their table."""
    return [(table, (rows, 0)) for table, rows in as_rows(records)[0].items()]


def table_rows(kv: tuple[str, TableRows]) -> tuple[str, tuple[dict[str, Rows], int]]:
    """A table's gathered rows, keyed by the table, as the ClickHouse sink takes them."""
    table, (rows, produced_ms) = kv
    return table, ({table: rows}, produced_ms)


def own_tables() -> list[str]:
    """The tables the flow's own rows may go to: every table (the sink's partitions)."""
    return list(TABLES)


def forward_to_job(kv: tuple[str, AlignOut]) -> tuple[str, list[Any]]:
    """What a communicator tells its job directly (step parts and progress are merged)."""
    return job_of(kv[0]), [x for x in kv[1].forward if not to_shard(x)]


def parts_by_shard(
    shards: int, kv: tuple[str, AlignOut]
) -> list[tuple[str, list[StepPart | CommLiveness]]]:
    """A communicator's step parts and progress, keyed by (job, shard of its communicators)."""
    parts = [x for x in kv[1].forward if to_shard(x)]
    if not parts:
        return []
    return [(shard_key(job_of(kv[0]), parts[0].comm_hash, shards), parts)]


def rekey_by_job(kv: tuple[str, list[Any]]) -> tuple[str, list[Any]]:
    """A keyed step's output (merged parts, node digests) to its job's analysis."""
    return kv[1][0].job, kv[1]


def as_rows(records: list[msgspec.Struct]) -> tuple[dict[str, Rows], int]:
    """Records produced here, per table (the insert encodes them)."""
    rows: dict[str, list[Any]] = {}
    for rec in records:
        rows.setdefault(TABLE_FOR[type(rec)].name, []).append(rec)
    return rows, 0


def verdicts_of(results: list[msgspec.Struct]) -> list[Verdict]:
    return [r for r in results if isinstance(r, Verdict)]


def to_kafka_message(rec: msgspec.Struct) -> KafkaSinkMessage[bytes | None, bytes]:
    key = rec.key if isinstance(rec, DeadLetter) else getattr(rec, "job", "").encode()
    return KafkaSinkMessage(key=key, value=encode(rec))


def gate_alerts(
    gate: AlertGate | None, v: Verdict, settings: AlertSettings
) -> tuple[AlertGate, list[Alert]]:
    gate = gate or AlertGate(settings)
    return gate, gate.update(v)


def console_lines(log: IncidentLog | None, v: Verdict) -> tuple[IncidentLog, list[str]]:
    """Per job: the console's lines about a verdict revision (only the changes that matter)."""
    log = log or IncidentLog(show_job=True)
    line = log.update(v)
    return log, [line] if line is not None else []


def nonempty(kv: tuple[str, list[Any]]) -> bool:
    return bool(kv[1])
