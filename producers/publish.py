"""Publishing records to Kafka: topic and key from :mod:`schemas.topics`, bytes from the codec."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from schemas.codec import encode
from schemas.records import event_time
from schemas.topics import Topics, message_key


class PublishError(RuntimeError):
    """Records could not be delivered to the broker."""


class KafkaPublisher:
    """An idempotent Kafka producer for schema records.

    ``config`` is a librdkafka configuration (see :func:`infra.kafka.producer_config`).
    Delivery failures are counted per error; :meth:`flush` raises if any occurred.
    ``first_offsets`` keeps, per (topic, partition), the offset of the first record
    delivered there (a partition's deliveries are reported in order): where a flow that
    reads only these records starts (``FlowConfig.start_offsets``).
    """

    def __init__(self, config: dict[str, str], topics: Topics) -> None:
        from confluent_kafka import Producer

        self._producer = Producer(config)
        self.topics = topics
        self.sent = 0
        self.delivered = 0
        self.failed: Counter[str] = Counter()
        self.first_offsets: dict[tuple[str, int], int] = {}

    def _on_delivery(self, err: object, msg: Any) -> None:
        if err is None:
            self.delivered += 1
            self.first_offsets.setdefault((msg.topic(), msg.partition()), msg.offset())
        else:
            self.failed[str(err)] += 1

    def publish(self, record: msgspec.Struct) -> None:
        self.publish_raw(self.topics.for_record(record), message_key(record), encode(record))

    def publish_raw(self, topic: str, key: bytes | None, value: bytes) -> None:
        """Publish pre-encoded bytes (used for dead letters and for tests of bad input)."""
        while True:
            try:
                self._producer.produce(topic, value=value, key=key, on_delivery=self._on_delivery)
                break
            except BufferError:  # local queue full: let it drain
                self._producer.poll(0.05)
        self.sent += 1
        if self.sent % 10_000 == 0:
            self._producer.poll(0)

    def publish_all(self, records: Iterable[msgspec.Struct]) -> int:
        n = 0
        for rec in records:
            self.publish(rec)
            n += 1
        return n

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait for every record to be acknowledged; raise :class:`PublishError` otherwise."""
        remaining = self._producer.flush(timeout_s)
        if remaining:
            raise PublishError(f"{remaining} records still undelivered after {timeout_s}s")
        if self.failed:
            raise PublishError(f"delivery failed: {dict(self.failed)}")


def paced_by_time(records: Iterable[msgspec.Struct], speed: float) -> Iterator[msgspec.Struct]:
    """Yield records no faster than their timestamps (x ``speed``) allow."""
    t_wall0, t_ev0 = time.monotonic(), None
    for rec in records:
        ev = event_time(rec)
        if ev:
            t_ev0 = t_ev0 or ev
            lag = (ev - t_ev0) / 1e9 / speed - (time.monotonic() - t_wall0)
            if lag > 0.001:
                time.sleep(lag)
        yield rec
