"""Localise a hang from the collectives that never completed.

When the job stopped progressing, each open instance tells who *joined but
did not finish* (they are waiting) and who *never joined*. Waiting ranks are
victims. The culprit of a compute-side hang is a rank that is missing from an
open instance while it is not itself waiting anywhere (it stopped before
issuing the call). If every member of the oldest open instance joined and
none finished, the collective is stuck in the network: proxy summaries with
posted-but-not-completed steps name the edge, the one with the longest
SendWait first.

This is a pure function over tables: it returns one diagnosis, not a list of
every waiting rank.

>>> from detectors.align import Instance
>>> from schemas.units import CollOp
>>> waiting = Instance("j", 5, 7, CollOp.ALL_REDUCE, -1, 2, 8, (0,), (10,), (12,), (-1,))
>>> diagnose_hang([waiting], []).culprit_rank
1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from schemas.records import ProxySummary
from schemas.units import Cause, CollOp, Direction

from detectors.align import Instance


@dataclass(frozen=True)
class HangDiagnosis:
    cause: Cause
    culprit_rank: int | None
    instance: Instance
    missing: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    link: tuple[int, int] | None = None
    evidence: dict[str, float] = field(default_factory=dict)


def _members(inst: Instance, member_of: dict[int, tuple[int, ...]] | None) -> tuple[int, ...]:
    if inst.sender >= 0:  # point-to-point: the two ends
        others = [r for r in inst.ranks if r != inst.sender]
        if member_of and inst.comm_hash in member_of:
            return member_of[inst.comm_hash]
        return tuple(sorted({inst.sender, *others}))
    if member_of and inst.comm_hash in member_of:
        return member_of[inst.comm_hash]
    return tuple(range(inst.comm_size))  # fallback: comm ranks unknown


def diagnose_hang(open_instances: Sequence[Instance], stuck_proxies: Sequence[ProxySummary],
                  member_of: dict[int, tuple[int, ...]] | None = None) -> HangDiagnosis | None:
    """One diagnosis for the set of incomplete instances (None if there is none).

    ``member_of`` maps a communicator hash to its member ranks (from the job metadata).
    """
    if not open_instances:
        return None
    waiting: set[int] = set()
    missing_in: dict[int, list[Instance]] = {}
    for inst in open_instances:
        waiting.update(inst.unfinished())
        for r in set(_members(inst, member_of)) - set(inst.ranks):
            missing_in.setdefault(r, []).append(inst)
    culprits = {r: insts for r, insts in missing_in.items() if r not in waiting}
    if culprits:
        # the one whose missing call others have waited on longest
        rank, insts = min(culprits.items(), key=lambda kv: min(i.first_arrival_ns for i in kv[1]))
        inst = min(insts, key=lambda i: i.first_arrival_ns)
        return HangDiagnosis(
            Cause.COMPUTE, rank, inst, missing=(rank,), waiting=tuple(sorted(inst.ranks)),
            evidence={"open_instances": float(len(open_instances)),
                      "waiting_ranks": float(len(waiting)),
                      "first_wait_ns": float(inst.first_arrival_ns)},
        )
    # everybody joined somewhere and waits: a transfer that never completed
    full = [i for i in open_instances if set(_members(i, member_of)) <= set(i.ranks)]
    root = min(full or open_instances, key=lambda i: i.first_arrival_ns)
    link = _stuck_edge(root, stuck_proxies)
    src = link[0] if link else (root.sender if root.sender >= 0 else None)
    ev = {"open_instances": float(len(open_instances)), "waiting_ranks": float(len(waiting))}
    if link:
        ev["stuck_send_wait_ns"] = float(link[2])
        ev["steps_not_done"] = float(link[3])
    return HangDiagnosis(Cause.NETWORK_LINK, src, root, waiting=tuple(sorted(waiting)),
                         link=(link[0], link[1]) if link else None, evidence=ev)


def _stuck_edge(inst: Instance, proxies: Sequence[ProxySummary]
                ) -> tuple[int, int, int, int] | None:
    """(src, dst, send_wait_ns, steps not done) of the stuck edge of ``inst``, if known."""
    best = None
    for p in proxies:
        if p.comm_hash != inst.comm_hash or p.seq != inst.seq or p.direction != Direction.SEND:
            continue
        if p.steps_done >= p.steps_posted:
            continue
        cand = (p.rank, p.peer, p.send_wait_ns, p.steps_posted - p.steps_done)
        if best is None or cand[2] > best[2]:
            best = cand
    if best is None and inst.op == CollOp.SEND and inst.sender >= 0:
        others = [r for r in inst.ranks if r != inst.sender]
        if others:
            return (inst.sender, others[0], 0, 0)
    return best
