"""A Kafka source that hands Bytewax one item per poll, not one per message.

Bytewax's own Kafka source builds an object per message, which dominates the
cost of a simple flow. Here each partition's poll becomes one
:class:`RawBatch`: the poll's messages as librdkafka returned them, read once
by whoever decodes them (a value each; a key, offset and time only for one
refused). Each Kafka partition is a Bytewax partition; its snapshot is the
next offset to read, so a flow restarted from its recovery store resumes
where it was (at least once: the sinks are idempotent). With ``tail=False``
the source stops once none of its partitions (in this process) received a
message for ``idle_stop_s``. ``start_offsets`` bounds a fresh start to known
records (e.g. what one publisher delivered): only those partitions are read,
each from its offset.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition


@dataclass
class RawBatch:
    """One poll of one partition: its messages (``confluent_kafka.Message``) in log order.

    A message whose ``error()`` is set is an event, not a record (transient broker
    errors: librdkafka retries by itself): the source takes it out, counts it and says
    so (:meth:`_Quiet.events`). The messages
    stay in the worker that polled them (the first step decodes them), so they are
    never pickled."""

    topic: str
    partition: int
    messages: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.messages)

    @property
    def produced_ms(self) -> int:
        """The producer time of the first record, the oldest in log order (0: none)."""
        first = next((m for m in self.messages if m.error() is None), None)
        return 0 if first is None else max(0, first.timestamp()[1])


class BrokerLost(RuntimeError):
    """A bounded run's broker did not answer for ``outage_wait_s``."""


_BACKOFF = timedelta(milliseconds=5)
#: the offset of a partition that a source bounded by ``start_offsets`` does not read
SKIPPED = -1


def part_name(topic: str, partition: int) -> str:
    """The Bytewax partition of a Kafka topic partition (the raw sink's partitions too)."""
    return f"{partition}-{topic}"


class BrokerHealth:
    """When this process's Kafka input could not reach its broker (monotonic ns).

    The source tells it (librdkafka's error callback: lost; a record, or an answer to a
    metadata request: back); the flow's clocks read it, so that a broker's outage, the
    pipeline's silence, is not taken for every job's (see ``flows.state._Clock``).
    The newest ``keep`` outages that are over are kept.

    >>> h = BrokerHealth()
    >>> h.lost(100); h.lost(150)  # the same outage, told twice
    >>> h.back(300); h.lost(500)
    >>> h.away_ns(0, 600), h.away_ns(200, 600), h.away_ns(350, 450)
    (300, 200, 0)
    """

    def __init__(self, keep: int = 64) -> None:
        self.lost_ns = 0  # when the current outage began (0: the broker answers)
        self.keep = keep
        self._past: list[tuple[int, int]] = []

    def lost(self, now_ns: int) -> None:
        self.lost_ns = self.lost_ns or now_ns

    def back(self, now_ns: int) -> None:
        if self.lost_ns:
            self._past = [*self._past[1 - self.keep :], (self.lost_ns, now_ns)]
            self.lost_ns = 0

    def away_ns(self, since_ns: int, now_ns: int) -> int:
        """How long the broker was away between ``since_ns`` and ``now_ns``."""
        spans = [*self._past, (self.lost_ns, now_ns)] if self.lost_ns else self._past
        return sum(max(0, min(end, now_ns) - max(start, since_ns)) for start, end in spans)


class _Quiet:
    """When any partition of one source (in this process) last saw a message, and its
    broker's health (librdkafka's error callback is served by the partitions' polls, on
    the worker's own thread)."""

    def __init__(self, health: BrokerHealth) -> None:
        self.last_ns = time.monotonic_ns()
        self.health = health
        self.asked_ns = 0  # when a partition last asked the lost broker for metadata
        self.answered_ns = 0  # when the broker last answered a partition's question
        self.warned_ns = 0
        #: error events polls returned in place of messages (no record in them), in all
        self.broker_events = 0
        self._events_told_ns = 0
        self._events_told = 0

    def on_error(self, err: Any) -> None:
        from confluent_kafka import KafkaError

        if err.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT):
            self.health.lost(time.monotonic_ns())

    def events(self, where: str, errors: list[Any]) -> None:
        """Error events a poll returned (librdkafka retries what it can by itself):
        counted, and said on stderr at most every 10 s.

        >>> import contextlib, io
        >>> class Event:  # what a poll returns for an error: a message with error() set
        ...     def error(self):
        ...         return "Broker: Not leader"
        >>> q, err = _Quiet(BrokerHealth()), io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     q.events("megatrace.comm[0]", [Event(), Event()])
        ...     q.events("megatrace.comm[0]", [Event()])  # within 10 s: counted, not said
        >>> q.broker_events, err.getvalue().count("megatrace:")
        (3, 1)
        >>> said = err.getvalue()
        >>> said.split(" (")[0]
        'megatrace: 2 error event(s) from the broker, no record in them'
        >>> said.split(" (")[1].strip()
        'latest on megatrace.comm[0]: Broker: Not leader)'
        """
        self.broker_events += len(errors)
        now = time.monotonic_ns()
        if self._events_told_ns and now - self._events_told_ns < 10 * 1_000_000_000:
            return
        print(
            f"megatrace: {self.broker_events - self._events_told:,} error event(s) from the "
            f"broker, no record in them (latest on {where}: {errors[-1].error()})",
            file=sys.stderr,
        )
        self._events_told_ns, self._events_told = now, self.broker_events


