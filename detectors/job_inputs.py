"""The job analyzer's inputs beside its collectives (:class:`SideInputs`, a part of
:class:`~detectors.job.JobAnalyzer`, which holds the state below): heartbeats
(liveness, CPU waits, checkpoint saves, a restart); for the hang diagnosis, stuck proxy
operations, calls reported partial that were passed since, and how long each
communicator's calls stayed open; link samples through their node's analyzer, the nodes'
digests of links that changed, and the proxies' throughput per edge (GPU-wait evidence,
and the links' measure for jobs without link samples)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from detectors.align import OpenTimes, Passed
from detectors.cpu_wait import CpuWaits
from detectors.edges import EdgeThroughput
from detectors.gpu_wait import GpuWaitBaseline
from detectors.incidents import StepTimeLedger
from detectors.link_tracker import LinkTracker
from detectors.node import NodeAnalyzer, NodeDigest
from detectors.saves import Saves
from detectors.slowdown_tracker import SlowdownTracker
from detectors.topology import Topology
from detectors.verdicts import VerdictBook
from detectors.watchdog import HangWatch
from schemas.config import DetectSettings
from schemas.records import Heartbeat, LinkSample, ProxySummary, event_time

#: what the job's handlers return (its rows, verdicts and dead letters)
Out = list[msgspec.Struct]


class SideInputs:
    """Handlers of the job's records beside its collectives (the analyzer's state below)."""

    settings: DetectSettings
    topo: Topology | None
    now_ns: int
    nodes: dict[str, NodeAnalyzer]
    hangs: HangWatch
    links: LinkTracker
    slowdowns: SlowdownTracker
    ledger: StepTimeLedger
    gpu_wait: GpuWaitBaseline
    cpu: CpuWaits
    saves: Saves
    book: VerdictBook
    restart_ns: int
    #: the analyzer's: the step time it expects
    expected_step_ns: Callable[[], float | None]
    tick: Callable[..., Out]

    def _record_time(self, rec: object) -> None:
        """A record that moves the job's clock."""
        self.now_ns = max(self.now_ns, event_time(rec))

    def _heartbeat_in(self, hb: Heartbeat) -> Out:
        """Liveness and progress (see :meth:`HangWatch.heartbeat`). A rank's new process
        (the job was started again) ends the start before: a call it left open is judged
        first, as at the end of a recording (its processes said nothing more)."""
        out: Out = []
        before = self.hangs.hb_latest.get(hb.rank)
        if before is not None and before.pid != hb.pid and self.hangs.restarted(hb, before):
            # the first of its ranks' new processes (the watchdog forgets the others' old)
            out = self.tick(self.now_ns, final=True, ended="the job was started again")
            self.restart_ns = hb.ts_ns
        self.now_ns = max(self.now_ns, hb.ts_ns)
        if hb.cpu_wait_ns is not None:
            self.cpu.update(hb.rank, hb.ts_ns, hb.cpu_wait_ns, hb.cpu_throttled_ns)
        if (
            before is not None
            and hb.save_ns is not None
            and (hb.save_ns != before.save_ns or hb.saving_since_ns != before.saving_since_ns)
        ):  # a save began, went on or ended
            self.saves.update(hb.rank, hb.ts_ns, hb.save_ns, hb.saving_since_ns,
                              (before.ts_ns, before.save_ns or 0))  # fmt: skip
        return out + self.hangs.heartbeat(hb, self.book)

    def _passed(self, p: Passed) -> Out:
        """A partial instance its missing members went past: no hang's evidence."""
        self.hangs.completed(p.key)
        return []

    def _open_times_in(self, t: OpenTimes) -> Out:
        """How long a communicator's calls stayed open, at the end of a recording."""
        self.hangs.open_times[t.comm_hash] = t.longest_ns
        return []

    def _proxy_in(self, p: ProxySummary) -> Out:
        """Stuck proxy operations (and their completion) for the hang diagnosis."""
        self._record_time(p)
        self.hangs.proxy(p)
        return []

    def _link_in(self, s: LinkSample) -> Out:
        """A raw link sample: through its node's analyzer, as the flow does."""
        node = self.nodes.get(s.node)
        if node is None:
            st = self.settings
            node = self.nodes[s.node] = NodeAnalyzer(st.warmup_steps, st.link_drop)
        digest = node.update((s,))
        return self._digest(digest) if digest is not None else []

    def _digest(self, d: NodeDigest) -> Out:
        """A node's links that changed."""
        assert self.topo is not None
        self.now_ns = max(self.now_ns, d.ts_ns)
        self.links.saw(d.node, d.ts_ns)
        out: Out = []
        per_step = self.expected_step_ns() if d.links else None
        for ev, ts in d.links:
            out += self.links.event(ev, ts, self.topo, per_step)
        return out + self.slowdowns.links_moved(self.topo)

    def _edge_throughput(self, e: EdgeThroughput) -> Out:
        """An edge's proxy throughput (see :meth:`_edges_in`)."""
        return self._edges_in((e,))

    def _edges_in(self, edges: Sequence[EdgeThroughput]) -> Out:
        """Edges' proxy throughputs, in their order: GPU-wait evidence, and the links'
        measure for jobs without link samples (see :meth:`LinkTracker.edge_throughput`).
        The job's batches bring them together, thousands a step at scale: what they
        read of the job (its warm-up, its links) is read once for them all."""
        assert self.topo is not None
        recent = self.ledger.recent
        warm = bool(recent) and recent[-1].step >= self.settings.warmup_steps
        gpu_wait, links, topo, per_step = (
            self.gpu_wait, self.links, self.topo, self.expected_step_ns
        )  # fmt: skip
        out: Out = []
        for e in edges:
            if e.ts_ns > self.now_ns:
                self.now_ns = e.ts_ns
            if warm:
                gpu_wait.update(e.src_rank, float(e.gpu_wait_ns))
            out += links.edge_throughput(e, topo, warm, per_step)
        return out


__all__ = ["Out", "SideInputs"]
