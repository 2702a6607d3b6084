"""What a job refuses as evidence, as dead letters: a record naming a rank outside its
layout, a communicator's member that is not one, or records of a job that never sent
its job record.

A record of another job, or a corrupt one, is never evidence (one once made a false
hang); it is kept, with the reason, and counted.

>>> from detectors.topology import Topology
>>> from schemas.records import Heartbeat, JobInfo
>>> topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=4))
>>> hb = Heartbeat(job="j", node="n", rank=9, ts_ns=5)
>>> letter = outside("j", topo, hb)
>>> letter.reason.value, letter.error
('out_of_layout', "rank 9 is outside job j's 4 ranks: not used as evidence")
>>> outside("j", topo, Heartbeat(job="j", node="n", rank=3, ts_ns=5)) is None
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from detectors.align import Instance
from detectors.edges import EdgeThroughput
from detectors.node import NodeDigest
from detectors.topology import Topology
from schemas.codec import encode
from schemas.enums import DeadLetterReason
from schemas.records import DeadLetter, Heartbeat, LinkSample, ProxySummary, event_time


def outside(job: str, topo: Topology, item: Any) -> DeadLetter | None:
    """A dead letter (reason ``out_of_layout``) for an item naming a rank outside the
    job's layout, or a communicator's member that is not one; None for a good one."""
    world = topo.job.world_size
    # most of what a job's worker takes, checked at once: thousands a step at scale
    kind = type(item)
    if kind is EdgeThroughput:
        if item.src_rank < world and item.dst_rank < world:
            return None
    elif (kind is Heartbeat and item.rank < world) or (kind is NodeDigest and not item.links):
        return None  # (a node's batch in which no link changed names no rank)
    ranks = ranks_of(item)
    if not ranks:
        return None
    if max(ranks) >= world:
        bad = next(r for r in ranks if r >= world)
        why = f"rank {bad} is outside job {job}'s {world} ranks"
    elif not isinstance(item, Instance):
        return None
    else:
        members = topo.members(item.comm_hash)
        if members is None:
            return None
        bad = next((r for r in item.ranks if r not in members), None)
        # a transfer's instance is its two ends, whatever the communicator's size
        if bad is None and (item.sender >= 0 or item.comm_size == len(members)):
            return None
        why = (
            f"rank {bad} is not a member of communicator {item.comm_hash:016x}"
            if bad is not None
            else f"communicator {item.comm_hash:016x} has {len(members)} members, "
            f"not {item.comm_size}"
        )
    return _letter(item, DeadLetterReason.OUT_OF_LAYOUT, f"{why}: not used as evidence", "rank")


def no_job_record(job: str, item: Any, held: int) -> DeadLetter:
    """A dead letter for a record of a job whose job record did not come before ``held``
    of its records."""
    return _letter(
        item,
        DeadLetterReason.NO_JOB_RECORD,
        f"job {job} sent no job record before {held:,} of its records: "
        "not analysed (its layout is unknown)",
    )


def _letter(item: Any, reason: DeadLetterReason, error: str, fld: str | None = None) -> DeadLetter:
    record = isinstance(item, msgspec.Struct) and not isinstance(item, Instance)
    extra = {"field": fld} if fld else {}
    return DeadLetter(
        ts_ns=event_time(item) if record else _item_time(item),
        reason=reason,
        error=error,
        step_id="analyze",
        raw=encode(item) if record else _describe(item),
        **extra,
    )


def speaks_of_ranks(kind: type) -> bool:
    """Items of ``kind`` name ranks (:func:`outside` has something to check)."""
    return kind in _RANKS


def ranks_of(item: Any) -> tuple[int, ...]:
    """The ranks an item speaks of (checked against the layout)."""
    speaks = _RANKS.get(type(item))
    return speaks(item) if speaks is not None else ()


#: per kind of item, the ranks it speaks of (looked up by its type: a job's worker
#: checks every item it takes)
_RANKS: dict[type, Callable[[Any], tuple[int, ...]]] = {
    Instance: lambda i: i.ranks,
    Heartbeat: lambda h: (h.rank,),
    ProxySummary: lambda p: (p.rank, p.peer),
    LinkSample: lambda s: (s.rank, s.src_rank, s.dst_rank),
    EdgeThroughput: lambda e: (e.src_rank, e.dst_rank),
    NodeDigest: lambda d: tuple(r for ev, _ in d.links for r in (ev.src_rank, ev.dst_rank)),
}


def _item_time(item: Any) -> int:
    if isinstance(item, Instance):
        return max(item.arrival)
    return int(getattr(item, "ts_ns", 0))


def _describe(item: Any) -> bytes:
    """An item the flow made (not a record) as JSON, for its dead letter."""
    if isinstance(item, Instance):
        keys = ("comm_hash", "seq", "op", "sender", "comm_size", "ranks", "arrival")
        return msgspec.json.encode({"instance": {k: getattr(item, k) for k in keys}})
    return msgspec.json.encode({type(item).__name__: repr(item)[:2000]})


__all__ = ["no_job_record", "outside", "ranks_of"]
