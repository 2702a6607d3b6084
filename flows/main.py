"""The megatrace dataflow, top to bottom.

Kafka batches are decoded (bad records become dead letters), stored raw,
aligned per communicator (collectives, proxy summaries; their step parts
merged per shard of the job's communicators), link samples read per node,
everything analysed per job, and the results stored (gathered per table into
large inserts) and announced.
Items are batches (lists) of records: Bytewax's cost is per item, so one
item per poll and per key keeps the flow fast. Started by
``megatrace run`` (or ``megatrace demo``); every judgement lives in ``detectors``.

A flow has a :class:`Role`. ``all`` (the default) does everything. A larger
deployment splits the work into ``store`` processes (every input topic into
the raw tables, and the dead-letter topic) and ``detect`` processes (no kernel
topic, which only the raw tables need; alignment, analysis, results, verdicts
and alerts), each scaled out on its own. Both keep the dead letters they meet
in ClickHouse (idempotent); only ``store``/``all`` republish them to the
dead-letter topic, so a record refused twice is announced once.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import bytewax.operators as op
import msgspec
from bytewax.connectors.kafka import KafkaSinkMessage
from bytewax.connectors.kafka import operators as kop
from bytewax.connectors.stdio import StdOutSink
from bytewax.dataflow import Dataflow

from detectors.alerting import AlertGate
from detectors.console import IncidentLog
from detectors.merge import CommLiveness
from detectors.parts import StepPart
from detectors.route import (
    POLL,
    comm_key,
    entry,
    job_of,
    node_key,
    schedules_it,
    shard_key,
    to_shard,
)
from detectors.schedule import CommSchedule, StepMark
from flows.kafka_source import BrokerHealth, RawBatch, RawKafkaSource, part_name
from flows.sinks import AsyncClickHouseSink, ClickHouseSink
from flows.state import (
    AlignLogic,
    AlignOut,
    AnalyzeLogic,
    MergeLogic,
    NodeLogic,
    RowBatchLogic,
    TableRows,
    schedules,
)
from flows.webhooks import WebhookSink
from infra.clickhouse import Rows
from infra.rowbinary import plan_for
from schemas.codec import SchemaError, dead_letter, decode_input, encode
from schemas.config import AlertSettings, ClickHouseSettings, DetectSettings, Settings
from schemas.enums import DeadLetterReason
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
from schemas.topics import Topics

_CLICKHOUSE = ClickHouseSettings()  # the defaults' one home


class Role(StrEnum):
    """What a flow process does (see the module docstring)."""

    ALL = "all"
    STORE = "store"
    DETECT = "detect"


@dataclass(frozen=True)
class FlowConfig:
    """Everything the flow needs, resolved by the command line from :class:`Settings`."""

    brokers: list[str]
    consumer_options: dict[str, Any]  # librdkafka settings (and its throttled logger)
    producer_options: dict[str, Any]
    topics: Topics
    clickhouse_url: str
    database: str
    tail: bool = True
    batch_size: int = POLL
    idle_stop_s: float = 1.5
    #: a bounded run fails once the broker did not answer for this long
    outage_wait_s: float = 300.0
    detect: DetectSettings = field(default_factory=DetectSettings)
    alerts: AlertSettings = field(default_factory=AlertSettings)
    console: bool = True
    role: Role = Role.ALL
    #: called with (records, oldest producer time ms, stored time ms) after raw rows are
    #: stored (roles ``all`` and ``store``)
    on_stored: Callable[[int, int, int], None] | None = None
    #: called with the number of records of every poll that returned some
    on_read: Callable[[int], None] | None = None
    #: a fresh start reads only these source partitions (``part_name`` -> first offset),
    #: e.g. the records one publisher delivered; None: every partition from its start
    start_offsets: dict[str, int] | None = None
    #: a bounded run over input still being written ends, once quiet, only when this says
    #: nothing more is coming (a live job its caller watches)
    input_complete: Callable[[], bool] | None = None
    #: the flow's own rows are inserted per table by this many, or after this long
    batch_rows: int = _CLICKHOUSE.batch_rows
    batch_ms: int = _CLICKHOUSE.batch_ms
    #: the raw tables' inserts gather ``batch_rows`` rows, or wait this long at most
    raw_batch_ms: int = _CLICKHOUSE.raw_batch_ms
    #: records older than this are refused (the tables' TTL would drop them); 0: keep all
    retention_days: int = 0
    #: an insert ClickHouse cannot take is tried again for this long, then the flow stops
    clickhouse_outage_wait_s: float = _CLICKHOUSE.outage_wait_s

    @property
    def consumer(self) -> dict[str, Any]:
        """The librdkafka settings of the flow's consumers."""
        return {"bootstrap.servers": ",".join(self.brokers), **self.consumer_options}


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


