"""A hang told from each rank's latest heartbeat: who never issued a call its peers wait in.

Heartbeats carry, per communicator, the newest call each rank issued and completed
(docs/method.md, section 3's Algorithm 1 without the call records): a member behind
its peers never joined, a member with issued > completed is waiting. It works when the
collective records themselves are late or lost; :mod:`detectors.hang` judges from the
calls.

>>> from schemas.records import CommProgress, Heartbeat
>>> def hb(rank, issued, completed):  # one communicator, 7, of ranks 0 and 1
...     progress = CommProgress(comm_hash=7, issued_seq=issued, completed_seq=completed)
...     return Heartbeat(job="j", node="n", rank=rank, ts_ns=0, comms=[progress])
>>> d = diagnose_from_heartbeats({0: hb(0, 5, 4), 1: hb(1, 4, 4)}, {7: (0, 1)}, [])
>>> d.culprit_rank, d.seq  # rank 0 waits in call 5, which rank 1 never issued
(1, 5)
"""

from __future__ import annotations

from collections.abc import Sequence

from detectors.edges import stuck_edge
from detectors.hang import HangDiagnosis
from schemas.enums import Cause
from schemas.records import Heartbeat, ProxySummary


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
            stuck = stuck_edge(comm, None, stuck_proxies)
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
