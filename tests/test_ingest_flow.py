"""Kafka -> Bytewax -> ClickHouse on the real broker and the real embedded engine."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from bytewax.testing import run_main

from flows.main import build_flow
from infra.clickhouse import read_records
from producers.sim.scenarios import build
from schemas.codec import decode
from schemas.config import Settings
from schemas.enums import DeadLetterReason
from schemas.records import EVENT_TYPES, Collective, DeadLetter
from schemas.tables import TABLE_FOR
from schemas.topics import Topics
from tests.examples import every_record
from tests.helpers import consume_all, flow_config, publisher

pytestmark = pytest.mark.integration

BAD = [
    (b'{"type":"hb","job":"job-a","node":"n","rank":-3,"ts_ns":1}', DeadLetterReason.OUT_OF_RANGE),
    (b'{"type":"hb","job":"job-a","node":"n","ts_ns":1}', DeadLetterReason.MISSING_FIELD),
    (b'{"type":"hb","job":"job-a","node":"n","rank":"x","ts_ns":1}', DeadLetterReason.WRONG_TYPE),
    (b'{"type":"hb","v":3,"job":"job-a"}', DeadLetterReason.UNKNOWN_VERSION),
    (b"\x00\x01 definitely not json", DeadLetterReason.MALFORMED),
]


def test_every_event_type_reaches_clickhouse_and_bad_input_is_dead_lettered(
    settings: Settings, ch: Any
) -> None:
    topics = Topics(prefix=settings.kafka.topic_prefix)
    events = [r for r in every_record() if isinstance(r, EVENT_TYPES)]
    pub = publisher(settings)
    # bad records first and in the middle: the flow must keep going after them
    for raw, _ in BAD[:2]:
        pub.publish_raw(topics.heartbeat, b"job-a", raw)
    sim = build("healthy", scale="tiny", seed=0, steps=4)
    bulk = list(sim.records())
    pub.publish_all(bulk[: len(bulk) // 2])
    for raw, _ in BAD[2:]:
        pub.publish_raw(topics.comm, b"job-a", raw)
    pub.publish_all(bulk[len(bulk) // 2 :])
    pub.publish_all(events)
    pub.flush()

    polls: list[int] = []  # the source reports each poll's size (what the bench times from)
    run_main(build_flow(dataclasses.replace(flow_config(settings), on_read=polls.append)))
    assert sum(polls) == len(BAD) + len(bulk) + len(events)

    db = settings.clickhouse.database
    for rec in events:  # field for field
        table = TABLE_FOR[type(rec)].name
        assert rec in list(read_records(ch, db, table, "job = 'job-a'")), table
    stored = sum(
        len(list(read_records(ch, db, t, f"job = '{sim.spec.job}'")))
        for t in (
            "jobs",
            "ranks",
            "comms",
            "collective_events",
            "proxy_events",
            "kernel_events",
            "link_samples",
            "heartbeats",
        )
    )
    assert stored == len(bulk), "nothing lost"

    dead = list(read_records(ch, db, "dead_letters"))
    assert sorted((d.raw, d.reason) for d in dead) == sorted(BAD)
    assert all(d.error and d.step_id == "decode" and d.offset >= 0 for d in dead)
    counts = dict(
        ch.query(f"SELECT reason, count() FROM {db}.dead_letters FINAL GROUP BY reason").result_rows
    )
    assert counts == {reason.value: 1 for _, reason in BAD}

    msgs = consume_all(settings, topics.deadletter, expect=len(BAD))
    on_topic = [decode(m.value()) for m in msgs]
    assert all(isinstance(d, DeadLetter) for d in on_topic)
    assert sorted(d.raw for d in on_topic) == sorted(raw for raw, _ in BAD)


def test_job_metadata_is_kept_by_compaction_one_record_per_entity(settings: Settings) -> None:
    """Metadata is published once, when a job starts; a flow started after any
    time-based retention must still learn the layout: the metadata topic is compacted,
    and each job, rank and communicator record has its own key (compaction keeps the
    latest record per key). It has one partition, so a job's records are read in the
    order they were written, whatever their keys: the analysis names links by the ranks'
    NICs, and a rank's record read after a backlog of samples left a verdict naming
    'gpu2' instead of the NIC."""
    from confluent_kafka.admin import AdminClient, ConfigResource

    from schemas.records import CommInfo, JobInfo, RankInfo
    from schemas.topics import message_key

    topics = Topics(prefix=settings.kafka.topic_prefix)
    admin = AdminClient({"bootstrap.servers": settings.kafka.bootstrap_servers})
    (fut,) = admin.describe_configs([ConfigResource("topic", topics.meta)]).values()
    assert fut.result()["cleanup.policy"].value == "compact"
    (other,) = admin.describe_configs([ConfigResource("topic", topics.comm)]).values()
    policy = other.result().get("cleanup.policy")  # the broker's default: time-based
    assert policy is None or policy.value != "compact"
    meta = [r for r in build("healthy", scale="tiny", seed=0, steps=1).records()
            if isinstance(r, JobInfo | RankInfo | CommInfo)]  # fmt: skip
    assert {topics.for_record(r) for r in meta} == {topics.meta}
    assert len({message_key(r) for r in meta}) == len(meta)
    assert len(admin.list_topics(topics.meta).topics[topics.meta].partitions) == 1
    assert len(admin.list_topics(topics.comm).topics[topics.comm].partitions) == 2
    pub = publisher(settings)
    pub.publish_all(meta)
    pub.flush()
    msgs = consume_all(settings, topics.meta, expect=len(meta))
    assert [decode(m.value()) for m in msgs] == meta


def test_records_sent_twice_are_counted_late_in_clickhouse(settings: Settings, ch: Any) -> None:
    """A producer that retries (or a replayed spool) sends records again after their
    collective completed: the flow ignores them, and each communicator's account
    (``align_stats``, newest per communicator in ``comm_accounts``) counts every one,
    with every record it read."""
    sim = build("healthy", scale="tiny", seed=0, steps=4, kernels=False)
    recs = list(sim.records())
    colls = [r for r in recs if isinstance(r, Collective)]
    again = colls[::50]
    pub = publisher(settings)
    pub.publish_all(recs)
    pub.publish_all(again)
    pub.flush()
    run_main(build_flow(flow_config(settings)))
    rows = ch.query(
        "SELECT comm_hash, records, late_records, out_of_order_records"
        f" FROM {settings.clickhouse.database}.comm_accounts WHERE job = {{job:String}}",
        parameters={"job": sim.spec.job},
    ).result_rows
    accounts = {comm: counts for comm, *counts in rows}
    assert set(accounts) == {r.comm_hash for r in colls}
    assert sum(a[0] for a in accounts.values()) == len(colls) + len(again)
    assert sum(a[1] for a in accounts.values()) == len(again)
    assert sum(a[2] for a in accounts.values()) == 0


def test_a_poll_with_a_broker_error_event_and_a_bad_record_decodes_the_rest() -> None:
    """librdkafka hands error events among a poll's messages: they are skipped, a refused
    record becomes a dead letter with its own key, offset and time, the rest decode."""
    from confluent_kafka import KafkaError, Message

    from flows.decode import decode_batch
    from flows.kafka_source import RawBatch
    from schemas.codec import encode

    good = [encode(r) for r in list(build("healthy", scale="tiny", seed=0).records())[:3]]

    def msg(value: bytes, offset: int) -> Message:
        return Message(
            topic="t", partition=2, offset=offset, key=b"k%d" % offset, value=value,
            timestamp=(1, 1_000 + offset),
        )  # fmt: skip

    event = Message(error=KafkaError(KafkaError._TRANSPORT))
    batch = RawBatch("t", 2, [event, msg(good[0], 7), msg(b"{oops", 8), event, msg(good[1], 9)])
    d = decode_batch(batch)
    assert d.raw == [good[0], good[1]] and [encode(r) for r in d.records] == d.raw
    (dead,) = d.dead
    assert (dead.offset, dead.key, dead.raw, dead.reason) == (
        8,
        b"k8",
        b"{oops",
        DeadLetterReason.MALFORMED,
    )
    assert dead.ts_ns == 1_008 * 1_000_000  # its Kafka time: refused again, the same row
    assert d.produced_ms == 1_007 and d.part == "2-t"  # the first record's time
