"""Localise a hang from the collectives that never completed.

When the job stopped progressing, each open instance tells who *joined but
did not finish* (they are waiting) and who *never joined*. Waiting ranks are
victims. The culprit of a compute-side hang is a rank that is missing from an
open instance while it is not itself waiting anywhere (it stopped before
issuing the call). If every member of the oldest open instance joined and
none finished, a transfer is stuck: proxy summaries with posted-but-not-completed
steps name the edge, and the state its steps wait in names the culprit
(:func:`~detectors.edges.edge_cause`): the network (SendWait), or the sending
GPU that stopped producing data (SendGPUWait), or the receiving GPU that
stopped consuming it (RecvGPUWait).

This is a pure function over tables: it returns one diagnosis, not a list of
every waiting rank.

>>> from detectors.align import Instance
>>> from schemas.enums import CollOp
>>> waiting = Instance("j", 5, 7, CollOp.ALL_REDUCE, -1, 2, 8, (0,), (10,), (12,), (-1,))
>>> diagnose_hang([waiting], []).culprit_rank
1
>>> in_it = lambda rank, inst: rank == 1  # its heartbeat: issued seq 7, not completed
>>> diagnose_hang([waiting], [], in_call=in_it).cause.value  # both in it: a transfer
'network_link'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from detectors.align import Instance, Key
from detectors.edges import stuck_edge
from schemas.enums import Cause, CollOp
from schemas.records import ProxySummary


@dataclass(frozen=True)
class HangDiagnosis:
    """Who stopped the job, in which call, and what the evidence is."""

    cause: Cause
    culprit_rank: int | None
    comm_hash: int
    seq: int
    sender: int = -1
    op: CollOp | None = None
    first_wait_ns: int = 0
    missing: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    link: tuple[int, int] | None = None
    evidence: dict[str, float] = field(default_factory=dict)
    #: other (comm_hash, seq) calls the culprit is missing from
    alternatives: tuple[tuple[int, int], ...] = ()

    @property
    def counted(self) -> bool:
        """Judged from heartbeats: ``seq`` is a rank's count of the communicator's calls
        (a transfer's own sequence numbers count one direction of a pair)."""
        return "source_heartbeats" in self.evidence

    @property
    def unwitnessed(self) -> bool:
        """A call every member joined, judged stuck in the network from its time alone:
        no proxy operation of it was seen waiting (a job whose sources count no network
        work, as Gloo's and the original tool's logs do). A slow transfer looks the same
        until it completes."""
        return self.cause == Cause.NETWORK_LINK and "steps_not_done" not in self.evidence


def _members(inst: Instance, member_of: dict[int, tuple[int, ...]] | None) -> tuple[int, ...]:
    if inst.sender >= 0:  # point-to-point: the two ends
        if inst.receiver >= 0:  # (a pipeline group's communicator has more ranks)
            return tuple(sorted({inst.sender, inst.receiver}))
        others = [r for r in inst.ranks if r != inst.sender]
        if member_of and inst.comm_hash in member_of:
            return member_of[inst.comm_hash]
        return tuple(sorted({inst.sender, *others}))
    if member_of and inst.comm_hash in member_of:
        return member_of[inst.comm_hash]
    return tuple(range(inst.comm_size))  # fallback: comm ranks unknown


def _passed(
    inst: Instance,
    member_of: dict[int, tuple[int, ...]] | None,
    went_past: Callable[[int, Instance], bool],
) -> bool:
    missing = set(_members(inst, member_of)) - set(inst.ranks)
    return bool(missing) and all(went_past(r, inst) for r in missing)


def diagnose_hang(
    open_instances: Sequence[Instance],
    stuck_proxies: Sequence[ProxySummary],
    member_of: dict[int, tuple[int, ...]] | None = None,
    went_past: Callable[[int, Instance], bool] | None = None,
    in_call: Callable[[int, Instance], bool] | None = None,
) -> HangDiagnosis | None:
    """One diagnosis for the set of incomplete instances (None if there is none).

    ``member_of`` maps a communicator hash to its member ranks (from the job metadata).
    ``went_past(rank, inst)``: whether ``rank`` is known to have finished ``inst`` (its
    heartbeats say so) although no record of its call arrived: not missing from it.
    ``in_call(rank, inst)``: whether ``rank`` is known to have issued ``inst`` and not
    finished it (its heartbeats say so; a source that writes a call's record once it
    ends has none of it yet): waiting in it, not missing from it.
    """
    if went_past is not None:  # a call whose every missing member went past it: no hang's
        open_instances = [i for i in open_instances if not _passed(i, member_of, went_past)]
    if not open_instances:
        return None
    waiting: set[int] = set()
    missing_in: dict[int, list[Instance]] = {}
    joined_in: dict[Key, set[int]] = {}  # members in a call by their heartbeats alone
    for inst in open_instances:
        waiting.update(inst.unfinished())
        for r in set(_members(inst, member_of)) - set(inst.ranks):
            if in_call is not None and in_call(r, inst):
                waiting.add(r)
                joined_in.setdefault(inst.key, set()).add(r)
            elif went_past is None or not went_past(r, inst):
                missing_in.setdefault(r, []).append(inst)
    culprits = {r: insts for r, insts in missing_in.items() if r not in waiting}
    if culprits:
        # the one whose missing call others have waited on longest
        rank, insts = min(culprits.items(), key=lambda kv: min(i.first_arrival_ns for i in kv[1]))
        inst = min(insts, key=lambda i: i.first_arrival_ns)
        # every rank that never joined that call and waits nowhere: all of them stopped
        missing = tuple(sorted(r for r, mine in culprits.items() if inst in mine))
        return HangDiagnosis(
            Cause.COMPUTE,
            rank,
            inst.comm_hash,
            inst.seq,
            inst.sender,
            inst.op,
            inst.first_arrival_ns,
            missing=missing,
            waiting=tuple(sorted(inst.ranks)),
            evidence={
                "open_instances": float(len(open_instances)),
                "waiting_ranks": float(len(waiting)),
                "first_wait_ns": float(inst.first_arrival_ns),
            },
        )
    # everybody joined somewhere and waits: a transfer that never completed
    full = [
        i for i in open_instances
        if set(_members(i, member_of)) <= set(i.ranks) | joined_in.get(i.key, set())
    ]  # fmt: skip
    root = min(full or open_instances, key=lambda i: i.first_arrival_ns)
    ev = {"open_instances": float(len(open_instances)), "waiting_ranks": float(len(waiting))}
    stuck = stuck_edge(root.comm_hash, root.seq, stuck_proxies)
    if stuck is not None:
        cause, culprit, link, proxy_ev = stuck
        ev.update(proxy_ev)
    else:
        cause, culprit, link = Cause.NETWORK_LINK, None, None
        if root.op == CollOp.SEND and root.sender >= 0:
            others = [r for r in root.ranks if r != root.sender]
            link = (root.sender, others[0]) if others else None
        culprit = link[0] if link else (root.sender if root.sender >= 0 else None)
    return HangDiagnosis(
        cause,
        culprit,
        root.comm_hash,
        root.seq,
        root.sender,
        root.op,
        root.first_arrival_ns,
        waiting=tuple(sorted(waiting)),
        link=link,
        evidence=ev,
    )
