"""The megatrace dataflow, top to bottom.

Kafka batches are decoded (bad records become dead letters), stored raw,
aligned per communicator (collectives, proxy summaries; their step parts
merged per shard of the job's communicators), link samples read per node,
everything analysed per job, and the results stored (gathered per table into
large inserts) and announced.
Items are batches (lists) of records: Bytewax's cost is per item, so one
item per poll and per key keeps the flow fast. Started by
``megatrace run`` (or ``megatrace demo``); every judgement lives in ``detectors``.
This module wires the steps; how records are decoded is :mod:`flows.decode`'s, how
they are keyed :mod:`flows.keys`', and the flow's settings :mod:`flows.flow_config`'s.

A flow has a :class:`Role`. ``all`` (the default) does everything. A larger
deployment splits the work into ``store`` processes (every input topic into
the raw tables, and the dead-letter topic) and ``detect`` processes (no kernel
topic, which only the raw tables need; alignment, analysis, results, verdicts
and alerts), each scaled out on its own. Both keep the dead letters they meet
in ClickHouse (idempotent); only ``store``/``all`` republish them to the
dead-letter topic, so a record refused twice is announced once.
"""

from __future__ import annotations

import functools

import bytewax.operators as op
from bytewax.connectors.kafka import operators as kop
from bytewax.connectors.stdio import StdOutSink
from bytewax.dataflow import Dataflow

from flows.decode import Decoded, dead_of, decode_batch, has_dead, rows_of
from flows.flow_config import FlowConfig, Role, input_topics
from flows.kafka_source import BrokerHealth, RawKafkaSource
from flows.keys import (
    aligned_by_table,
    as_rows,
    by_table,
    comm_records_by_comm,
    console_lines,
    forward_to_job,
    gate_alerts,
    links_by_node,
    meta_by_job,
    nonempty,
    others_by_job,
    own_tables,
    parts_by_shard,
    rekey_by_job,
    schedules_by_comm,
    table_rows,
    to_kafka_message,
    verdicts_of,
)
from flows.sinks import AsyncClickHouseSink, ClickHouseSink
from flows.state import (
    AlignLogic,
    AnalyzeLogic,
    MergeLogic,
    NodeLogic,
    RowBatchLogic,
    schedules,
)
from flows.webhooks import WebhookSink


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
    forward = op.filter("with_forward", op.map("forward_to_job", aligned, forward_to_job), nonempty)
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
