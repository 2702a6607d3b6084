"""Per node: its link samples, before the job's analysis.

A node sends a link sample per NIC and peer every window: at 4,096 ranks some
11,000 records a step, each of them small news. :class:`NodeAnalyzer` reads
one node's samples (each link against its own baseline,
:class:`~detectors.links.LinkMonitor`) and tells the job, once per batch,
only which links degraded or recovered. The flow keeps one per (job, node)
key, beside the communicators (link samples are keyed by node on their topic);
a :class:`~detectors.job.JobAnalyzer` given raw samples keeps one per
node itself, so both routes reach the same conclusions. Heartbeats are not
read here: their topic keys them by job, so they reach the job in order, and
the hang watchdog compares every rank's latest one (re-keyed per node, one
node's could lag another's and look like a rank that stopped).

>>> from schemas.records import LinkSample
>>> node = NodeAnalyzer(warmup=3)
>>> def s(t, gbps):
...     return LinkSample(job="j", node="a", rank=0, ts_ns=t, window_ns=1, nic="x",
...                       src_rank=0, dst_rank=8, throughput_gbps=gbps)
>>> node.update([s(t, g) for t, g in enumerate([400, 390, 410, 400])]).links
[]
>>> [(ev.kind, seen) for ev, seen in node.update([s(4, 150), s(5, 140)]).links]
[('degraded', 5)]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from detectors.links import LinkEvent, LinkMonitor
from schemas.records import LinkSample


class NodeDigest(NamedTuple):
    """What one batch of a node's link samples says (times in ns)."""

    job: str
    node: str
    ts_ns: int  # the newest sample in the batch
    link_samples: int  # how many (the node's NICs report counters)
    links: list[tuple[LinkEvent, int]]  # (a link that changed, when it was seen)


class NodeAnalyzer:
    """One node's link monitor (see the module docstring).

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

    def update(self, samples: Iterable[LinkSample]) -> NodeDigest | None:
        """Read a batch of the node's link samples; ``None`` when it held none."""
        job = node = ""
        ts = n = 0
        links: list[tuple[LinkEvent, int]] = []
        monitor = self.links.update
        for s in samples:
            if not isinstance(s, LinkSample):
                raise TypeError(f"a node analyzer reads link samples, not {s!r}")
            job, node, n = s.job, s.node, n + 1
            if s.ts_ns > ts:
                ts = s.ts_ns
            if (ev := monitor(s)) is not None:
                links.append((ev, s.ts_ns))
        if not n:
            return None
        return NodeDigest(job, node, ts, n, links)


__all__ = ["NodeAnalyzer", "NodeDigest"]
