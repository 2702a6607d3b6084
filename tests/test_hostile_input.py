"""Hostile but fair input: no record stops the flow, none is planted, none is lost unsaid.

Each case is one that stopped or fooled an earlier version: it now becomes a dead
letter with a reason, and the good records around it are stored.
"""

from __future__ import annotations

from typing import Any

import pytest
from bytewax.testing import run_main

from flows.main import build_flow
from infra.clickhouse import read_records
from producers.sim.scenarios import build
from schemas.codec import SchemaError, decode_input
from schemas.config import Settings
from schemas.topics import Topics
from schemas.units import DeadLetterReason as R
from tests.helpers import flow_config, publisher

_HB = b'"job":"job-h","node":"n","rank":0,"ts_ns":1'
_DEEP = b"[" * 10_000 + b"]" * 10_000
#: (raw record, the reason it is refused): each stopped the flow, or was stored as truth
POISON = [
    (b'{"type":"hb",' + _HB + b',"extra":' + _DEEP + b"}", R.MALFORMED),
    (_DEEP, R.MALFORMED),
    (b'{"type":"hb","job":' + _DEEP + b"}", R.MALFORMED),
    (b'{"type":[1],"job":"job-h"}', R.UNKNOWN_TYPE),
    (b'{"type":{"a":1},"job":"job-h"}', R.UNKNOWN_TYPE),
    (b'{"type":"hb","v":[1],' + _HB + b"}", R.WRONG_TYPE),
    (b'{"type":"dead","ts_ns":1,"reason":"malformed","error":"x","raw":""}', R.NOT_AN_INPUT),
    (
        b'{"type":"verdict","job":"job-h","verdict_id":"spoof","kind":"hang",'
        b'"cause":"compute","rank":0,"onset_ns":1,"detected_ns":1,"severity":1.0}',
        R.NOT_AN_INPUT,
    ),
    (
        b'{"type":"label","job":"job-h","fault_id":"f","kind":"hang","cause":"compute",'
        b'"onset_step":1,"onset_ns":1}',
        R.NOT_AN_INPUT,
    ),
    (
        b'{"type":"step","job":"job-h","step":0,"start_ns":1,"end_ns":2,"duration_ns":1}',
        R.NOT_AN_INPUT,
    ),
    # values no column can hold: an unsigned 64-bit hash, an Int64 count, a DateTime
    (
        b'{"type":"hb",' + _HB + b',"comms":[{"comm_hash":18446744073709551616}]}',
        R.WRONG_TYPE,
    ),
    (
        b'{"type":"hb",' + _HB + b',"comms":[{"comm_hash":1,"issued_seq":9223372036854775808}]}',
        R.WRONG_TYPE,
    ),
    (
        b'{"type":"hb","job":"job-h","node":"n","rank":0,"ts_ns":4294967296000000000}',
        R.OUT_OF_RANGE,
    ),  # after 2106: ClickHouse's DateTime would wrap it to 1970
]


@pytest.mark.parametrize(("raw", "reason"), POISON, ids=range(len(POISON)))
def test_a_poison_pill_is_a_schema_error_with_its_reason(raw: bytes, reason: R) -> None:
    with pytest.raises(SchemaError) as e:
        decode_input(raw)
    assert e.value.reason is reason
    assert len(str(e.value)) < 600  # a message, not the record echoed back


@pytest.mark.integration
def test_the_flow_goes_on_after_every_poison_pill_and_stores_no_planted_record(
    settings: Settings, ch: Any
) -> None:
    topics = Topics(prefix=settings.kafka.topic_prefix)
    sim = build("healthy", scale="tiny", seed=0, steps=3)
    good = list(sim.records(emit_kernels=False))
    pub = publisher(settings)
    half = len(good) // 2
    pub.publish_all(good[:half])
    for i, (raw, _) in enumerate(POISON):  # on every input topic, between good records
        topic = topics.inputs[i % len(topics.inputs)]
        pub.publish_raw(topic, b"job-h", raw)
    pub.publish_all(good[half:])
    pub.flush()

    run_main(build_flow(flow_config(settings)))  # returns: it did not stop or hang

    db = settings.clickhouse.database
    dead = list(read_records(ch, db, "dead_letters"))
    assert sorted((d.raw, d.reason) for d in dead) == sorted(POISON)
    for table in ("verdicts", "fault_labels", "steps"):
        planted = list(read_records(ch, db, table, "job = 'job-h'"))
        assert planted == [], table
    stored = ch.query(
        f"SELECT (SELECT count() FROM {db}.collective_events FINAL) + "
        f"(SELECT count() FROM {db}.heartbeats FINAL WHERE job != 'job-h') + "
        f"(SELECT count() FROM {db}.proxy_events FINAL) + "
        f"(SELECT count() FROM {db}.link_samples FINAL) + "
        f"(SELECT count() FROM {db}.jobs FINAL) + (SELECT count() FROM {db}.ranks FINAL) + "
        f"(SELECT count() FROM {db}.comms FINAL)"
    ).result_rows[0][0]
    assert stored == len(good), "every good record stored"