def flow_config(
    settings: Settings, bootstrap: str, clickhouse_url: str, **overrides: object
) -> FlowConfig:
    """The flow's configuration from :class:`Settings` and the resolved addresses."""
    from infra.kafka import consumer_config, producer_config

    def options(conf: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in conf.items() if k != "bootstrap.servers"}

    base = FlowConfig(
        brokers=bootstrap.split(","),
        consumer_options=options(consumer_config(settings.kafka, bootstrap)),
        producer_options=options(producer_config(settings.kafka, bootstrap)),
        topics=Topics(prefix=settings.kafka.topic_prefix),
        clickhouse_url=clickhouse_url,
        database=settings.clickhouse.database,
        outage_wait_s=settings.kafka.outage_wait_s,
        detect=settings.detect,
        alerts=settings.alerts,
        batch_rows=settings.clickhouse.batch_rows,
        batch_ms=settings.clickhouse.batch_ms,
        raw_batch_ms=settings.clickhouse.raw_batch_ms,
        retention_days=settings.clickhouse.retention_days,
        clickhouse_outage_wait_s=settings.clickhouse.outage_wait_s,
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


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


def as_rows(records: list[msgspec.Struct]) -> tuple[dict[str, Rows], int]:
    """Records produced here, per table (the insert encodes them)."""
    rows: dict[str, list[Any]] = {}
    for rec in records:
        rows.setdefault(TABLE_FOR[type(rec)].name, []).append(rec)
    return rows, 0


def has_dead(d: Decoded) -> bool:
    return bool(d.dead)


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


def input_topics(cfg: FlowConfig) -> list[str]:
    """The topics a flow of this role reads (``detect`` skips kernels: only stored raw)."""
    topics = list(cfg.topics.inputs)
    if cfg.role == Role.DETECT:
        topics.remove(cfg.topics.kernel)
    return topics


def _any(kv: tuple[str, list[Any]]) -> bool:
    return bool(kv[1])


def build_flow(cfg: FlowConfig) -> Dataflow:
    flow = Dataflow("megatrace")
    ch = ClickHouseSink(cfg.clickhouse_url, cfg.database)  # dead letters: few, inserted at once
    source = RawKafkaSource(
        cfg.consumer,
        input_topics(cfg),
        tail=cfg.tail,
        batch_size=cfg.batch_size,
        idle_stop_s=cfg.idle_stop_s,
        outage_wait_s=cfg.outage_wait_s,
        on_read=cfg.on_read,
        start_offsets=cfg.start_offsets,
        complete=cfg.input_complete,
    )
    raw = op.input("kafka_in", flow, source)
    # RawBatch -> Decoded(records, dead letters)
    decoded = op.map(
        "decode", raw, functools.partial(decode_batch, retention_days=cfg.retention_days)
    )
    # list[DeadLetter] -> dead_letters table (and the dead-letter topic)
    dead = op.map("dead", op.filter("with_dead", decoded, has_dead), dead_of)
    op.output("dead_to_clickhouse", op.map("dead_rows", dead, as_rows), ch)
    if cfg.role != Role.DETECT:
        kop.output(
            "dead_to_kafka",
            op.map("dead_to_message", op.flat_map("dead_each", dead, list), to_kafka_message),
            brokers=cfg.brokers,
            topic=cfg.topics.deadletter,
            add_config=cfg.producer_options,
        )
        # (source partition, rows per table) -> raw tables, inserted while the next poll is
        # decoded; a partition's snapshot waits for its rows
        raw_sink = AsyncClickHouseSink(
            cfg.clickhouse_url,
            cfg.database,
            source.list_parts,
            on_write=cfg.on_stored,
            batch_rows=cfg.batch_rows,
            batch_ms=cfg.raw_batch_ms,
            outage_wait_s=cfg.clickhouse_outage_wait_s,
        )
        op.output("records_to_clickhouse", op.map("rows", decoded, rows_of), raw_sink)
    if cfg.role != Role.STORE:
        _detect(cfg, decoded, source.health)  # its clocks do not count the broker's outages
    return flow


def _detect(cfg: FlowConfig, decoded: op.Stream[Decoded], health: BrokerHealth) -> None:
    """The detectors' route (:mod:`detectors.route`: schedule -> comm -> shard, node ->
    job), each stage a keyed stateful step around that stage's pure state."""
    # (job, list[JobInfo | CommInfo]) -> (job:comm, [CommSchedule]): where each comm's calls sit
    book = op.stateful_map(
        "schedule_book", op.flat_map("meta_by_job", decoded, meta_by_job), schedules
    )
    scheds = op.flat_map("schedules_by_comm", book, schedules_by_comm)
    # (job:comm, list[Collective | ProxySummary | CommSchedule]) -> (job:comm, AlignOut)
    by_comm = op.merge(
        "to_comm", op.flat_map("comm_records_by_comm", decoded, comm_records_by_comm), scheds
    )
    aligned = op.stateful_batch(
        "align", by_comm, lambda resume: AlignLogic(cfg.detect, resume, health)
    )
    # (job:shard, list[StepPart | CommLiveness]) -> (job:shard, list[StepPart | CommLiveness]):
    # one part per shard and step, the newest progress of the shard's communicators
    shards = functools.partial(parts_by_shard, cfg.detect.part_shards)
    parts = op.stateful_batch(
        "merge_parts", op.flat_map("parts_by_shard", aligned, shards), lambda r: MergeLogic(r)
    )
    # (job:node, list[LinkSample]) -> (job:node, [NodeDigest]): the links that changed
    by_node = op.flat_map("links_by_node", decoded, links_by_node)
    digests = op.stateful_batch("node", by_node, lambda resume: NodeLogic(cfg.detect, resume))
    # (job, list[StepPart | Instance | CommLiveness | NodeDigest | other]) -> (job, list[result])
    forward = op.filter("with_forward", op.map("forward_to_job", aligned, forward_to_job), _any)
    to_job = op.merge(
        "to_job",
        forward,
        op.map("parts_to_job", parts, rekey_by_job),
        op.map("digests_to_job", digests, rekey_by_job),
        op.flat_map("others_by_job", decoded, others_by_job),
    )
    results = op.key_rm(
        "results",
        op.stateful_batch(
            "analyze", to_job, lambda resume: AnalyzeLogic(cfg.detect, resume, health)
        ),
    )
    # (table, rows) of aligned collectives and results -> gathered per table -> ClickHouse
    own = op.merge(
        "own_rows",
        op.flat_map("aligned_by_table", aligned, aligned_by_table),
        op.flat_map("results_by_table", results, by_table),
    )
    batched = op.stateful_batch(
        "batch_rows", own, lambda resume: RowBatchLogic(cfg.batch_rows, cfg.batch_ms, resume)
    )
    # (table, rows) -> that table, inserted off the flow's thread as soon as it is free
    # (batch_rows already gathered them); its snapshot waits for them
    own_sink = AsyncClickHouseSink(
        cfg.clickhouse_url, cfg.database, own_tables, batch_rows=1,
        outage_wait_s=cfg.clickhouse_outage_wait_s,
    )  # fmt: skip
    op.output("own_rows_to_clickhouse", op.map("table_rows", batched, table_rows), own_sink)
    # list[AlignedCollective | StepSummary | RankStep | Verdict] -> verdicts announced
    verdicts = op.flat_map("verdicts", results, verdicts_of)
    kop.output(
        "verdicts_to_kafka",
        op.map("verdict_to_message", verdicts, to_kafka_message),
        brokers=cfg.brokers,
        topic=cfg.topics.verdict,
        add_config=cfg.producer_options,
    )
    if cfg.alerts.webhooks:
        # (job, Verdict) -> (job, Alert): one per incident, its updates, its resolution
        keyed = op.key_on("verdicts_by_job", verdicts, lambda v: v.job)
        alerts = op.stateful_flat_map(
            "alert_gate", keyed, lambda gate, v: gate_alerts(gate, v, cfg.alerts)
        )
        op.output("alerts_to_webhooks", op.key_rm("alerts", alerts), WebhookSink(cfg.alerts))
    if cfg.console:
        # (job, Verdict) -> (job, line): an incident's opening, changes that matter, resolution
        lines = op.stateful_flat_map(
            "console", op.key_on("verdicts_by_job_console", verdicts, lambda v: v.job),
            console_lines,
        )  # fmt: skip
        op.output("verdicts_to_console", op.key_rm("console_lines", lines), StdOutSink())