class _Partition(StatefulSourcePartition[RawBatch, int]):
    def __init__(
        self,
        config: dict[str, Any],
        topic: str,
        partition: int,
        offset: int,
        tail: bool,
        batch_size: int,
        idle_stop_s: float,
        outage_wait_s: float,
        quiet: _Quiet,
        on_read: Callable[[int], None] | None,
        complete: Callable[[], bool] | None = None,
    ) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self._consumer: Consumer | None = None
        if offset != SKIPPED:
            conf = dict(config)
            conf["enable.partition.eof"] = "false"
            conf.setdefault("group.id", "megatrace-flow")
            conf["enable.auto.commit"] = "false"
            # an offset no longer (or not yet) in the log: read from the earliest one kept
            conf["auto.offset.reset"] = "earliest"
            conf["error_cb"] = quiet.on_error  # type: ignore[assignment]
            self._consumer = Consumer(conf)
            self._consumer.assign([TopicPartition(topic, partition, offset)])
        self._topic, self._partition = topic, partition
        self._offset = offset
        self._tail = tail
        self._batch_size = batch_size
        self._eof = False
        self._idle_stop_ns = int(idle_stop_s * 1e9)
        self._outage_wait_ns = int(outage_wait_s * 1e9)
        self._quiet = quiet
        self._on_read = on_read
        self._complete = complete
        self._awake: datetime | None = None
        quiet.last_ns = time.monotonic_ns()  # the quiet period starts when reading starts

    def next_batch(self) -> list[RawBatch]:
        if self._eof:
            raise StopIteration
        # never block the worker
        msgs = self._consumer.consume(self._batch_size, 0) if self._consumer else []
        errors = [m for m in msgs if m.error() is not None]
        if errors:
            self._quiet.events(part_name(self._topic, self._partition), errors)
            msgs = [m for m in msgs if m.error() is None]
        last = msgs[-1] if msgs else None
        now = time.monotonic_ns()
        if last is not None:
            batch = RawBatch(self._topic, self._partition, msgs)
            self._offset = last.offset() + 1
            self._quiet.last_ns = now
            self._quiet.health.back(now)
            self._awake = None
            if self._on_read is not None:
                self._on_read(len(batch))
            return [batch]
        self._awake = datetime.now(UTC) + _BACKOFF
        # Bounded run: stop once the whole source stayed quiet for idle_stop_s (a partition
        # may legitimately be quiet longer while others still flow). Partition-EOF events
        # are not used: they depend on the broker's high watermark, which some
        # Kafka-protocol brokers (Tansu) report wrongly.
        if self._quiet.health.lost_ns:
            self._ask_broker(now)  # until it answers (a tailing flow's clocks wait for it)
        if not self._tail and now - self._quiet.last_ns >= self._idle_stop_ns:
            if self._quiet.health.lost_ns:
                return []  # an unreachable broker's silence is not the end of the input
            if self._complete is not None and not self._complete():
                return []  # its writer says more is coming: quiet is not the end
            if not self._broker_answers():
                self._quiet.health.lost(now)  # its error was not told yet (a busy host)
                return []
            self._eof = True
        return []

    def _ask_broker(self, now: int) -> None:
        """The broker went away (a restart, the network): does it answer again?

        Asked at most once a second (by any partition of the source), for 0.5 s, so the
        worker's other steps and timers go on. While it does not, a bounded run waits (a line
        on stderr every 10 s) until ``outage_wait_s`` has passed: then
        :class:`BrokerLost` stops it. Once it does, librdkafka reconnects by itself and
        the source gets ``idle_stop_s`` more, from now, to read what the broker holds. A
        partition that reads nothing (bounded by ``start_offsets``) leaves the question
        to those that do."""
        quiet = self._quiet
        if self._consumer is None or now - quiet.asked_ns < 1_000_000_000:
            return
        quiet.asked_ns = now
        from confluent_kafka import KafkaException

        try:
            self._consumer.list_topics(timeout=0.5)
        except KafkaException:  # no answer: still away
            if self._tail:
                return
            if now - quiet.health.lost_ns >= self._outage_wait_ns:
                raise BrokerLost(
                    f"the Kafka broker did not answer for {self._outage_wait_ns / 1e9:.0f} s "
                    f"(kafka.outage_wait_s): this bounded run stops before the end of its input; "
                    "run it again once the broker is back"
                ) from None
            if now - quiet.warned_ns >= 10 * 1_000_000_000:
                quiet.warned_ns = now
                print(
                    "megatrace: the Kafka broker does not answer; this bounded run waits for "
                    "it (Ctrl-C to stop)",
                    file=sys.stderr,
                )
            return
        quiet.health.back(time.monotonic_ns())
        quiet.last_ns = now

    def _broker_answers(self) -> bool:
        """Quiet is the end of the input only if the broker is there to say so. Its answer
        to one partition holds for the source's others for a second: they reach the end
        together, and a question to the broker each, one after the other, would hold the
        end of the run back by as many round trips."""
        if self._consumer is None:
            return True
        quiet, now = self._quiet, time.monotonic_ns()
        if now - quiet.answered_ns < 1_000_000_000:
            return True
        from confluent_kafka import KafkaException

        try:
            self._consumer.list_topics(timeout=1.0)
        except KafkaException:
            return False
        quiet.answered_ns = time.monotonic_ns()
        return True

    def next_awake(self) -> datetime | None:
        # an empty poll backs off a little instead of blocking or spinning
        return self._awake

    def snapshot(self) -> int:
        return self._offset

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()


