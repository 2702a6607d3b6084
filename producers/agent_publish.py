"""The node agent's publisher: its spool sent to Kafka in order, without loss.

A spool entry is a frame (:func:`pack`): the topic, the key and the record's bytes. The
publisher reads entries after the spool's cursor, keeps at most ``max_inflight`` in
flight with the agent's idempotent, compressing producer, and moves the cursor only over
the leading entries the broker acknowledged. A refusal, or no delivery for ``stall_s``,
takes back everything in flight and resends from the cursor, in order, with a fresh
producer: the broker sees every record at least once, in spool order.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from producers.spool import Position, Spool

if TYPE_CHECKING:
    from producers.agent import AgentHealth

# the agent's log: the publisher is its thread, and operators filter on that name
log = logging.getLogger("producers.agent")


def pack(topic: str, key: bytes | None, value: bytes) -> bytes:
    """One spool entry: the topic, the key and the record's bytes.

    >>> unpack(pack("megatrace.hb", b"job-1", b"{}"))
    ('megatrace.hb', b'job-1', b'{}')
    """
    t, k = topic.encode(), key or b""
    return struct.pack("<BH", len(t), len(k)) + t + k + value


def unpack(frame: bytes) -> tuple[str, bytes | None, bytes]:
    """The topic, key (None: none) and bytes of a spool entry."""
    nt, nk = struct.unpack_from("<BH", frame)
    t = frame[3 : 3 + nt].decode()
    k = frame[3 + nt : 3 + nt + nk]
    return t, (k or None), frame[3 + nt + nk :]


class SpoolPublisher:
    """Sends a spool to Kafka (see the module docstring); its health is the agent's."""

    def __init__(
        self,
        spool: Spool,
        lock: threading.Lock,
        health: AgentHealth,
        producer_config: dict[str, str],
        *,
        max_inflight: int,
        stall_s: float,
        stop: threading.Event,
    ) -> None:
        self.spool, self.lock, self.health = spool, lock, health
        self.producer_config = producer_config
        self.max_inflight, self.stall_s = max_inflight, stall_s
        self.stop = stop  # set: stop taking new entries, deliver what is in flight
        self.drain_deadline = float("inf")

    def run(self) -> None:
        """Publish until stopped, then for up to :attr:`drain_deadline` while records are
        in flight."""
        from confluent_kafka import KafkaError, Producer

        def on_error(err: KafkaError) -> None:
            self.health.last_error = err.name()
            if err.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT):
                self.health.broker_up = False

        conf = {**self.producer_config, "error_cb": on_error}
        producer = Producer(conf)
        # (position, status) in spool order; status: None pending, True ok, False failed
        inflight: deque[list[Any]] = deque()

        def delivered(entry: list[Any]):
            def cb(err: Any, _msg: Any) -> None:
                entry[1] = err is None
                if err is None:
                    self.health.broker_up = True
                else:
                    self.health.delivery_errors += 1
                    self.health.last_error = str(err)

            return cb

        progress_at = time.monotonic()
        while True:
            stopping = self.stop.is_set()
            room = self.max_inflight - len(inflight)
            if room > 0:
                with self.lock:
                    batch = self.spool.read(min(room, 5000))
                for frame, pos in batch:
                    topic, key, value = unpack(frame)
                    entry: list[Any] = [pos, None]
                    while True:
                        try:
                            producer.produce(
                                topic, value=value, key=key, on_delivery=delivered(entry)
                            )
                            break
                        except BufferError:
                            producer.poll(0.05)
                    inflight.append(entry)
            producer.poll(0.05 if inflight else 0.1)
            last: Position | None = None
            while inflight and inflight[0][1] is True:
                last = inflight.popleft()[0]
                self.health.delivered += 1
            now = time.monotonic()
            if last is not None or not inflight:
                progress_at = now
            if last is not None:
                with self.lock:
                    self.spool.commit(last)
            stalled = bool(inflight) and now - progress_at > self.stall_s
            if inflight and (inflight[0][1] is False or stalled):
                # refused, timed out or wedged: take back what is in flight, then resend
                # everything after the cursor, in order, with a fresh producer
                if stalled:
                    log.warning(
                        "agent: no delivery for %.0fs with %d records in flight; resending "
                        "from the spool with a new producer",
                        now - progress_at,
                        len(inflight),
                    )
                    producer.purge(in_queue=True, in_flight=True)
                    producer.poll(0)
                else:
                    producer.flush(10)
                progress_at = now
                inflight.clear()
                with self.lock:
                    self.spool.rewind()
                producer = Producer(conf)
                self.stop.wait(1.0)
            self.health.inflight = len(inflight)
            if stopping and not inflight:
                break
            if stopping and self.drain_deadline < time.monotonic():
                log.warning(
                    "agent stopping with %d records unsent (kept in the spool)", len(inflight)
                )
                break


__all__ = ["SpoolPublisher", "pack", "unpack"]
