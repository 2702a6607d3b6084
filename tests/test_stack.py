"""The local broker: started once, health-checked, and only our own process is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.broker import BrokerInfo, LocalBroker, broker_binary, free_port

pytestmark = pytest.mark.integration


def _megatrace(state: Path, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "megatrace", "--state-dir", str(state), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=state.parent,
    )
    return out.stdout


def test_stack_up_twice_starts_one_broker_and_down_stops_only_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    stranger = subprocess.Popen(  # someone else's broker on this machine
        [broker_binary(), "broker", "--listener-url", f"tcp://127.0.0.1:{free_port()}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        first = _megatrace(state, "stack", "up")
        assert "broker started" in first
        second = _megatrace(state, "stack", "up")
        assert "already running" in second
        pid = int((state / "broker.pid").read_text())
        assert f"pid {pid}" in first and f"pid {pid}" in second
        assert "running at 127.0.0.1:" in _megatrace(state, "stack", "status")
        assert "broker stopped" in _megatrace(state, "stack", "down")
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
        assert stranger.poll() is None, "stack down must not touch a broker it did not start"
        assert "no local broker was running" in _megatrace(state, "stack", "down")
        assert "not running" in _megatrace(state, "stack", "status")
    finally:
        stranger.send_signal(signal.SIGTERM)
        stranger.wait(10)


def test_a_recycled_pid_is_not_mistaken_for_our_broker(tmp_path: Path) -> None:
    broker = LocalBroker(tmp_path)
    info, started = broker.up()
    assert started
    os.kill(info.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while broker._alive(info.pid) and time.monotonic() < deadline:  # reaps it when it dies
        time.sleep(0.05)
    # the state files still name the dead pid; status must not trust them
    assert broker.status() is None
    assert broker.down() is False


def test_topics_are_made_once_and_deleted_with_what_they_hold(broker: BrokerInfo) -> None:
    """What ``bench pipeline`` does with its own topics: the local broker keeps everything
    in memory, so a benchmark run must not leave its 700,000 records behind."""
    from confluent_kafka.admin import AdminClient

    from infra.kafka import client_config, delete_topics, ensure_topics
    from schemas.config import load_settings
    from schemas.topics import Topics

    kafka = load_settings(overrides={"kafka": {"bootstrap_servers": broker.bootstrap}}).kafka
    topics = Topics(prefix=f"del{time.time_ns() % 10**9}.")
    admin = AdminClient(client_config(kafka, broker.bootstrap))

    def listed() -> set[str]:
        return {t for t in admin.list_topics(timeout=10).topics if t.startswith(topics.prefix)}

    assert set(ensure_topics(kafka, broker.bootstrap, topics)) == set(topics.all)
    assert ensure_topics(kafka, broker.bootstrap, topics) == []  # made once
    assert listed() == set(topics.all)
    delete_topics(kafka, broker.bootstrap, topics)
    assert listed() == set()
    delete_topics(kafka, broker.bootstrap, topics)  # already gone: not an error
