"""The megatrace dataflow: Kafka in, decoded records and dead letters out.

Started by ``megatrace run`` (or ``megatrace demo``). Reads top to bottom;
every judgement lives in ``schemas``/``detectors``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import bytewax.operators as op
import msgspec
from bytewax.connectors.kafka import KafkaSinkMessage, KafkaSourceMessage
from bytewax.connectors.kafka import operators as kop
from bytewax.dataflow import Dataflow

from flows.sinks import ClickHouseSink
from schemas.codec import SchemaError, dead_letter, decode, encode
from schemas.records import DeadLetter
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


def to_kafka_message(dead: DeadLetter) -> KafkaSinkMessage[bytes | None, bytes]:
    return KafkaSinkMessage(key=dead.key, value=encode(dead))


def build_flow(cfg: FlowConfig) -> Dataflow:
    flow = Dataflow("megatrace")
    kafka_in = kop.input(
        "kafka_in",
        flow,
        brokers=cfg.brokers,
        topics=list(cfg.topics.inputs),
        tail=cfg.tail,
        add_config=cfg.consumer_options,
        batch_size=cfg.batch_size,
    )
    # KafkaSourceMessage -> Record | DeadLetter
    decoded = op.map("decode", kafka_in.oks, decode_message)
    split = op.branch("split_dead_letters", decoded, is_dead_letter)
    dead, records = split.trues, split.falses
    # Record -> its ClickHouse table
    op.output("records_to_clickhouse", records, ClickHouseSink(cfg.clickhouse_url, cfg.database))
    # DeadLetter -> dead_letters table and dead-letter topic
    op.output("dead_to_clickhouse", dead, ClickHouseSink(cfg.clickhouse_url, cfg.database))
    kop.output(
        "dead_to_kafka",
        op.map("dead_to_message", dead, to_kafka_message),
        brokers=cfg.brokers,
        topic=cfg.topics.deadletter,
        add_config=cfg.producer_options,
    )
    # KafkaError (broker-side consume errors) -> log, never crash
    op.inspect("kafka_errors", kafka_in.errs)
    return flow
