"""The megatrace dataflow, top to bottom.

Kafka records are decoded (bad ones become dead letters), stored raw,
aligned per communicator, analysed per job, and the results stored and
announced. Started by ``megatrace run`` (or ``megatrace demo``); every
judgement lives in ``detectors``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import bytewax.operators as op
import msgspec
from bytewax.connectors.kafka import KafkaSinkMessage, KafkaSourceMessage
from bytewax.connectors.kafka import operators as kop
from bytewax.connectors.stdio import StdOutSink
from bytewax.dataflow import Dataflow

from flows.logic import AlignLogic, AnalyzeLogic
from flows.sinks import ClickHouseSink
from schemas.codec import SchemaError, dead_letter, decode, encode
from schemas.config import DetectSettings
from schemas.records import Collective, DeadLetter, Verdict
from schemas.topics import Topics


@dataclass(frozen=True)
class FlowConfig:
    """Everything the flow needs, resolved by the command line from :class:`Settings`."""

    brokers: list[str]
    consumer_options: dict[str, str]
    producer_options: dict[str, str]
    topics: Topics
    clickhouse_url: str
    database: str
    tail: bool = True
    batch_size: int = 5000
    detect: DetectSettings = field(default_factory=DetectSettings)
    console: bool = True


def decode_message(msg: KafkaSourceMessage) -> msgspec.Struct:
    """A schema record, or the dead letter that keeps the bytes and says why not."""
    raw = msg.value or b""
    try:
        return decode(raw)
    except SchemaError as err:
        return dead_letter(
            raw,
            err,
            now_ns=time.time_ns(),
            step_id="decode",
            topic=msg.topic or "",
            partition=msg.partition if msg.partition is not None else -1,
            offset=msg.offset if msg.offset is not None else -1,
            key=msg.key,
        )


def is_dead_letter(rec: msgspec.Struct) -> bool:
    return isinstance(rec, DeadLetter)


def is_collective(rec: msgspec.Struct) -> bool:
    return isinstance(rec, Collective)


def is_verdict(rec: msgspec.Struct) -> bool:
    return isinstance(rec, Verdict)


def to_kafka_message(rec: msgspec.Struct) -> KafkaSinkMessage[bytes | None, bytes]:
    key = rec.key if isinstance(rec, DeadLetter) else getattr(rec, "job", "").encode()
    return KafkaSinkMessage(key=key, value=encode(rec))


def verdict_line(v: Verdict) -> str:
    return f"[{v.status.value:>8}] {v.job} {v.verdict_id} r{v.revision}: {v.summary}"


def build_flow(cfg: FlowConfig) -> Dataflow:
    flow = Dataflow("megatrace")
    ch = ClickHouseSink(cfg.clickhouse_url, cfg.database)
    kafka_in = kop.input(
        "kafka_in",
        flow,
        brokers=cfg.brokers,
        topics=list(cfg.topics.inputs),
        tail=cfg.tail,
        add_config=cfg.consumer_options,
        batch_size=cfg.batch_size,
    )
    op.inspect("kafka_errors", kafka_in.errs)  # broker-side consume errors: logged, never fatal
    # KafkaSourceMessage -> Record | DeadLetter
    decoded = op.map("decode", kafka_in.oks, decode_message)
    split = op.branch("split_dead_letters", decoded, is_dead_letter)
    dead, records = split.trues, split.falses
    # DeadLetter -> dead_letters table and the dead-letter topic
    op.output("dead_to_clickhouse", dead, ch)
    kop.output(
        "dead_to_kafka",
        op.map("dead_to_message", dead, to_kafka_message),
        brokers=cfg.brokers,
        topic=cfg.topics.deadletter,
        add_config=cfg.producer_options,
    )
    # Record -> its raw table
    op.output("records_to_clickhouse", records, ch)
    by_kind = op.branch("split_collectives", records, is_collective)
    # (job:comm, Collective) -> (job:comm, Instance)
    by_comm = op.key_on("key_by_comm", by_kind.trues, lambda r: f"{r.job}:{r.comm_hash:016x}")
    instances = op.stateful_batch("align", by_comm, lambda resume: AlignLogic(cfg.detect, resume))
    # (job, Instance | other record) -> (job, AlignedCollective | StepSummary | RankStep | Verdict)
    to_job = op.merge("to_job", op.key_rm("instances", instances), by_kind.falses)
    by_job = op.key_on("key_by_job", to_job, lambda x: x.job)
    results = op.key_rm(
        "results",
        op.stateful_batch("analyze", by_job, lambda resume: AnalyzeLogic(cfg.detect, resume)),
    )
    op.output("results_to_clickhouse", results, ch)
    verdicts = op.filter("verdicts", results, is_verdict)
    kop.output(
        "verdicts_to_kafka",
        op.map("verdict_to_message", verdicts, to_kafka_message),
        brokers=cfg.brokers,
        topic=cfg.topics.verdict,
        add_config=cfg.producer_options,
    )
    if cfg.console:
        op.output(
            "verdicts_to_console", op.map("verdict_line", verdicts, verdict_line), StdOutSink()
        )
    return flow
