"""Test helpers that talk to the real broker (no mocks)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

from flows.flow_config import FlowConfig
from flows.flow_config import flow_config as make_flow_config
from infra.kafka import consumer_config, producer_config
from producers.publish import KafkaPublisher
from schemas.config import Settings
from schemas.topics import Topics


def publisher(settings: Settings) -> KafkaPublisher:
    return KafkaPublisher(
        producer_config(settings.kafka, settings.kafka.bootstrap_servers),
        Topics(prefix=settings.kafka.topic_prefix),
    )


def flow_config(settings: Settings, *, tail: bool = False) -> FlowConfig:
    return make_flow_config(
        settings, settings.kafka.bootstrap_servers, settings.clickhouse.url.get(), tail=tail
    )


def consume_all(settings: Settings, topic: str, expect: int, timeout_s: float = 20.0) -> list:
    """Read a topic from the start with manual assignment (no consumer-group join wait)."""
    conf = consumer_config(settings.kafka, settings.kafka.bootstrap_servers)
    c = Consumer(conf)
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out: list = []
        deadline = time.monotonic() + timeout_s
        while len(out) < expect and time.monotonic() < deadline:
            out.extend(m for m in c.consume(1000, timeout=0.2) if m.error() is None)
        return out
    finally:
        c.close()


def megatrace_cmd(
    settings: Settings, url: str, database: str, state: Path, *args: str
) -> list[str]:
    """The ``megatrace`` command line pointing at the test broker and a ClickHouse URL."""
    return [
        sys.executable,
        "-m",
        "megatrace",
        "--bootstrap-servers",
        settings.kafka.bootstrap_servers,
        "--topic-prefix",
        settings.kafka.topic_prefix,
        "--clickhouse-url",
        url,
        "--database",
        database,
        "--retention-days",
        "0",
        "--state-dir",
        str(state),
        *args,
    ]


def megatron_args(spec) -> dict:
    """The Megatron arguments a simulated job's spec stands for (as a config file holds them)."""
    return {
        "tensor_model_parallel_size": spec.tp,
        "pipeline_model_parallel_size": spec.pp,
        "num_layers": spec.num_layers,
        "global_batch_size": spec.global_batch_size,
        "micro_batch_size": spec.micro_batch_size,
        "world_size": spec.world_size,
        "use_distributed_optimizer": spec.distributed_optimizer,
    }


def wait_until_delivered(agent, timeout_s: float = 30.0) -> None:
    """Until the node agent has published everything it accepted (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = agent.snapshot()
        if h.accepted and h.delivered == h.accepted:
            return
        time.sleep(0.1)


class PersistentBroker:
    """noida-db's Kafka on a free local port, keeping its log in ``data_dir`` across
    restarts (test-only: the local Tansu broker is memory-only, so a
    broker restart can only be tested on this one; users bring real Kafka).

    Pinned to noida-db 0.2.2 in the test extras: 0.2.3's binary needs glibc 2.39."""

    def __init__(self, data_dir: Path) -> None:
        from infra.broker import free_port

        self.data_dir = data_dir
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        import os
        import socket
        from importlib.resources import files

        binary = str(files("noida_db").joinpath("noida-db"))
        os.chmod(binary, 0o755)  # a wheel may not keep the bit
        cmd = [binary, "start", "--only", "kafka", "--kafka-port", str(self.port)]
        log = open(self.data_dir.parent / "noida.log", "ab")  # noqa: SIM115 - the child's
        self._proc = subprocess.Popen([*cmd, "--data-dir", str(self.data_dir)], stdout=log,
                                      stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"noida-db exited with {self._proc.returncode}") from None
                time.sleep(0.1)
        raise RuntimeError(f"noida-db did not listen on {self.port} within {timeout_s} s")

    def stop(self) -> None:
        """SIGTERM: it saves its log and exits (it saves lazily: after a kill -9 it may come
        back without its newest records)."""
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(30)
            self._proc = None


def latest_verdicts(json_lines: str) -> list[dict]:
    """``megatrace analyze --json`` prints every revision: each incident's newest one, in
    the order the incidents were first told."""
    import json

    latest: dict[str, dict] = {}
    for line in json_lines.splitlines():
        v = json.loads(line)
        latest[v["verdict_id"]] = v
    return list(latest.values())


def instance(comm, seq, ranks, arrivals, ends, size=2, sender=-1, op=None):
    """An aligned instance of job "j" (all-reduce unless ``op`` says), as the aligner makes it."""
    from detectors.align import Instance
    from schemas.enums import CollOp

    op = CollOp.ALL_REDUCE if op is None else op
    return Instance(
        "j",
        comm,
        seq,
        op,
        sender,
        size,
        8,
        tuple(ranks),
        tuple(arrivals),
        tuple(arrivals),
        tuple(ends),
    )
