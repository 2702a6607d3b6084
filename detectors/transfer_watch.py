"""The network between nodes, from how long collectives take to move data across them.

A job whose sources measure no link (no NIC counters, no proxy transfers: a Gloo job,
a collector that sees only ``torch.distributed`` calls) still shows each communicator's
transfer time in every step: the time its instances took after the last member came
(:attr:`~detectors.steps.StepReport.transfer_sum_ns`). A link that got slower makes
every communicator crossing it transfer slower, whether or not the step time shows it
(a pipeline hides a slow point-to-point transfer in its bubbles). So the network
between a set of nodes is degraded when every communicator spanning exactly those
nodes takes ``slow`` times its own usual transfer time or more, as a median over
``window`` steps; and back once every one of them is under ``back`` times it. A
communicator's usual time follows the median of its newest ``window`` steps while that
is under ``back`` times it: following each step under that bar instead would hold it
under the level of a job whose transfers vary by half from step to step.

A collective's timings cannot tell a slow link from a slow member that does the
transferring (a CPU-bound rank moving Gloo's buffers): the communicators must be two
or more with no rank common to all of them, and the caller leaves out the ranks and
nodes that another incident already explains (:meth:`TransferWatch.update`), and tells
whether the members were kept from a CPU as their transfers slowed (a crowded host).

>>> from detectors.topology import Topology
>>> from schemas.enums import CommRole
>>> from schemas.records import CommInfo, JobInfo
>>> topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=4, tp=1, pp=2, dp=2,
...                                  gpus_per_node=2))
>>> for h, ranks in ((1, [0, 2]), (2, [1, 3])):  # two pipelines' transfers across nodes
...     topo.add(CommInfo(job="j", ts_ns=0, comm_hash=h, role=CommRole.PP, ranks=ranks))
>>> watch = TransferWatch()
>>> events = []
>>> for step in range(20):
...     ms = 10 if step < 10 else 31  # the link gets 3x slower at step 10
...     xsum = {1: ms * 1_000_000, 2: ms * 1_000_000}
...     events += watch.update(step, step * 100, xsum, topo)
>>> [(e.kind, e.link, e.onset_step, round(e.ratio, 1), e.comms) for e in events]
[('degraded', 'node-0<->node-1', 10, 3.1, 2)]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from detectors.topology import Topology


@dataclass(frozen=True)
class NetworkEvent:
    """The network between ``nodes`` (named ``link``, as ``"a<->b"``) got slower or came
    back: its communicators' transfers take ``ratio`` times their usual (the least of
    them), since ``onset_step``."""

    kind: str  # "degraded" | "recovered"
    link: str
    nodes: tuple[str, ...]
    onset_step: int
    onset_ns: int
    ratio: float
    comms: int


@dataclass
class _Comm:
    nodes: tuple[str, ...] = ()  # the nodes its members are on
    seed: list[float] = field(default_factory=list)
    baseline: float = 0.0
    #: its newest steps: (step, start of the step in ns, transfer time / baseline)
    recent: deque[tuple[int, int, float]] = field(default_factory=deque)


class TransferWatch:
    """Per job: each cross-node communicator's transfer time against its own usual.

    Parameters
    ----------
    warmup
        Steps whose median is a communicator's usual transfer time.
    window
        Steps a communicator's ratio is the median of.
    slow
        The network is degraded when every communicator across it transfers this many
        times slower than usual or more: half the throughput. Collective transfer times
        vary by a third from step to step on busy hosts; a link's own counters
        (:class:`~detectors.links.LinkMonitor`) are judged far finer.
    back
        It came back when they are all under this many times their usual (one of them
        back is the noise of a slow network).
    min_comms
        Communicators across the same nodes needed to tell the network from a member.
    """

    def __init__(
        self,
        warmup: int = 5,
        window: int = 5,
        slow: float = 2.0,
        back: float = 1.5,
        min_comms: int = 2,
    ) -> None:
        if warmup < 1 or window < 1 or not 1 < back < slow or min_comms < 2:
            raise ValueError(
                "warmup and window >= 1, 1 < back < slow and min_comms >= 2, not "
                f"{warmup}, {window}, {back}, {slow}, {min_comms}"
            )
        self.warmup, self.window, self.slow, self.back = warmup, window, slow, back
        self.min_comms = min_comms
        self._comms: dict[int, _Comm] = {}
        self.degraded: set[str] = set()  # the networks ("a<->b") degraded now

    def update(
        self,
        step: int,
        start_ns: int,
        transfer_sum_ns: dict[int, int],
        topo: Topology,
        *,
        skip_ranks: Iterable[int] = (),
        skip_nodes: Iterable[str] = (),
        hold: bool = False,
        cpu_bound: Callable[[set[int], int], bool] | None = None,
    ) -> list[NetworkEvent]:
        """A complete step's transfer times per communicator: the networks that degraded
        or came back. Communicators with a rank in ``skip_ranks``, and networks touching a
        node in ``skip_nodes``, are not judged (another incident explains them); ``hold``:
        nothing changes state (the step-time incidents are being settled). A network whose
        communicators' members were kept from a CPU since their slow steps began
        (``cpu_bound(ranks, since_ns)``) is not degraded: they moved the data late."""
        groups: dict[tuple[str, ...], list[tuple[int, _Comm]]] = {}
        skip_r, skip_n = set(skip_ranks), set(skip_nodes)
        for c, x in transfer_sum_ns.items():
            info = topo.comms.get(c)
            if info is None:
                continue
            comm = self._comms.get(c)
            if comm is None:
                comm = self._comms[c] = _Comm(recent=deque(maxlen=self.window))
            if not comm.nodes:  # its nodes, once (a world communicator has thousands of
                # ranks); none in one pickled before it kept them
                comm.nodes = tuple(sorted({topo.node(r) for r in info.ranks}))
            nodes = comm.nodes
            if len(nodes) < 2:
                continue
            if not comm.baseline:
                comm.seed.append(float(x))
                if len(comm.seed) >= self.warmup:
                    comm.baseline = float(np.median(comm.seed)) or 0.0
                    comm.seed = [] if comm.baseline else comm.seed[1:]
                continue
            ratio = x / comm.baseline
            comm.recent.append((step, start_ns, ratio))
            link = "<->".join(nodes)
            if link not in self.degraded and len(comm.recent) == self.window:
                level = sorted(r for _, _, r in comm.recent)[self.window // 2]
                if level < self.back:  # follows a healthy drift
                    comm.baseline *= 1.0 + 0.05 * (level - 1.0)
            if skip_r.isdisjoint(info.ranks):
                groups.setdefault(nodes, []).append((c, comm))
        out: list[NetworkEvent] = []
        for nodes, comms in groups.items():
            link = "<->".join(nodes)
            if hold or not skip_n.isdisjoint(nodes) or len(comms) < self.min_comms:
                continue
            if any(len(c.recent) < self.window for _, c in comms):
                continue
            if set.intersection(*(set(topo.comms[c].ranks) for c, _ in comms)):
                continue  # one rank in all of them could be what is slow
            levels = [float(np.median([r for _, _, r in c.recent])) for _, c in comms]
            opened = link in self.degraded
            if not opened and min(levels) >= self.slow:  # every one of them slow
                onset, onset_ns = _onset([c for _, c in comms], self.back)
                members = set().union(*(topo.comms[c].ranks for c, _ in comms))
                if cpu_bound is not None and cpu_bound(members, onset_ns):
                    continue
                ev = NetworkEvent("degraded", link, nodes, onset, onset_ns, min(levels),
                                  len(comms))  # fmt: skip
                self.degraded.add(link)
                out.append(ev)
            elif opened and max(levels) < self.back:  # every one of them back
                self.degraded.discard(link)
                out.append(NetworkEvent("recovered", link, nodes, step, start_ns, max(levels),
                                        len(comms)))  # fmt: skip
        return out


def _onset(comms: list[_Comm], back: float) -> tuple[int, int]:
    """The first of the newest run of steps in which every communicator that had one
    transferred ``back`` times slower than usual or more."""
    per_step: dict[int, tuple[int, float]] = {}
    for comm in comms:
        for step, start_ns, ratio in comm.recent:
            _, low = per_step.get(step, (start_ns, ratio))
            per_step[step] = (start_ns, min(low, ratio))
    steps = sorted(per_step, reverse=True)
    onset = steps[0]
    for s in steps:
        if per_step[s][1] < back:
            break
        onset = s
    return onset, per_step[onset][0]


__all__ = ["NetworkEvent", "TransferWatch"]
