"""The broker goes away mid-run (stopped, as in a rolling restart) and comes back.

What this proves: the flow's consumers ride through a broker restart (librdkafka
reconnects by itself), and a bounded run (``megatrace run --once``, the demo, the
bench) waits for an unreachable broker instead of taking its silence for the end of
its input: every record published before the outage and after it is stored,
exactly once. The broker is noida-db's Kafka, which keeps its log on disk (the
local Tansu broker is memory-only: restarted, it would have lost what it held).
Not covered: a broker killed outright (noida-db saves its log lazily, so after a
kill -9 it may come back without its newest records, which no consumer can fix).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from bytewax.testing import run_main

from flows.main import build_flow
from infra.kafka import ensure_topics
from producers.sim.scenarios import build
from schemas.config import Settings, load_settings
from schemas.records import Collective, Heartbeat
from schemas.tables import TABLE_FOR
from schemas.topics import Topics
from tests.helpers import PersistentBroker, flow_config, publisher

pytest.importorskip("noida_db")
pytestmark = [pytest.mark.integration, pytest.mark.serial]


@pytest.fixture
def outage_broker(tmp_path: Path) -> Any:
    broker = PersistentBroker(tmp_path / "noida")
    broker.start()
    yield broker
    broker.stop()


def test_a_bounded_run_waits_through_a_broker_restart_and_stores_everything_once(
    outage_broker: PersistentBroker,
    clickhouse_url: str,
    database: str,
    ch: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings: Settings = load_settings(
        overrides={
            "kafka": {
                "bootstrap_servers": outage_broker.bootstrap,
                "topic_prefix": "out.",
                "partitions": 2,
            },
            "clickhouse": {"url": clickhouse_url, "database": database, "retention_days": 0},
            "stack": {"state_dir": str(tmp_path / "state")},
        }
    )
    ensure_topics(settings.kafka, outage_broker.bootstrap, Topics(prefix="out."))
    records = list(build("healthy", scale="tiny", seed=0, steps=6).records())
    half = len(records) // 2
    pub = publisher(settings)
    pub.publish_all(records[:half])
    pub.flush()

    reading = threading.Event()
    cfg = dataclasses.replace(
        flow_config(settings), idle_stop_s=2.0, on_read=lambda n: reading.set(), console=False
    )
    flow = threading.Thread(target=run_main, args=(build_flow(cfg),), daemon=True)
    flow.start()
    assert reading.wait(60), "the flow read nothing"
    outage_broker.stop()
    time.sleep(5.0)  # well past idle_stop_s: silence, but the broker's, not the input's
    assert flow.is_alive(), "a bounded run took the broker's outage for the end of its input"
    # the outage is told, but not once per reconnect attempt of every consumer (some 180
    # lines a second here when librdkafka wrote to stderr itself)
    told = [r for r in caplog.records if r.name == "megatrace.kafka"]
    assert 1 <= len(told) <= 30, [r.getMessage() for r in told][:40]
    outage_broker.start()
    pub = publisher(settings)
    pub.publish_all(records[half:])  # only after the restart: read only if the flow waited
    pub.flush()
    flow.join(180)
    assert not flow.is_alive()

    want = Counter(TABLE_FOR[type(r)].name for r in records)
    db = settings.clickhouse.database
    for table, n in want.items():
        got = ch.query(f"SELECT count() FROM {db}.{table} FINAL").result_rows[0][0]
        assert got == n, f"{table}: {got} rows stored of {n} published"


@pytest.mark.parametrize("heartbeats", [True, False], ids=["heartbeats", "no-heartbeats"])
def test_a_tailing_flow_goes_on_detecting_after_a_broker_restart(
    outage_broker: PersistentBroker, tmp_path: Path, heartbeats: bool
) -> None:
    """``megatrace run`` (tailing) reads a job as its producers send it; its broker stops
    and starts again (the producers buffer meanwhile), and the job's hang, which comes
    after the restart, is announced on the console, and nothing else. Without heartbeats
    (old logs, some sources) the watchdog's clock follows the wall while records stop:
    the broker's outage must not count, or every job would look hung at every outage."""
    import subprocess

    from tests.helpers import megatrace_cmd

    settings = load_settings(
        overrides={"kafka": {"bootstrap_servers": outage_broker.bootstrap, "partitions": 2}}
    )
    run = build("missing-recv", scale="tiny", seed=0, steps=20)
    records = [r for r in run.records() if heartbeats or not isinstance(r, Heartbeat)]
    cmd = megatrace_cmd(settings, f"chdb://{tmp_path / 'ch'}", "tail", tmp_path, "stack", "up")
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)  # topics on that broker
    flow = subprocess.Popen(
        [*cmd[:-2], "run"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    # the outage comes in the job's first steps (its hang is at step 7 of 20), before the
    # last member's record of a collective the others joined: just what a hang looks like
    first = next(
        i for i in range(len(records) // 6, len(records)) if isinstance(records[i], Collective)
    )
    key = (records[first].comm_hash, records[first].seq)
    members = [
        i
        for i, r in enumerate(records)
        if isinstance(r, Collective) and (r.comm_hash, r.seq) == key
    ]
    assert len(members) >= 2
    cut = members[-1]  # every member but the last is read before the outage
    before = [records[i : i + cut // 10 + 1] for i in range(0, cut, cut // 10 + 1)]
    rest = records[cut:]
    after = [rest[i : i + len(rest) // 50 + 1] for i in range(0, len(rest), len(rest) // 50 + 1)]
    delivered, restarted = threading.Event(), threading.Event()

    def produce() -> None:  # a steady stream over some 6 s, the outage in the middle
        pub = publisher(settings)
        for chunk in before:
            pub.publish_all(chunk)
            time.sleep(0.1)
        pub.flush()
        delivered.set()
        restarted.wait(60)
        pub = publisher(settings)  # the restarted broker forgot the idempotent producer
        for chunk in after:
            pub.publish_all(chunk)
            time.sleep(0.1)
        pub.flush()

    try:
        time.sleep(10.0)  # the flow is up (it checks the broker and topics as it starts)
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        assert delivered.wait(60)
        outage_broker.stop()
        time.sleep(3.0)  # longer than the hang timeout: only the broker is silent
        outage_broker.start()
        restarted.set()
        producer.join(120)
        lines: list[str] = []
        stdout = flow.stdout
        assert stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(stdout), daemon=True)
        reader.start()  # (a line at a time, until the flow is stopped)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("hang:" in x for x in lines):
            time.sleep(0.2)
        hang = [x for x in lines if "hang:" in x]
        assert hang, f"no hang announced after the restart: {lines[-5:]}"
        # and nothing else: the broker's silence was no job's (a watchdog that took it for
        # the job's would have called a hang during the outage)
        verdicts = [x for x in lines if x.startswith("[")]
        assert verdicts == hang[:1] and f"rank {run.faults[0].rank} " in hang[0], verdicts
    finally:
        flow.kill()
        flow.wait(30)


def test_a_bounded_run_whose_broker_never_comes_back_fails_saying_so(
    outage_broker: PersistentBroker, clickhouse_url: str, database: str, tmp_path: Path
) -> None:
    from flows.kafka_source import BrokerLost

    settings = load_settings(
        overrides={
            "kafka": {
                "bootstrap_servers": outage_broker.bootstrap,
                "topic_prefix": "gone.",
                "partitions": 2,
                "outage_wait_s": 3.0,
            },
            "clickhouse": {"url": clickhouse_url, "database": database, "retention_days": 0},
        }
    )
    ensure_topics(settings.kafka, outage_broker.bootstrap, Topics(prefix="gone."))
    pub = publisher(settings)
    pub.publish_all(list(build("healthy", scale="tiny", seed=0, steps=2).records()))
    pub.flush()
    reading = threading.Event()
    cfg = dataclasses.replace(flow_config(settings), on_read=lambda n: reading.set())
    assert cfg.outage_wait_s == 3.0  # from the settings' one home
    failed: list[BaseException] = []

    def run() -> None:
        try:
            run_main(build_flow(dataclasses.replace(cfg, console=False)))
        except BaseException as e:  # kept for the assertion
            failed.append(e)

    flow = threading.Thread(target=run, daemon=True)
    flow.start()
    assert reading.wait(60)
    outage_broker.stop()
    started = time.monotonic()
    flow.join(60)
    assert not flow.is_alive() and failed
    cause: BaseException | None = failed[0]
    while cause is not None and not isinstance(cause, BrokerLost):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None, failed[0]
    assert "did not answer for 3 s" in str(cause)
    assert time.monotonic() - started < 20  # it gave up after outage_wait_s, not never


def test_the_command_line_tells_a_lost_broker_in_one_line() -> None:
    import click

    from flows.kafka_source import BrokerLost
    from megatrace.cli import _flow_errors_are_one_line

    lost = pytest.raises(click.ClickException, match="did not answer for 300 s")
    with lost, _flow_errors_are_one_line():
        try:
            raise BrokerLost("the Kafka broker did not answer for 300 s")
        except BrokerLost as e:
            raise RuntimeError("error calling next_batch") from e  # as Bytewax wraps it
    with pytest.raises(ValueError), _flow_errors_are_one_line():
        raise ValueError("anything else goes on as it is")


class _Asking:
    """A partition's consumer, counting the questions put to the broker."""

    def __init__(self, consumer: Any, asked: list[float]) -> None:
        self._consumer, self._asked = consumer, asked

    def list_topics(self, *args: Any, **kwargs: Any) -> Any:
        self._asked.append(time.monotonic())
        return self._consumer.list_topics(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def test_a_bounded_runs_partitions_ending_together_ask_the_broker_once(
    settings: Settings, broker: Any
) -> None:
    """Quiet is the end of a bounded run's input only if the broker answers. Its partitions
    go quiet together: one answer serves them all, instead of one question per partition,
    each paid before the run could end."""
    from flows.kafka_source import RawKafkaSource
    from infra.kafka import consumer_config

    topics = Topics(prefix=settings.kafka.topic_prefix)
    src = RawKafkaSource(
        consumer_config(settings.kafka, broker.bootstrap),
        [topics.comm, topics.heartbeat],
        tail=False,
        idle_stop_s=0.2,
    )
    parts = [src.build_part("in", p, None) for p in src.list_parts()]
    assert len(parts) >= 4
    asked: list[float] = []
    for p in parts:
        p._consumer = _Asking(p._consumer, asked)
    ended: set[int] = set()
    deadline = time.monotonic() + 30
    while len(ended) < len(parts) and time.monotonic() < deadline:
        for i, p in enumerate(parts):
            if i not in ended:
                try:
                    p.next_batch()
                except StopIteration:
                    ended.add(i)
        time.sleep(0.01)
    for p in parts:
        p.close()
    assert len(ended) == len(parts), "the quiet partitions did not end"
    assert len(asked) == 1, f"the broker was asked {len(asked)} times"
