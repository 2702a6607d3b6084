"""A job's link and NIC incidents: from the links' own measures to their verdicts.

Links come in as :class:`~detectors.links.LinkEvent` (a link below its baseline, or back),
from the nodes' link samples (the MEGATRACE WR measure) or, for a job whose sources
have no NIC counters, from the throughput of its proxy transfers
(:class:`~detectors.edges.EdgeThroughput`, baselines of their own). Several slow links
leaving one rank are that rank's NIC (the last row of docs/method.md's decision table).
For a job with neither, the network between nodes whose communicators all transfer far
slower than usual (:class:`~detectors.transfer_watch.TransferWatch`). Each incident is
charged its share of the step time through the job's
:class:`~detectors.incidents.StepTimeLedger`.

>>> from detectors.changepoint import ShiftDetector
>>> from detectors.gpu_wait import GpuWaitBaseline
>>> from detectors.incidents import StepTimeLedger
>>> from detectors.links import LinkEvent
>>> from detectors.topology import Topology
>>> from detectors.verdicts import VerdictBook
>>> from schemas.records import JobInfo
>>> topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=4, tp=2, pp=1, dp=2,
...                                  gpus_per_node=2))
>>> links = LinkTracker(VerdictBook("j"), StepTimeLedger(ShiftDetector()), GpuWaitBaseline())
>>> ev = LinkEvent("degraded", 1, 3, onset_ns=10, baseline_gbps=100.0, current_gbps=40.0)
>>> [v.summary for v in links.event(ev, 20, topo, per_step_ns=1e6)]
['link degradation: node-0/mlx5_1->node-1/mlx5_1 at 40 Gb/s, 60% below its 100 Gb/s baseline']
>>> links.event(LinkEvent("degraded", 1, 2, 30, 100.0, 35.0), 40, topo, 1e6)[0].cause.value
'nic'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from detectors import texts
from detectors.cpu_wait import CpuWaits, cpu_bound_until
from detectors.edges import EdgeThroughput
from detectors.gpu_wait import GpuWaitBaseline
from detectors.incidents import Culprit, Incident, StepTimeLedger
from detectors.links import LinkEvent, LinkMonitor
from detectors.steps import StepReport
from detectors.topology import Topology
from detectors.transfer_watch import NetworkEvent, TransferWatch
from detectors.verdicts import VerdictBook
from schemas.enums import Cause, Phase, VerdictKind
from schemas.records import LinkSample

_KIND = VerdictKind.LINK_DEGRADATION


class LinkTracker:
    """Open link and NIC incidents of one job.

    Parameters
    ----------
    book, ledger, gpu_wait
        The job's verdict book, step-time ledger and GPU-wait baseline (shared with its
        other trackers).
    warmup
        Steps (and measures) that make a link's baseline from proxy transfers.
    drop
        A link this far below its baseline is degraded.
    """

    # for one pickled before it had them
    proxied: bool = False
    transfers: TransferWatch | None = None

    def __init__(
        self,
        book: VerdictBook,
        ledger: StepTimeLedger,
        gpu_wait: GpuWaitBaseline,
        warmup: int = 5,
        drop: float = 0.2,
    ) -> None:
        if not 0 < drop < 1:
            raise ValueError(f"drop must be a fraction between 0 and 1, not {drop}")
        self.book, self.ledger, self.gpu_wait = book, ledger, gpu_wait
        self.warmup = warmup
        self.drop = drop
        self._reset()

    def _reset(self) -> None:
        # link throughput measured from proxy summaries: its own baselines, never mixed
        self.proxy_links = LinkMonitor(warmup=self.warmup, drop=self.drop)
        self.edges: dict[tuple[int, int], Culprit] = {}  # degraded edge -> its incident
        self.edge_onset: dict[tuple[int, int], int] = {}  # degraded edge -> since when (ns)
        self.incidents: dict[Culprit, Incident] = {}
        self.seen: dict[str, int] = {}  # node -> its newest link sample (ns)
        self.proxied = False  # its sources measured proxy transfers
        # the network between nodes, from its communicators' transfer times (neither)
        self.transfers = TransferWatch(warmup=self.warmup)

    @property
    def open(self) -> bool:
        """Some link is degraded now."""
        return bool(self.edges)

    def saw(self, node: str, ts_ns: int) -> None:
        """A node's link samples reached ``ts_ns`` (its sources measure links)."""
        self.seen[node] = max(ts_ns, self.seen.get(node, ts_ns))

    def behind(self, ts_ns: int) -> bool:
        """Some node's link samples have not reached ``ts_ns`` yet."""
        return bool(self.seen) and min(self.seen.values()) < ts_ns

    def ends_before(self, ts_ns: int) -> set[int]:
        """The ranks at the ends of links that degraded before ``ts_ns`` (their lateness
        from then on is the link's)."""
        return {r for edge in self.edges if self.edge_onset.get(edge, 0) < ts_ns for r in edge}

    def edge_throughput(
        self,
        e: EdgeThroughput,
        topo: Topology,
        warm: bool,
        per_step_ns: Callable[[], float | None],
    ) -> list[msgspec.Struct]:
        """Link throughput measured from proxy summaries, for jobs without link samples.

        Used only once the warm-up steps passed (``warm``) without any link sample from
        the job's sources (which then have no NIC counters), with baselines of its own;
        ``per_step_ns`` gives what :meth:`event` takes, asked only for an event (a median
        over the job's steps: not for every measure)."""
        self.proxied = True
        if self.seen or not warm:
            return []
        sample = LinkSample(
            job=self.book.job,
            node=topo.node(e.src_rank),
            rank=e.src_rank,
            ts_ns=e.ts_ns,
            window_ns=e.window_ns,
            nic=topo.nic(e.src_rank),
            src_rank=e.src_rank,
            dst_rank=e.dst_rank,
            dst_node=topo.node(e.dst_rank),
            dst_nic=topo.nic(e.dst_rank),
            size_bytes=e.size_bytes,
            throughput_gbps=e.throughput_gbps,
        )
        ev = self.proxy_links.update(sample)
        return [] if ev is None else self.event(ev, e.ts_ns, topo, per_step_ns())

    def event(
        self, ev: LinkEvent, ts_ns: int, topo: Topology, per_step_ns: float | None
    ) -> list[msgspec.Struct]:
        """A link that degraded or recovered (seen at ``ts_ns``): its verdict.
        ``per_step_ns``: the job's usual step time, to place an onset no step reached yet."""
        edge = (ev.src_rank, ev.dst_rank)
        if ev.kind == "recovered":
            culprit = self.edges.pop(edge, Culprit.link(*edge))
            self.edge_onset.pop(edge, None)
            if culprit in self.edges.values():
                return []  # other links of that NIC are still slow
            self.incidents.pop(culprit, None)
            self.ledger.forget(culprit)
            v = self.book.resolve(_KIND.value, culprit.key, ts_ns)
            return [v] if v else []
        recent = self.ledger.recent
        step = reached = self.ledger.step_reaching(ev.onset_ns)
        if step is None and recent:  # samples ran ahead of the steps: extrapolate
            last = recent[-1]
            per_step = max(per_step_ns or last.duration_ns, 1)
            step = last.step + 1 + int(max(0, ev.onset_ns - last.end_ns) // per_step)
        # several slow links leaving one NIC are that NIC
        siblings = sorted({d for (u, d) in self.edges if u == ev.src_rank and d != ev.dst_rank})
        u = ev.src_rank
        where: dict[str, Any] = dict(rank=u, node=topo.node(u), gpu=topo.gpu(u), src_rank=u,
                                     phase=Phase.TRANSFER, pp_stage=topo.coords(u)[0])  # fmt: skip
        if siblings:
            culprit = self.edges[(u, siblings[0])]
            nic = f"{topo.node(u)}/{topo.nic(u)}"
            inc = Incident(culprit, Cause.NIC, link=nic, dst_rank=None, **where)
            summary = texts.nic_summary(nic=nic, dsts=[*siblings, ev.dst_rank],
                                        current_gbps=ev.current_gbps, drop=ev.drop)  # fmt: skip
        else:
            culprit = Culprit.link(*edge)
            link = topo.link_name(u, ev.dst_rank)
            inc = Incident(culprit, Cause.NETWORK_LINK, link=link, dst_rank=ev.dst_rank, **where)
            summary = texts.link_summary(link=link, current_gbps=ev.current_gbps, drop=ev.drop,
                                         baseline_gbps=ev.baseline_gbps)  # fmt: skip
        inc.evidence = {
            "baseline_gbps": ev.baseline_gbps,
            "current_gbps": ev.current_gbps,
            "drop": ev.drop,
            "slow_links_from_nic": float(len(siblings) + 1),
            **self.gpu_wait.evidence(u),
        }
        self.edges[edge] = culprit
        self.edge_onset[edge] = ev.onset_ns
        self.incidents[culprit] = inc
        self.ledger.open(culprit, reached, ev.onset_ns)
        shifted = self.ledger.shift.shifted and recent
        severity = self.ledger.share(culprit, recent[-1].duration_ns) if shifted else 0.0
        v = self.book.report(
            _KIND,
            inc.cause,
            culprit.key,
            onset_step=None,
            onset_ns=ev.onset_ns,
            detected_ns=ts_ns,
            severity=severity,
            confidence=0.9,
            step=step,
            summary=summary,
            **inc.fields(),
        )
        return [v] if v else []

    def severities(self, duration: float, rep: StepReport) -> list[msgspec.Struct]:
        """The open incidents at their shares of a step of ``duration`` ns (0: the job
        recovered)."""
        out = []
        # the networks found from transfer times (its only incidents between nodes) that
        # cost step time
        networks = [c for c in self.incidents if c.kind == "nodes" and c in self.ledger.onset_at]
        for culprit in [*dict.fromkeys(self.edges.values()), *networks]:
            inc = self.incidents[culprit]
            fields = inc.fields(evidence=False)
            # opened before any step was seen: placed once a step reaches its onset
            current = self.book.current(_KIND.value, culprit.key)
            if current is not None and current.step is None:
                step = self.ledger.step_reaching(self.ledger.onset_ns(culprit))
                if step is not None:
                    fields["step"] = step
            if v := self.book.report(
                _KIND,
                inc.cause,
                culprit.key,
                onset_step=None,
                onset_ns=0,
                detected_ns=rep.end_ns,
                severity=self.ledger.share(culprit, duration),
                confidence=0.9,
                **fields,
            ):
                out.append(v)
        return out

    def transfer_times(
        self,
        rep: StepReport,
        topo: Topology,
        *,
        explained_ranks: set[int],
        explained_nodes: set[str],
        settling: bool,
        cpu: CpuWaits | None = None,
    ) -> list[msgspec.Struct]:
        """A complete step's transfer times, for a job whose sources measure no link: the
        network between nodes that degraded or came back
        (:class:`~detectors.transfer_watch.TransferWatch`). The ranks and hosts that open
        slowdowns name (``explained_*``) are not judged, nor a network whose step time's
        incident is open already, nor one whose members were kept from a CPU (``cpu``,
        their heartbeats' waits: :func:`~detectors.cpu_wait.cpu_bound`); ``settling``: a
        step-time shift is being localised, nothing opens or closes."""
        if self.seen or self.proxied or not rep.complete or rep.step == 0:
            return []  # step 0 holds the job's start-up (its first connections)
        if self.transfers is None:  # pickled before it had one
            self.transfers = TransferWatch(warmup=self.warmup)
        events = self.transfers.update(
            rep.step, rep.start_ns, rep.transfer_sum_ns, topo, skip_ranks=explained_ranks,
            skip_nodes=explained_nodes, hold=settling,
            cpu_bound=cpu_bound_until(cpu, rep.end_ns),
        )  # fmt: skip
        out: list[msgspec.Struct] = []
        for ev in events:
            out += self._network(ev, rep)
        return out

    def _network(self, ev: NetworkEvent, rep: StepReport) -> list[msgspec.Struct]:
        culprit = Culprit.network(ev.link)
        if ev.kind == "recovered":
            if self.incidents.pop(culprit, None) is None:
                return []  # the step time's own incident, not this one's
            self.ledger.forget(culprit)
            v = self.book.resolve(_KIND.value, culprit.key, rep.end_ns)
            return [v] if v else []
        if self.book.current(_KIND.value, culprit.key) is not None:
            return []  # the step time's own incident names this network already
        inc = Incident(culprit, Cause.NETWORK_LINK, link=ev.link, phase=Phase.TRANSFER)
        inc.evidence = {"transfer_ratio": ev.ratio, "communicators": float(ev.comms)}
        self.incidents[culprit] = inc
        recent = self.ledger.recent
        severity = 0.0
        if self.ledger.shift.shifted and recent:  # the step time is slower: it shares that
            self.ledger.open(culprit, ev.onset_step, ev.onset_ns)
            severity = self.ledger.share(culprit, recent[-1].duration_ns)
        # else it costs no step time (a pipeline's bubbles hide it), and the steps after
        # it are no slower level another incident adds to
        summary = texts.network_summary(link=ev.link, ratio=ev.ratio, onset=ev.onset_step,
                                        comms=ev.comms)  # fmt: skip
        v = self.book.report(
            _KIND,
            inc.cause,
            culprit.key,
            onset_step=ev.onset_step,
            onset_ns=ev.onset_ns,
            detected_ns=rep.end_ns,
            severity=severity,
            confidence=0.8,
            step=ev.onset_step,
            summary=summary,
            **inc.fields(),
        )
        return [v] if v else []


__all__ = ["LinkTracker"]
