"""Which end of a transfer is to blame, from its proxy wait states (docs/method.md, section 6).

NCCL's proxy thread records where each transfer step waited. On an edge
u -> v:

=====================================================  ==========================
pattern                                                cause
=====================================================  ==========================
SendWait at u and RecvWait at v dominate               the link / NIC u -> v
SendGPUWait at u dominates (v waits in RecvWait)       u's GPU, late producing
SendPeerWait at u and RecvGPUWait at v dominate        v's GPU, late consuming
=====================================================  ==========================

(The table's last row, several slow edges sharing a NIC, is a judgement over
many edges; :class:`~detectors.job.JobAnalyzer` makes it.)

>>> from schemas.records import ProxySummary
>>> from schemas.enums import Direction
>>> def p(rank, peer, d, **w):
...     return ProxySummary(job="j", node="n", rank=rank, comm_hash=1, seq=0, channel=0,
...         peer=peer, direction=d, steps_posted=8, steps_done=4, size_bytes=1,
...         first_ns=0, last_ns=10, **w)
>>> edge_cause(p(0, 1, Direction.SEND, send_gpu_wait_ns=500, send_wait_ns=20),
...            p(1, 0, Direction.RECV, recv_wait_ns=520))
EdgeCause(cause=<Cause.COMPUTE: 'compute'>, rank=0, state='send_gpu_wait')
>>> edge_cause(p(0, 1, Direction.SEND, send_wait_ns=500), None).cause.value
'network_link'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from schemas.enums import Cause, Direction
from schemas.records import ProxySummary


class EdgeCause(NamedTuple):
    """The table's answer: a cause, the rank it names (the sender for the link), and the
    wait state that decided it."""

    cause: Cause
    rank: int
    state: str


_SEND_STATES = ("send_gpu_wait", "send_peer_wait", "send_wait")


def edge_cause(send: ProxySummary, recv: ProxySummary | None) -> EdgeCause:
    """Classify the edge ``send.rank -> send.peer`` from its two ends' wait states.

    ``recv`` is the receiving end's summary of the same (comm, seq, channel), if known.
    """
    if send.direction != Direction.SEND or (recv is not None and recv.direction != Direction.RECV):
        raise ValueError("edge_cause takes the sending end's summary, then the receiving end's")
    waits = {name: getattr(send, f"{name}_ns") for name in _SEND_STATES}
    state = max(waits, key=waits.__getitem__)
    if waits[state] <= 0:  # nothing recorded: posted and never completed, the network's
        return EdgeCause(Cause.NETWORK_LINK, send.rank, "send_wait")
    if state == "send_gpu_wait":
        return EdgeCause(Cause.COMPUTE, send.rank, state)
    if state == "send_peer_wait":
        # the receiver has no buffer free: its GPU does not consume (if its proxy says so)
        if recv is not None and recv.recv_gpu_wait_ns >= recv.recv_wait_ns:
            return EdgeCause(Cause.COMPUTE, send.peer, "recv_gpu_wait")
        return EdgeCause(Cause.UNKNOWN, send.peer, state)
    return EdgeCause(Cause.NETWORK_LINK, send.rank, state)


__all__ = ["EdgeCause", "edge_cause"]


class StuckProxies:
    """Proxy operations posted and not completed (a network hang's evidence), by
    (comm, seq, rank, channel, peer, direction); the oldest go beyond ``limit``."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self.ops: dict[tuple[int, ...], ProxySummary] = {}

    def update(self, p: ProxySummary) -> bool:
        """Note a summary; True when it is stuck, or completes one that was."""
        if p.steps_done < p.steps_posted:
            self.ops[(p.comm_hash, p.seq, p.rank, p.channel, p.peer, p.direction)] = p
            if len(self.ops) > self.limit:
                self.ops.pop(next(iter(self.ops)))
            return True
        if not self.ops:  # nothing stuck (nearly always): nothing to complete
            return False
        key = (p.comm_hash, p.seq, p.rank, p.channel, p.peer, p.direction)
        return self.ops.pop(key, None) is not None


class EdgeThroughput(NamedTuple):
    """Throughput of one edge over a window of its completed sends, from proxy summaries:
    bytes over time in SendWait, the measure the NCCL plugin's link samples use (the
    network's share of the transfer). The job uses it for sources that send no link
    samples of their own. ``gpu_wait_ns`` is the mean SendGPUWait per send: how long the
    sender's data was not there yet (its GPU's share; the decision table of docs/method.md)."""

    job: str
    src_rank: int
    dst_rank: int
    ts_ns: int
    window_ns: int
    size_bytes: int
    throughput_gbps: float
    gpu_wait_ns: int = 0


def stuck_edge(
    comm_hash: int, seq: int | None, proxies: Sequence[ProxySummary]
) -> tuple[Cause, int, tuple[int, int], dict[str, float]] | None:
    """(cause, culprit rank, (src, dst), evidence) of the stuck edge, if proxies show one.

    Of several stuck sends, the one that waited longest; its cause from its wait states
    and the receiving end's (:func:`~detectors.edges.edge_cause`).
    """

    def waited(p: ProxySummary) -> tuple[int, int]:
        return p.send_gpu_wait_ns + p.send_peer_wait_ns + p.send_wait_ns, p.last_ns - p.first_ns

    send = None
    for p in proxies:
        if p.comm_hash != comm_hash or p.direction != Direction.SEND:
            continue
        if (seq is not None and p.seq != seq) or p.steps_done >= p.steps_posted:
            continue
        if send is None or waited(p) > waited(send):
            send = p
    if send is None:
        return None
    recv = next(
        (
            p
            for p in proxies
            if p.direction == Direction.RECV
            and (p.comm_hash, p.seq, p.channel, p.rank, p.peer)
            == (send.comm_hash, send.seq, send.channel, send.peer, send.rank)
        ),
        None,
    )
    found = edge_cause(send, recv)
    cause = Cause.NETWORK_LINK if found.cause == Cause.UNKNOWN else found.cause
    ev = {
        "stuck_send_wait_ns": float(send.send_wait_ns),
        "stuck_send_gpu_wait_ns": float(send.send_gpu_wait_ns),
        "stuck_send_peer_wait_ns": float(send.send_peer_wait_ns),
        "steps_not_done": float(send.steps_posted - send.steps_done),
    }
    if recv is not None:
        ev["stuck_recv_wait_ns"] = float(recv.recv_wait_ns)
        ev["stuck_recv_gpu_wait_ns"] = float(recv.recv_gpu_wait_ns)
    culprit = found.rank if cause == Cause.COMPUTE else send.rank
    return cause, culprit, (send.rank, send.peer), ev
