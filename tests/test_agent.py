"""The node agent and its spool: nothing accepted is lost across a broker outage."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from infra.broker import LocalBroker
from infra.kafka import ensure_topics
from producers.agent import NodeAgent
from producers.agent_client import AgentClient
from producers.agent_publish import pack, unpack
from producers.spool import Spool
from schemas.codec import decode, encode
from schemas.config import AgentSettings, Settings, load_settings
from schemas.records import DeadLetter, Heartbeat
from schemas.topics import Topics
from tests.helpers import consume_all

# --------------------------------------------------------------------------- spool


def test_spool_keeps_order_across_segments_and_reopens_at_its_cursor(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1024)
    items = [f"record-{i:04d}".encode() * 3 for i in range(200)]
    assert sp.append(items) == 200
    before = len(list(tmp_path.glob("*.seg")))
    assert before > 5
    first = sp.read(120)
    assert [p for p, _ in first] == items[:120]
    sp.commit(first[-1][1])
    sp.close()
    again = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1024)  # a restarted agent
    assert [p for p, _ in again.read(1000)] == items[120:]
    assert len(list(tmp_path.glob("*.seg"))) <= before - 4  # delivered segments were freed


def test_spool_cuts_a_torn_write_and_keeps_what_was_whole(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20)
    sp.append([b"one", b"two"])
    sp.close()
    seg = next(tmp_path.glob("*.seg"))
    with open(seg, "ab") as f:
        f.write(b"\x40\x00\x00\x00garbage")  # a crash in the middle of a frame
    sp = Spool(tmp_path, max_bytes=1 << 20)
    sp.append([b"three"])
    assert [p for p, _ in sp.read(10)] == [b"one", b"two", b"three"]


def test_a_full_spool_refuses_and_counts(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=4096, segment_bytes=1024)
    taken = sp.append([b"x" * 100] * 100)
    assert taken < 100 and sp.dropped == 100 - taken
    batch = sp.read(1000)
    sp.commit(batch[-1][1])
    assert sp.append([b"y" * 100] * 5) == 5  # room again once delivered


def test_rewind_rereads_from_the_last_commit(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20)
    sp.append([b"a", b"b", b"c"])
    sp.commit(sp.read(1)[0][1])
    assert [p for p, _ in sp.read(5)] == [b"b", b"c"]
    sp.rewind()
    assert [p for p, _ in sp.read(5)] == [b"b", b"c"]


# --------------------------------------------------------------------------- stamping


def test_the_agent_stamps_validates_and_dead_letters(tmp_path: Path) -> None:
    agent = NodeAgent(
        AgentSettings(job="job-7", node="gpu-node-3", spool_dir=str(tmp_path / "spool")),
        {"bootstrap.servers": "127.0.0.1:1"},
        Topics(prefix="t."),
        tmp_path,
    )
    bare = b'{"type":"hb","rank":5,"ts_ns":1}'  # no job, no node (the NCCL plugin)
    full = encode(Heartbeat(job="j", node="n", rank=1, ts_ns=2))
    assert agent.accept([bare, full, b"{not json", b""]) == 3
    frames = [unpack(p) for p, _ in agent.spool.read(10)]
    (t1, k1, v1), (t2, _, v2), (t3, _, v3) = frames
    stamped = decode(v1)
    assert (t1, stamped.job, stamped.node, stamped.rank) == (
        "t.heartbeat",
        "job-7",
        "gpu-node-3",
        5,
    )
    assert k1 == b"job-7" or k1  # keyed like any record
    assert decode(v2).job == "j" and t2 == "t.heartbeat"
    dead = msgspec.json.decode(v3, type=DeadLetter)
    assert t3 == "t.deadletter" and dead.reason.value == "malformed" and dead.raw == b"{not json"
    assert (agent.health.accepted, agent.health.refused) == (3, 1)


def test_frames_round_trip() -> None:
    assert unpack(pack("topic", b"key", b"value")) == ("topic", b"key", b"value")
    assert unpack(pack("topic", None, b"v")) == ("topic", None, b"v")


def _beats(first: int, n: int) -> list[Heartbeat]:
    return [Heartbeat(job="j", node="n", rank=0, ts_ns=i) for i in range(first, first + n)]


def test_the_client_holds_what_the_agent_cannot_take_yet_and_delivers_it_in_order(
    tmp_path: Path,
) -> None:
    """A Unix datagram socket queues only ~10 datagrams: records sent before the agent
    listens, and a burst while it does not read, wait in the client (which returns at
    once) and arrive, all and in order, once the agent reads."""
    path = tmp_path / "agent.sock"
    client = AgentClient(path)
    client.send(_beats(0, 10))  # no agent yet
    assert (client.sent, client.pending, client.dropped) == (0, 10, 0)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))  # the agent listens, busy: it reads nothing for now
    for first in range(10, 3010, 20):  # 150 datagrams: far more than its queue holds
        client.send(_beats(first, 20))
    assert client.pending > 0 and client.dropped == 0
    got: list[int] = []
    server.settimeout(5)
    while len(got) < 3010:
        if client.pending:
            client.flush(0.01)
        got += [decode(line).ts_ns for line in server.recv(1 << 16).split(b"\n")]
    server.close()
    assert got == list(range(3010)) and (client.sent, client.pending) == (3010, 0)


def test_the_clients_backlog_is_bounded_and_drops_its_oldest(tmp_path: Path) -> None:
    client = AgentClient(tmp_path / "nobody.sock", backlog_bytes=1 << 16)
    for first in range(0, 6000, 100):
        client.send(_beats(first, 100))
    assert client.dropped > 0 and client.pending + client.dropped == 6000
    with pytest.raises(ValueError, match="backlog_bytes"):
        AgentClient(tmp_path / "a.sock", backlog_bytes=10)
    client.close(timeout_s=0)  # nobody ever came: what waited is counted as dropped
    assert (client.sent, client.pending, client.dropped) == (0, 0, 6000)


# --------------------------------------------------------------------------- outage


def _health(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _wait(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _send(client: AgentClient, first: int, n: int) -> None:
    for start in range(first, first + n, 100):
        client.send(
            Heartbeat(job="outage", node="n0", rank=i % 8, ts_ns=1_000_000 + i)
            for i in range(start, min(start + 100, first + n))
        )
        time.sleep(0.005)
    assert client.dropped == 0


@pytest.mark.integration
def test_killing_the_broker_loses_nothing_the_agent_accepted(tmp_path: Path) -> None:
    """What this proves: records the agent accepted while the broker was dead, and
    those it had not yet delivered when the broker was killed, all reach the
    restarted broker, once each and in order per key. (The local broker keeps
    its log in memory, so what it had already acknowledged before the kill dies
    with it: that part is checked before the kill.)"""
    broker = LocalBroker(tmp_path / "broker")
    info, _ = broker.up()
    settings: Settings = load_settings(
        overrides={
            "kafka": {"bootstrap_servers": info.bootstrap, "topic_prefix": "o.", "partitions": 2}
        }
    )
    topics = Topics(prefix="o.")
    ensure_topics(settings.kafka, info.bootstrap, topics)
    sock, health = tmp_path / "agent.sock", tmp_path / "health.json"
    cmd = [sys.executable, "-m", "megatrace", "--bootstrap-servers", info.bootstrap]
    cmd += ["--topic-prefix", "o.", "--state-dir", str(tmp_path / "state"), "agent"]
    cmd += ["--socket", str(sock), "--spool-dir", str(tmp_path / "spool")]
    cmd += ["--health-file", str(health), "--health-interval-s", "0.2"]
    # the restarted local broker forgot the idempotent producer's state, which wedges
    # that producer: the agent's stall watchdog (3 s here) resends from the spool
    env = {**os.environ, "MEGATRACE_AGENT__STALL_S": "3"}
    log = open(tmp_path / "agent.log", "w")  # noqa: SIM115 (a pipe could fill and block it)
    agent = subprocess.Popen(cmd, stderr=log, env=env)
    try:
        _wait(sock.exists, 30, "the agent's socket")
        client = AgentClient(sock)
        _send(client, 0, 2000)
        _wait(lambda: _health(health).get("delivered") == 2000, 60, "phase 1 delivery")
        got = consume_all(settings, topics.heartbeat, 2000)
        assert len(got) == 2000
        os.kill(info.pid, signal.SIGKILL)  # the broker dies while the agent keeps publishing
        _send(client, 2000, 3000)
        _wait(lambda: _health(health).get("accepted") == 5000, 30, "phase 2 accepted")
        time.sleep(1.0)
        h = _health(health)
        assert h["delivered"] == 2000 and h["pending_bytes"] > 0
        broker._forget()
        broker.up(port=info.port)
        ensure_topics(settings.kafka, info.bootstrap, topics)  # an empty broker again
        _wait(lambda: _health(health).get("delivered", 0) >= 5000, 120, "the spool to drain")
        msgs = consume_all(settings, topics.heartbeat, 3000, timeout_s=30)
        seen = [decode(m.value()).ts_ns - 1_000_000 for m in msgs]
        assert sorted(seen) == list(range(2000, 5000))  # all of them, none twice
        per_rank: dict[int, list[int]] = {}
        for i in seen:
            per_rank.setdefault(i % 8, []).append(i)
        assert all(v == sorted(v) for v in per_rank.values())  # in order per key
        # the health file is written every 0.2 s: it may have caught the delivered count
        # before the spool's cursor was committed past them
        _wait(lambda: _health(health)["pending_bytes"] == 0, 10, "the spool to be empty")
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
        log.close()
        broker.down()
    err = (tmp_path / "agent.log").read_text()
    assert agent.returncode == 0, err
    assert "agent stopped: in 5000 out 5000 dropped 0" in err


def test_the_agent_follows_files_in_whole_lines_and_remembers_where_it_was(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "rank0.jsonl"
    log.parent.mkdir()
    settings = AgentSettings(tail=[str(log.parent / "*.jsonl")], spool_dir=str(tmp_path / "spool"))

    def agent() -> NodeAgent:
        return NodeAgent(
            settings, {"bootstrap.servers": "127.0.0.1:1"}, Topics(prefix="t."), tmp_path
        )

    hb = [encode(Heartbeat(job="j", node="n", rank=0, ts_ns=i)) for i in range(3)]
    log.write_bytes(hb[0] + b"\n" + hb[1][:10])  # the second line is still being written
    first = agent()
    assert first.tail_once() == 1
    with open(log, "ab") as f:
        f.write(hb[1][10:] + b"\n")
    assert first.tail_once() == 1
    first.spool.close()
    with open(log, "ab") as f:
        f.write(hb[2] + b"\n")
    again = agent()  # a restarted agent goes on from its saved offsets
    assert again.tail_once() == 1
    assert [decode(unpack(p)[2]).ts_ns for p, _ in again.spool.read(10)] == [0, 1, 2]
