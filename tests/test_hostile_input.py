"""Hostile but fair input: no record stops the flow, none is planted, none is lost unsaid.

Each case is one that stopped or fooled an earlier version: it now becomes a dead
letter with a reason, and the good records around it are stored.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from bytewax.testing import run_main
from click.testing import CliRunner

from flows.main import build_flow
from infra.clickhouse import read_records
from megatrace.cli import cli
from producers.sim.scenarios import build
from schemas.codec import SchemaError, decode_input
from schemas.config import Settings
from schemas.enums import DeadLetterReason as R
from schemas.topics import Topics
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


_DAY = 86_400_000_000_000


def _heartbeats(n: int, start_ns: int, every_ns: int, rank: int = 0) -> list:
    from schemas.records import Heartbeat

    return [
        Heartbeat(job="job-t", node="n", rank=rank + i % 2, ts_ns=start_ns + i * every_ns)
        for i in range(n)
    ]


@pytest.mark.integration
def test_a_backlog_spanning_120_days_is_stored_whole(settings: Settings, ch: Any) -> None:
    """ClickHouse takes at most 100 partitions (days) in one insert: a backlog of old
    records once hung the flow; it is now inserted per 100 days."""
    now = time.time_ns()
    pub = publisher(settings)
    pub.publish_all(_heartbeats(120, now - 125 * _DAY, _DAY))
    pub.flush()
    run_main(build_flow(flow_config(settings)))  # retention 0 in the test settings
    db = settings.clickhouse.database
    assert ch.query(f"SELECT count() FROM {db}.heartbeats FINAL").result_rows[0][0] == 120


@pytest.mark.integration
def test_records_older_than_the_retention_are_dead_letters_not_silence(
    settings: Settings, ch: Any
) -> None:
    now = time.time_ns()
    pub = publisher(settings)
    old, recent = _heartbeats(5, now - 40 * _DAY, _DAY), _heartbeats(5, now - _DAY, 1000)
    pub.publish_all([*old, *recent])
    pub.flush()
    cfg = dataclasses.replace(flow_config(settings), retention_days=30)
    run_main(build_flow(cfg))
    db = settings.clickhouse.database
    assert ch.query(f"SELECT count() FROM {db}.heartbeats FINAL").result_rows[0][0] == 5
    dead = list(read_records(ch, db, "dead_letters"))
    assert [d.reason for d in dead] == [R.RETENTION] * 5
    assert "retention of 30 days" in dead[0].error and dead[0].field == "ts_ns"


@pytest.mark.integration
def test_a_row_the_store_refuses_alone_is_a_dead_letter_and_the_rest_are_stored(
    settings: Settings, ch: Any
) -> None:
    db = settings.clickhouse.database
    # a constraint someone added to the table: ClickHouse refuses rank 13's rows
    ch.command(f"ALTER TABLE {db}.heartbeats ADD CONSTRAINT no13 CHECK rank != 13")
    now = time.time_ns()
    rows = [*_heartbeats(50, now, 1000), *_heartbeats(1, now + 10**9, 1, rank=13)]
    rows += _heartbeats(50, now + 2 * 10**9, 1000)
    pub = publisher(settings)
    pub.publish_all(rows)
    pub.flush()
    run_main(build_flow(flow_config(settings)))
    assert ch.query(f"SELECT count() FROM {db}.heartbeats FINAL").result_rows[0][0] == 100
    (dead,) = list(read_records(ch, db, "dead_letters"))
    assert dead.reason is R.REFUSED_BY_STORE and dead.step_id == "store:heartbeats"
    assert b'"rank":13' in dead.raw and "no13" in dead.error


_BROKEN_TABLE = """
import sys
from infra.clickhouse import connect, init_db
url, db = sys.argv[1:3]
c = connect(url)
init_db(c, db, 0)
# an operator's constraint that no row meets: the store refuses everything
c.command(f"ALTER TABLE {db}.heartbeats ADD CONSTRAINT never CHECK 0")
"""


@pytest.mark.integration
def test_a_store_refusing_every_insert_stops_the_flow_with_one_line(
    settings: Settings, tmp_path
) -> None:
    """Inserts are tried again for ``clickhouse.outage_wait_s``, then ``megatrace run``
    ends with one line and exit code 1 (a failed insert once aborted inside Bytewax and
    the process never exited)."""
    import os
    import subprocess
    import sys

    url, db = f"chdb://{tmp_path / 'ch'}", "broken"
    subprocess.run([sys.executable, "-c", _BROKEN_TABLE, url, db], check=True, timeout=120)
    pub = publisher(settings)
    pub.publish_all(_heartbeats(2000, time.time_ns(), 1000))
    pub.flush()
    env = {
        **os.environ,
        "MEGATRACE_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "MEGATRACE_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
        "MEGATRACE_CLICKHOUSE__URL": url,
        "MEGATRACE_CLICKHOUSE__DATABASE": db,
        "MEGATRACE_CLICKHOUSE__RETENTION_DAYS": "0",
        "MEGATRACE_CLICKHOUSE__OUTAGE_WAIT_S": "1",
        "MEGATRACE_STACK__STATE_DIR": str(tmp_path / "state"),
    }
    res = subprocess.run(
        [sys.executable, "-m", "megatrace", "run", "--once", "--quiet"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]
    assert "panicked" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: an insert into ClickHouse failed") and "heartbeats" in last


@pytest.mark.integration
def test_an_unreachable_clickhouse_server_is_one_line(settings: Settings) -> None:
    res = CliRunner().invoke(
        cli,
        ["--bootstrap-servers", settings.kafka.bootstrap_servers, "--topic-prefix",
         settings.kafka.topic_prefix, "--clickhouse-url", "http://u:pw@127.0.0.1:1/db",
         "run", "--once"],
    )  # fmt: skip
    assert res.exit_code == 1, res.output
    assert res.output.startswith("Error: ") and len(res.output.splitlines()) == 1, res.output
    assert "127.0.0.1:1" in res.output and "pw" not in res.output


def _stray_records() -> tuple[list, int]:
    """A healthy 8-rank job without heartbeats (log imports have none), with records of
    ranks outside it: a collective of rank 500 on a communicator nobody else is on, a
    proxy summary towards rank 64, a heartbeat of rank 9."""
    from producers.sim.scenarios import build
    from schemas.enums import CollOp, Direction, DType
    from schemas.records import Collective, Heartbeat, ProxySummary

    run = build("healthy", scale="tiny", seed=0, steps=20)
    recs = [r for r in run.records(emit_kernels=False) if not isinstance(r, Heartbeat)]
    at = len(recs) // 3
    ts = next(r.enqueue_ns for r in recs[at:] if isinstance(r, Collective))
    job = run.spec.job
    stray = [
        Collective(job=job, node="x", rank=500, comm_hash=0xDEAD, comm_size=2, rank_in_comm=0,
                   op=CollOp.ALL_REDUCE, seq=0, count=1, size_bytes=2,
                   dtype=DType.BFLOAT16, enqueue_ns=ts),
        ProxySummary(job=job, node="x", rank=1, comm_hash=0xBEEF, seq=0, channel=0, peer=64,
                     direction=Direction.SEND, steps_posted=4, steps_done=1, size_bytes=8,
                     first_ns=ts, last_ns=ts),
        Heartbeat(job=job, node="x", rank=9, ts_ns=ts),
    ]  # fmt: skip
    return recs[:at] + stray + recs[at:], len(stray)


def test_ranks_outside_the_layout_are_dead_letters_never_evidence() -> None:
    """Once the job went quiet (a tailing flow's clock runs on), the stray collective's
    partial instance made a critical hang blaming healthy rank 0."""
    from detectors.replay import Replay
    from schemas.records import DeadLetter
    from schemas.results import Verdict

    records, n_stray = _stray_records()
    replay = Replay()
    out = [x for r in records for x in replay.update(r)]
    for k in range(1, 40):  # 40 s of silence after the last record
        out += replay.tick(replay.now_ns + k * 10**9)
    assert [v for v in out if isinstance(v, Verdict)] == []
    dead = [d for d in out if isinstance(d, DeadLetter)]
    assert {d.reason for d in dead} == {R.OUT_OF_LAYOUT} and len(dead) == n_stray
    assert any("rank 500 is outside" in d.error for d in dead)


@pytest.mark.integration
def test_the_flow_keeps_out_of_layout_records_as_dead_letters(settings: Settings, ch: Any) -> None:
    records, n_stray = _stray_records()
    pub = publisher(settings)
    pub.publish_all(records)
    pub.flush()
    run_main(build_flow(flow_config(settings)))
    db = settings.clickhouse.database
    dead = list(read_records(ch, db, "dead_letters"))
    # the stray heartbeat and proxy summary reach the job; the collective's instance does
    # at the end of the bounded input, still partial
    assert {d.reason for d in dead} == {R.OUT_OF_LAYOUT} and len(dead) == n_stray
    assert list(read_records(ch, db, "verdicts")) == []
