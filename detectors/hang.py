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
from detectors.edges import edge_cause
from schemas.enums import Cause, CollOp, Direction
from schemas.records import Heartbeat, ProxySummary


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
    stuck = _stuck_edge(root.comm_hash, root.seq, stuck_proxies)
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


def _stuck_edge(
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


def held_up_by(
    calls: Sequence[tuple[int, int]],
    other: int,
    issued: dict[int, dict[int, int]],
    member_of: dict[int, tuple[int, ...]],
) -> bool:
    """Whether a rank whose last heartbeat had ``calls`` open ((comm, seq), issued and
    not completed) was waiting on ``other``: a member of one of those communicators
    that never issued that call (``issued``: comm -> rank -> its issued seq)."""
    return any(
        other in member_of.get(comm, ()) and issued.get(comm, {}).get(other, -1) < seq
        for comm, seq in calls
    )


def issued_seqs(hb: Heartbeat, joined: dict[int, int] | None = None) -> dict[int, int]:
    """What a rank issued per communicator: its heartbeat's word, or further where the
    calls it joined (``joined``: comm -> the newest) went past a stalled heartbeat."""
    joined = joined or {}
    return {cp.comm_hash: max(cp.issued_seq, joined.get(cp.comm_hash, -1)) for cp in hb.comms}


def _first_stopped(
    culprits: list[tuple[int, int, int, tuple[int, ...]]],
    was_in: dict[int, list[tuple[int, int]]],
    issued: dict[int, dict[int, int]],
    member_of: dict[int, tuple[int, ...]],
) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """Of several ranks that stopped beating, the ones no other of them waited on.

    A killed rank's peers fail in its calls and stop after it: each of them is then
    behind somewhere too. A stopped rank whose last heartbeat says it was in a call
    that another stopped culprit never joined was waiting on that one; the culprits
    nobody among them waited on are where the job stopped (all of them, when the waits
    go round)."""
    names = {b[0] for b in culprits}
    if len(names) < 2 or not was_in:
        return culprits
    waited = {
        rank
        for rank in names
        if any(held_up_by(was_in.get(rank, ()), r, issued, member_of) for r in names - {rank})
    }
    roots = [b for b in culprits if b[0] not in waited]
    return roots or culprits


def diagnose_from_heartbeats(
    latest: dict[int, Heartbeat],
    member_of: dict[int, tuple[int, ...]],
    stuck_proxies: Sequence[ProxySummary],
    priority: dict[int, int] | None = None,
    silent: frozenset[int] = frozenset(),
    joined: dict[int, dict[int, int]] | None = None,
) -> HangDiagnosis | None:
    """The same diagnosis from each rank's latest heartbeat (issued/completed per communicator).

    A member whose issued sequence number is behind its peers' never joined; a
    member with issued > completed is waiting. Works even when the collective
    records themselves are late or lost. ``priority`` orders communicators when
    the culprit is missing from several calls (lower first: the most specific
    place in the schedule, e.g. a pipeline Recv before the gradient sync).
    ``silent`` ranks stopped beating while the others went on (a process stopped or
    gone): whatever their last heartbeat said they were in, they are not waiting. A
    member that never beat while its peers did is named before any that did.

    ``joined``: rank -> communicator -> the newest call its own records show it joined
    (a heartbeat stream can stall while its rank's calls go on: the calls say it issued
    at least that far). A call every member joined and none completed, one of them
    stopped beating since, is that one's.
    """
    joined = joined or {}
    issued: dict[int, dict[int, int]] = {}
    waiting: set[int] = set()
    waiting_on: dict[int, set[int]] = {}  # communicator -> its members waiting in a call
    was_in: dict[int, list[tuple[int, int]]] = {}  # a silent rank's open calls (comm, seq)
    completed: dict[int, dict[int, int]] = {}
    for rank, hb in latest.items():
        mine = issued_seqs(hb, joined.get(rank))
        for cp in hb.comms:
            seq = mine[cp.comm_hash]
            issued.setdefault(cp.comm_hash, {})[rank] = seq
            completed.setdefault(cp.comm_hash, {})[rank] = cp.completed_seq
            if seq > cp.completed_seq:
                if rank not in silent:
                    waiting.add(rank)
                    waiting_on.setdefault(cp.comm_hash, set()).add(rank)
                else:
                    was_in.setdefault(rank, []).append((cp.comm_hash, seq))
    behind: list[tuple[int, int, int, tuple[int, ...]]] = []  # (rank, comm, seq, waiters)
    stuck_comms: list[tuple[int, int, tuple[int, ...]]] = []
    for comm, by_rank in issued.items():
        members = member_of.get(comm, tuple(by_rank))
        top = max(by_rank.values())
        at_top = tuple(r for r in members if by_rank.get(r, -1) == top)
        # the first call the waiters could not complete (calls issued without waiting, as
        # a data-parallel job's gradient buckets are, run ahead of it): a communicator's
        # calls complete in order
        done = completed.get(comm, {})
        first = min([top, *(done[r] + 1 for r in at_top if r in waiting and r in done)])
        for r in members:
            if by_rank.get(r, -1) < top:
                behind.append((r, comm, max(by_rank.get(r, -1) + 1, first), at_top))
        # members waiting in this communicator's call (one waiting in another's, all
        # of this one's calls completed, is not stuck here)
        if any(r in waiting_on.get(comm, ()) for r in at_top):
            # the first call its waiters could not complete, if every member issued it, is
            # stuck with no one missing, in the members that did not complete it (others
            # may have and gone on: their share came before the transfer stopped)
            open_at = min(done[r] + 1 for r in members if r in waiting_on.get(comm, ()))
            if all(by_rank.get(r, -1) >= open_at for r in members):
                in_it = tuple(r for r in members if done.get(r, -1) < open_at)
                stuck_comms.append((comm, open_at, in_it))
    culprits = [b for b in behind if b[0] not in waiting]
    # a member never heard from while its peers were (it wrote no dump: killed or
    # stopped before anyone) stopped first; peers that failed in its calls are behind
    # elsewhere too, after it
    culprits = [b for b in culprits if b[0] not in latest] or culprits
    culprits = _first_stopped(culprits, was_in, issued, member_of)
    if culprits:
        prio = priority or {}
        rank, comm, seq, waiters = min(culprits, key=lambda b: (prio.get(b[1], 9), b[2], b[0]))
        alternatives = tuple((c, q) for r, c, q, _w in culprits if r == rank)
        # every rank as far behind on that communicator, waiting nowhere, stopped as well
        behind_at = {r: q for r, c, q, _w in culprits if c == comm}
        low = issued[comm].get(rank, -1)
        missing = tuple(sorted(r for r in behind_at if issued[comm].get(r, -1) == low))
        return HangDiagnosis(
            Cause.COMPUTE,
            rank,
            comm,
            seq,
            -1,
            None,
            0,
            missing=missing,
            waiting=waiters,
            alternatives=alternatives,
            evidence={
                "waiting_ranks": float(len(waiting)),
                "source_heartbeats": 1.0,
                **({"heartbeats_stopped": 1.0} if rank in silent else {}),
            },
        )
    if stuck_comms:
        for comm, seq, members in stuck_comms:
            stuck = _stuck_edge(comm, None, stuck_proxies)
            if stuck:
                cause, culprit, link, ev = stuck
                return HangDiagnosis(
                    cause,
                    culprit,
                    comm,
                    seq,
                    -1,
                    None,
                    0,
                    waiting=members,
                    link=link,
                    evidence={**ev, "source_heartbeats": 1.0},
                )
        for comm, seq, members in stuck_comms:
            # every member joined and the call never completed, but one stopped beating
            # while the others went on: it stopped in the call (a frozen process), not
            # the network
            frozen = [r for r in members if r in silent]
            if frozen:
                rank = min(frozen, key=lambda r: (latest[r].ts_ns, r))
                return HangDiagnosis(
                    Cause.COMPUTE,
                    rank,
                    comm,
                    seq,
                    missing=tuple(sorted(frozen)),
                    waiting=tuple(r for r in members if r not in silent),
                    evidence={"source_heartbeats": 1.0, "heartbeats_stopped": 1.0,
                              "waiting_ranks": float(len(waiting))},
                )  # fmt: skip
        comm, seq, members = stuck_comms[0]
        return HangDiagnosis(
            Cause.NETWORK_LINK,
            None,
            comm,
            seq,
            -1,
            None,
            0,
            waiting=members,
            evidence={"source_heartbeats": 1.0},
        )
    return None
