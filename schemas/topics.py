"""Kafka topic names and message keys.

Collective and proxy records of one communicator share a topic and a key, so
one communicator's records meet in one partition and one flow worker; kernel
and link samples are keyed by node; heartbeats and verdicts by job. The
metadata topic is compacted and keyed by what each record describes (the job,
a rank, a communicator): Kafka keeps the latest of each for as long as the
topic exists, so a flow started long after a job began (past any time-based
retention) still learns its layout. It has one partition, so a job's records
are read in the order they were written (its job record, then its ranks and
communicators) whatever their keys; keyed per entity over several partitions,
a rank's record could be read after a backlog of the job's samples that the
analysis names by it. Kafka's own compacted configuration topics are made the
same way.

>>> t = Topics()
>>> t.for_record(Heartbeat(job="j", node="n", rank=0, ts_ns=1))
'megatrace.heartbeat'
>>> message_key(Collective(job="j", node="n", rank=0, comm_hash=255, comm_size=1,
...     rank_in_comm=0, op=CollOp.ALL_REDUCE, seq=0, count=1, size_bytes=2,
...     dtype=DType.BFLOAT16, enqueue_ns=1))
b'j:00000000000000ff'
"""

from __future__ import annotations

from msgspec import Struct

from schemas.enums import CollOp, DType  # noqa: F401 - used by the doctest
from schemas.records import (
    Collective,
    CommInfo,
    DeadLetter,
    Heartbeat,
    Iteration,
    JobInfo,
    Kernel,
    LinkSample,
    ProxySummary,
    RankInfo,
)
from schemas.results import AlignedCollective, Verdict


class Topics(Struct, frozen=True, kw_only=True):
    """Topic names under one prefix (``Settings.kafka.topic_prefix``)."""

    prefix: str = "megatrace."

    @property
    def comm(self) -> str:
        return f"{self.prefix}comm"

    @property
    def kernel(self) -> str:
        return f"{self.prefix}kernel"

    @property
    def link(self) -> str:
        return f"{self.prefix}link"

    @property
    def heartbeat(self) -> str:
        return f"{self.prefix}heartbeat"

    @property
    def meta(self) -> str:
        return f"{self.prefix}meta"

    @property
    def verdict(self) -> str:
        return f"{self.prefix}verdict"

    @property
    def aligned(self) -> str:
        return f"{self.prefix}aligned"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}deadletter"

    @property
    def inputs(self) -> tuple[str, ...]:
        """The topics node producers write and the flow reads."""
        return (self.meta, self.comm, self.kernel, self.link, self.heartbeat)

    @property
    def all(self) -> tuple[str, ...]:
        return (*self.inputs, self.aligned, self.verdict, self.deadletter)

    def config(self, topic: str) -> dict[str, str]:
        """The topic's settings when it is created (see the module docstring)."""
        return {"cleanup.policy": "compact"} if topic == self.meta else {}

    def partitions(self, topic: str, configured: int) -> int:
        """The topic's partitions when it is created: ``configured``, but one for the
        metadata topic (see the module docstring).

        >>> Topics().partitions("megatrace.comm", 8), Topics().partitions("megatrace.meta", 8)
        (8, 1)
        """
        return 1 if topic == self.meta else configured

    def for_record(self, record: Struct) -> str:
        """The topic a record is published to."""
        match record:
            case Collective() | ProxySummary():
                return self.comm
            case Kernel():
                return self.kernel
            case LinkSample():
                return self.link
            case Heartbeat() | Iteration():  # the job's liveness and its clock, in order
                return self.heartbeat
            case JobInfo() | RankInfo() | CommInfo():
                return self.meta
            case Verdict():
                return self.verdict
            case AlignedCollective():
                return self.aligned
            case DeadLetter():
                return self.deadletter
        raise TypeError(f"no topic for {type(record).__name__}")


def message_key(record: Struct) -> bytes:
    """The partitioning key of a record (see the module docstring)."""
    match record:
        case Collective() | ProxySummary() | AlignedCollective():
            return f"{record.job}:{record.comm_hash:016x}".encode()
        case Kernel() | LinkSample():
            return f"{record.job}:{record.node}".encode()
        case RankInfo():  # metadata: the compaction key is the entity described
            return f"{record.job}:rank:{record.rank}".encode()
        case CommInfo():
            return f"{record.job}:comm:{record.comm_hash:016x}".encode()
        case DeadLetter():
            return record.key or b""
    job = getattr(record, "job", None)
    if job is None:
        raise TypeError(f"no key for {type(record).__name__}")
    return job.encode()
