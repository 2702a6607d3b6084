"""An aligned instance as the row the store keeps (:class:`~schemas.results.AlignedCollective`):
arrivals, transfer time, bus bandwidth (nccl-tests convention), who is missing or
unfinished, and where it sits in the schedule.

>>> from detectors.align import Instance
>>> from schemas.enums import CollOp
>>> us = 1000  # two ranks all-reduce 1 MiB; rank 1 arrives 300 us after rank 0
>>> inst = Instance("j", 9, 0, CollOp.ALL_REDUCE, -1, 2, 1 << 20, (0, 1), (0, 0),
...                 (100 * us, 400 * us), (900 * us, 900 * us))
>>> row = instance_row("j", None, inst, None, 100 * us, 400 * us, 900 * us)
>>> row.last_rank, row.transfer_ns // us, round(row.busbw_gbps, 1)
(1, 500, 16.8)
"""

from __future__ import annotations

from collections.abc import Sequence

from detectors.align import Instance
from detectors.topology import Position, Topology
from schemas.enums import CollOp, CommRole, Phase
from schemas.records import CommInfo
from schemas.results import AlignedCollective

_PHASE = {p.value: p for p in Phase}
_BUSBW_FACTOR = {
    CollOp.ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    CollOp.ALL_GATHER: lambda n: (n - 1) / n,
    CollOp.REDUCE_SCATTER: lambda n: (n - 1) / n,
}


def aligned_record(
    job: str, topo: Topology | None, inst: Instance, pos: Position | None
) -> AlignedCollective:
    """The stored row of an instance: arrivals, transfer time, bus bandwidth (nccl-tests
    convention), who is missing or unfinished, and where it sits in the schedule."""
    assert topo is not None
    arrival = inst.arrival
    info = topo.comms.get(inst.comm_hash)
    return instance_row(job, info, inst, pos, min(arrival), max(arrival), max(inst.end))


def instance_row(
    job: str,
    info: CommInfo | None,
    inst: Instance,
    pos: Position | None,
    a_min: int,
    a_max: int,
    e_max: int,
) -> AlignedCollective:
    """:func:`aligned_record` from what its caller already knows: the communicator's
    record, and the instance's first and last arrival and last end (a communicator's
    folder computes them once an instance, for the step part too)."""
    # the instance's fields by unpacking (one step), not by name: a row an instance
    _, comm_hash, seq, op, sender, comm_size, size_bytes, ranks, _, arrival, end, receiver = inst
    if receiver >= 0:  # a transfer on a larger communicator: its two ends
        expected: Sequence[int] = [r for r in (sender, receiver) if r >= 0]
    else:
        expected = info.ranks if info else ranks
    n, n_arrived = len(expected), len(ranks)
    complete = n_arrived == comm_size and min(end) >= 0
    end_ns = x = bw = None
    if complete:
        end_ns = e_max
        x = e_max - a_max if e_max > a_max else 0
        factor = _BUSBW_FACTOR.get(op)
        if x and factor is not None and n > 1:
            bw = size_bytes * factor(n) / x * 8  # Gb/s
        elif x and sender >= 0:
            bw = size_bytes / x * 8
    whole = complete and n == n_arrived
    if pos is None:
        step = microbatch = phase = pp_stage = None
    else:
        step, phase_name, microbatch, pp_stage, _ = pos
        phase = _PHASE[phase_name]
    return AlignedCollective(
        job=job,
        comm_hash=comm_hash,
        role=info.role if info else CommRole.OTHER,
        seq=seq,
        op=op,
        n_ranks=n if n > 1 else 1,
        n_arrived=n_arrived,
        size_bytes=size_bytes,
        first_arrival_ns=a_min,
        last_arrival_ns=a_max,
        last_rank=ranks[arrival.index(a_max)],
        end_ns=end_ns,
        transfer_ns=x,
        busbw_gbps=bw,
        sender=sender,
        receiver=receiver,
        missing_ranks=[] if whole else sorted(set(expected) - set(ranks)),
        unfinished_ranks=[] if complete else inst.unfinished(),
        step=step,
        microbatch=microbatch,
        phase=phase,
        pp_stage=pp_stage,
    )