class RawKafkaSource(FixedPartitionedSource[RawBatch, int]):
    """Every partition of ``topics``; ``config`` is a librdkafka consumer configuration.

    ``on_read``, if given, is called with the size of every poll that returned records.
    ``complete``, for a bounded run whose input is still being written (a live job):
    quiet is its end only once ``complete()`` says nothing more is coming.
    ``start_offsets`` (part name, see :func:`part_name` -> offset): a fresh start reads
    only these partitions, from these offsets (a resumed one goes on where it was).
    """

    def __init__(
        self,
        config: dict[str, Any],
        topics: list[str],
        *,
        tail: bool = True,
        batch_size: int = 5000,
        idle_stop_s: float = 1.5,
        outage_wait_s: float = 300.0,
        on_read: Callable[[int], None] | None = None,
        start_offsets: Mapping[str, int] | None = None,
        complete: Callable[[], bool] | None = None,
    ) -> None:
        self.config = config
        self.topics = topics
        self.complete = complete
        self.tail = tail
        self.batch_size = batch_size
        self.idle_stop_s = idle_stop_s
        self.outage_wait_s = outage_wait_s
        self.on_read = on_read
        self.start_offsets = start_offsets
        self.health = BrokerHealth()  # the flow's clocks read it (see flows.main)
        self._quiet = _Quiet(self.health)
        self._parts: list[str] | None = None

    def list_parts(self) -> list[str]:
        """The topics' partitions, asked of the broker once (the raw sink lists the same)."""
        if self._parts is None:
            self._parts = self._ask_parts()
        return list(self._parts)

    def _ask_parts(self) -> list[str]:
        from infra.kafka import topic_partitions

        listed = topic_partitions(self.config, self.topics)
        return [part_name(t, p) for t, parts in listed.items() for p in parts]

    def build_part(self, step_id: str, for_part: str, resume_state: int | None) -> _Partition:
        idx, topic = for_part.split("-", 1)
        # A fresh start reads from offset 0, which an emptied log resets to its earliest
        # offset: the same as OFFSET_BEGINNING, whose lookup delayed the first fetch by
        # 0.5 s here (librdkafka resolving the logical offset first)
        if resume_state is not None:
            start = resume_state
        elif self.start_offsets is not None:
            start = self.start_offsets.get(for_part, SKIPPED)
        else:
            start = 0
        return _Partition(
            self.config,
            topic,
            int(idx),
            start,
            self.tail,
            self.batch_size,
            self.idle_stop_s,
            self.outage_wait_s,
            self._quiet,
            self.on_read,
            self.complete,
        )
