"""Everything megatrace does per node, before the job's analysis.

A node sends a heartbeat per rank and a link sample per NIC and peer every
window: at 4,096 ranks that is some 15,000 records a step, each of them small
news. :class:`NodeAnalyzer` reads one node's records and tells the job, once
per batch, only what it needs: the links that degraded or recovered (each
link against its own baseline, :class:`~detectors.links.LinkMonitor`), each
rank's latest heartbeat, and when the ranks last made progress (a completed
sequence number that moved). The flow keeps one per (job, node) key for the
link samples, beside the communicators. Heartbeats reach the job itself, in
order on their topic (keyed by job): the hang watchdog compares every rank's
latest one, and one node's stream lagging another's would look like a rank
that stopped. A :class:`~detectors.analyzer.JobAnalyzer` given raw records
keeps one analyzer per node itself, so both routes reach the same conclusions.

>>> from schemas.records import CommProgress, Heartbeat
>>> node = NodeAnalyzer()
>>> def hb(t, done):
...     return Heartbeat(job="j", node="n", rank=0, ts_ns=t,
...                      comms=[CommProgress(comm_hash=9, issued_seq=done, completed_seq=done)])
>>> node.update([hb(100, 4), hb(200, 5)]).progress_ns
200
>>> node.update([hb(300, 5)]).progress_ns  # alive, but nothing completed since
0
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from detectors.links import LinkEvent, LinkMonitor
from schemas.records import Heartbeat, LinkSample


class NodeDigest(NamedTuple):
    """What one batch of a node's heartbeats and link samples says (times in ns)."""

    job: str
    node: str
    ts_ns: int  # the newest time in the batch
    link_samples: int  # how many link samples (the node's NICs report counters)
    links: list[tuple[LinkEvent, int]]  # (a link that changed, when it was seen)
    heartbeats: dict[int, Heartbeat]  # each rank's latest heartbeat in the batch
    heartbeat_ns: int  # the newest heartbeat, or 0
    progress_ns: int  # the newest heartbeat showing a completed sequence number move, or 0


class NodeAnalyzer:
    """One node's link monitor and heartbeat progress (see the module docstring).

    Parameters
    ----------
    warmup, drop
        Passed to :class:`~detectors.links.LinkMonitor`: samples that make a
        link's baseline, and the relative drop below it that counts.
    """

    def __init__(self, warmup: int = 5, drop: float = 0.2) -> None:
        self.warmup = warmup
        self.drop = drop
        self._reset()

    def _reset(self) -> None:
        self.links = LinkMonitor(warmup=self.warmup, drop=self.drop)
        self._done: dict[int, dict[int, int]] = {}  # rank -> comm -> completed seq

    def update(self, records: Iterable[LinkSample | Heartbeat]) -> NodeDigest | None:
        """Read a batch of the node's records; ``None`` when it held none."""
        job = node = ""
        ts = beat = progress = samples = 0
        links: list[tuple[LinkEvent, int]] = []
        beats: dict[int, Heartbeat] = {}
        monitor = self.links.update
        for rec in records:
            job, node = rec.job, rec.node
            if isinstance(rec, LinkSample):
                samples += 1
                if rec.ts_ns > ts:
                    ts = rec.ts_ns
                if (ev := monitor(rec)) is not None:
                    links.append((ev, rec.ts_ns))
                continue
            if not isinstance(rec, Heartbeat):
                raise TypeError(f"a node analyzer reads heartbeats and link samples, not {rec!r}")
            beats[rec.rank] = rec
            if rec.ts_ns > beat:
                beat = rec.ts_ns
            if self.progressed(rec) and rec.ts_ns > progress:
                progress = rec.ts_ns
        if not job:
            return None
        return NodeDigest(job, node, max(ts, beat), samples, links, beats, beat, progress)

    def progressed(self, hb: Heartbeat) -> bool:
        """Read one heartbeat: whether a completed sequence number of its rank moved."""
        done = self._done.get(hb.rank)
        if done is None:
            done = self._done[hb.rank] = {}
        moved = False
        for cp in hb.comms:
            if cp.completed_seq > done.get(cp.comm_hash, -1):
                done[cp.comm_hash] = cp.completed_seq
                moved = True
        return moved


__all__ = ["NodeAnalyzer", "NodeDigest"]
