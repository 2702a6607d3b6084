"""librdkafka client settings and topic administration, for any Kafka-protocol broker.

Nothing here depends on which broker runs: the same settings reach the local
Tansu broker and a production Kafka cluster (SASL/TLS included).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from schemas.config import KafkaSettings
from schemas.topics import Topics


class KafkaSetupError(RuntimeError):
    """A topic could not be created or the broker could not be reached."""


class LogThrottle(logging.Filter):
    """One line of each kind of librdkafka message per ``every_s``, the next one saying
    how many were held back.

    A broker that goes away makes every client of a process log each reconnect attempt:
    a flow's consumers wrote some 180 lines a second here, burying everything else. A
    kind is the message with its numbers blanked (client ids, ports, milliseconds), so
    the same failure of every consumer is one line.

    >>> t = LogThrottle(every_s=30)
    >>> def rec(msg):
    ...     return logging.LogRecord("k", logging.ERROR, "", 0, msg, None, None)
    >>> [t.filter(rec(f"consumer-{i}: Connect to 127.0.0.1:{9000 + i} failed")) for i in range(3)]
    [True, False, False]
    >>> t.filter(rec("another failure"))
    True
    """

    def __init__(self, every_s: float = 30.0, max_kinds: int = 1000) -> None:
        super().__init__()
        self.every_s = every_s
        self.max_kinds = max_kinds
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        kind = re.sub(r"\d+", "#", text)
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        if len(self._last) >= self.max_kinds:  # bounded: forget the kinds seen so far
            self._last.clear()
            self._held.clear()
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        if held:
            record.msg, record.args = f"{text} ({held} more like it held back)", None
        return True


#: librdkafka's own log lines (every client below logs here, throttled; with no logging
#: configured, Python prints warnings and errors to stderr)
KAFKA_LOG = logging.getLogger("megatrace.kafka")
KAFKA_LOG.addFilter(LogThrottle())


def client_config(kafka: KafkaSettings, bootstrap: str) -> dict[str, Any]:
    """Connection settings shared by producers, consumers and admin clients."""
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "security.protocol": kafka.security_protocol,
        "logger": KAFKA_LOG,
    }
    if kafka.sasl_mechanism:
        conf["sasl.mechanism"] = kafka.sasl_mechanism
        conf["sasl.username"] = kafka.sasl_username
        conf["sasl.password"] = kafka.sasl_password.get()
    if kafka.ssl_ca_location:
        conf["ssl.ca.location"] = kafka.ssl_ca_location
    conf.update(kafka.client_options)
    return conf


def producer_config(kafka: KafkaSettings, bootstrap: str) -> dict[str, Any]:
    """An idempotent, batching producer: no duplicates from its own retries, ordered per key."""
    conf: dict[str, Any] = {
        "enable.idempotence": "true",
        "acks": "all",
        "linger.ms": "5",
        "batch.num.messages": "10000",
        "queue.buffering.max.messages": "1000000",
        "message.timeout.ms": "300000",
    }
    conf.update(client_config(kafka, bootstrap))
    return conf


def consumer_config(kafka: KafkaSettings, bootstrap: str) -> dict[str, Any]:
    """A consumer that keeps up under backlog and commits nothing itself.

    ``fetch.queue.backoff.ms``: librdkafka's default backs off for long once its
    queue is full, and a consumer under backlog then stalls for a good part of a
    second at a time; a short backoff keeps it fetching.

    ``fetch.wait.max.ms``: a flow holds a consumer per topic partition, and each idle
    one asks again whenever its fetch expires; an empty fetch costs the broker CPU,
    and a broker that does not answer a waiting fetch the moment records come (the
    local one) adds up to this wait to the latency. 200 ms trades the two; the
    pipeline bench (``megatrace bench pipeline``) prints both the rates and the
    latency it gives.

    ``queued.min.messages`` / ``queued.max.messages.kbytes``: what a consumer fetches
    ahead of the flow, per partition. librdkafka's defaults (100,000 messages, 64 MB)
    let a flow's consumers hold a gigabyte read ahead, whose threads then spend their
    CPU refilling queues the flow is not reading; two polls' worth (10,000 records,
    8 MB) is enough to keep the flow fed.
    """
    conf: dict[str, Any] = {
        "group.id": "megatrace",
        "enable.auto.commit": "false",
        "auto.offset.reset": "earliest",
        "fetch.queue.backoff.ms": "10",
        "fetch.wait.max.ms": "200",
        "queued.min.messages": "10000",
        "queued.max.messages.kbytes": "8192",
    }
    conf.update(client_config(kafka, bootstrap))
    return conf


def ensure_topics(
    kafka: KafkaSettings, bootstrap: str, topics: Topics, timeout_s: float = 15.0
) -> list[str]:
    """Create the missing ones of ``topics.all`` with their partitions
    (:meth:`Topics.partitions` of the configured number) and settings
    (:meth:`Topics.config`); return those created. Existing topics are left as they are."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(client_config(kafka, bootstrap))
    existing = set(_metadata(admin, bootstrap, timeout_s).topics)
    wanted = [t for t in topics.all if t not in existing]
    if not wanted:
        return []
    futures = admin.create_topics(
        [
            NewTopic(
                t,
                num_partitions=topics.partitions(t, kafka.partitions),
                replication_factor=kafka.replication_factor,
                config=topics.config(t),
            )
            for t in wanted
        ],
        request_timeout=timeout_s,
    )
    created = []
    for topic, fut in futures.items():
        try:
            fut.result()
            created.append(topic)
        except KafkaException as e:
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise KafkaSetupError(f"cannot create topic {topic}: {e}") from None
    return created


def topic_partitions(
    conf: dict[str, Any], names: list[str], timeout_s: float = 15.0
) -> dict[str, list[int]]:
    """Each of ``names`` with its partitions, asked of the cluster that the librdkafka
    client settings ``conf`` (a consumer's, say) reach; :class:`KafkaSetupError` when it
    does not answer within ``timeout_s`` or lacks a topic (a flow reads only existing
    topics: ``megatrace stack up`` makes them)."""
    from confluent_kafka.admin import AdminClient

    bootstrap = conf["bootstrap.servers"]
    client = {  # the connection's settings only: an admin client warns of a consumer's
        k: v
        for k, v in conf.items()
        if k in ("bootstrap.servers", "security.protocol", "logger")
        or k.startswith(("sasl.", "ssl."))
    }
    topics = _metadata(AdminClient(client), bootstrap, timeout_s).topics
    missing = [t for t in names if t not in topics]
    if missing:
        raise KafkaSetupError(
            f"topic {', '.join(missing)} does not exist at {bootstrap}: run `megatrace stack "
            "up` (it creates the topics, also on a broker of your own)"
        )
    return {t: sorted(topics[t].partitions) for t in names}


def _metadata(admin: Any, bootstrap: str, timeout_s: float) -> Any:
    from confluent_kafka import KafkaException

    try:
        return admin.list_topics(timeout=timeout_s)
    except KafkaException as e:
        raise KafkaSetupError(f"cannot reach Kafka at {bootstrap}: {e}") from None


def delete_topics(
    kafka: KafkaSettings, bootstrap: str, topics: Topics, timeout_s: float = 15.0
) -> None:
    """Delete ``topics.all`` with what they hold (a benchmark's own topics, once done)."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(client_config(kafka, bootstrap))
    futures = admin.delete_topics(list(topics.all), operation_timeout=timeout_s)
    for topic, fut in futures.items():
        try:
            fut.result()
        except KafkaException as e:
            if e.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise KafkaSetupError(f"cannot delete topic {topic}: {e}") from None
