"""What a hang is localised from: every rank's latest heartbeat and the sequence numbers
it completed, the calls the aligners reported open too long (partial), and the proxy
operations posted and not completed, as :class:`~detectors.watchdog.HangWatch` keeps
them. :class:`HangEvidence` reads them at the moment a hang is judged: who went past a
call, who waits in one, who was held up by whom, which communicators the heartbeats do
not follow, and from all of it the diagnosis (:meth:`HangEvidence.localise`).

It holds the watch's own tables (no copy): it is made when a hang is judged and
dropped after.

Two ranks of a data-parallel communicator completed its call 4; rank 0 issued call 5,
rank 1 never did:

>>> from schemas.enums import CommRole
>>> from schemas.records import CommInfo, CommProgress, Heartbeat, JobInfo
>>> topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=2, dp=2))
>>> topo.add(CommInfo(job="j", ts_ns=0, comm_hash=7, role=CommRole.DP, ranks=[0, 1]))
>>> def beat(rank, issued):
...     return Heartbeat(job="j", node="n", rank=rank, ts_ns=10,
...                      comms=[CommProgress(comm_hash=7, issued_seq=issued, completed_seq=4)])
>>> ev = HangEvidence({0: beat(0, 5), 1: beat(1, 4)}, {0: {7: 4}, 1: {7: 4}}, {}, {},
...                   StuckProxies(), hb_progress_ns=5, hb_now_ns=10)
>>> diag = ev.localise(topo, {7: (0, 1)})
>>> diag.culprit_rank, diag.seq, diag.waiting, ev.blind(topo)
(1, 5, (0,), False)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from detectors.align import Instance, Key
from detectors.edges import StuckProxies
from detectors.hang import HangDiagnosis, diagnose_hang
from detectors.hang_heartbeats import diagnose_from_heartbeats, held_up_by, issued_seqs
from detectors.hang_report import earliest_call
from detectors.topology import Topology
from schemas.enums import Cause
from schemas.records import Heartbeat


@dataclass(frozen=True)
class HangEvidence:
    """What the watch's records say of each rank when a hang is judged (see the module
    docstring).

    Parameters
    ----------
    hb_latest, hb_done
        Every rank's latest heartbeat, and the sequence number it completed per
        communicator.
    joined
        Per rank and communicator, the newest partial instance it joined.
    partials
        The instances reported open too long, by key.
    stuck
        The proxy operations posted and not completed.
    hb_progress_ns, hb_now_ns
        The job's last progress, and the newest heartbeat's time.
    """

    hb_latest: dict[int, Heartbeat]
    hb_done: dict[int, dict[int, int]]
    joined: dict[int, dict[int, int]]
    partials: dict[Key, Instance]
    stuck: StuckProxies
    hb_progress_ns: int
    hb_now_ns: int

    def stopped(
        self, members: dict[int, tuple[int, ...]], seen: np.ndarray | None
    ) -> HangDiagnosis | None:
        """Without heartbeats: the member missing from a call the others wait in that was
        not seen calling since it began (``seen``: each rank's newest call end in the
        steps still open; the calls open count too), where the job stopped; one seen
        calling since was on its way to it (a pipeline's first stage still draining its
        backward when the stage it waits for stopped). None where every member missing
        was seen since (a mismatched call, not a stop)."""
        if seen is None:
            return None
        newest = {int(r): int(t) for r, t in enumerate(seen)}
        for p in self.partials.values():  # the calls open: their members were seen too
            for r, t in zip(p.ranks, p.arrival, strict=True):
                if t > newest.get(r, 0):
                    newest[r] = t

        def past_or_on_its_way(rank: int, inst: Instance) -> bool:  # not missing from it
            return newest.get(rank, 0) > inst.first_arrival_ns or self.went_past(rank, inst)

        diag = diagnose_hang(list(self.partials.values()), list(self.stuck.ops.values()),
                             members, past_or_on_its_way)  # fmt: skip
        return diag if diag is not None and diag.cause is Cause.COMPUTE else None

    def localise(self, topo: Topology, members: dict[int, tuple[int, ...]]) -> HangDiagnosis | None:
        """Who never joined the earliest call the others wait in, from the heartbeats
        (each rank's calls issued and completed), unless the hang began on a communicator
        they do not follow (:meth:`unfollowed`); where an open call's own times name who
        failed first (a dead rank's peers may stop beating after it), that one."""
        diag = self.unfollowed(members)
        if diag is not None:
            return diag
        prio = {h: {"pp": 0, "tp": 1, "dp": 3}.get(c.role.value, 2) for h, c in topo.comms.items()}
        # a rank whose heartbeats stopped before the job did, while the others beat
        stopped = frozenset(r for r, hb in self.hb_latest.items() if hb.ts_ns < self.hb_progress_ns)
        diag = diagnose_from_heartbeats(
            self.hb_latest, members, list(self.stuck.ops.values()), prio,
            silent=stopped if len(stopped) < len(self.hb_latest) else frozenset(),
            joined=self.joined,
        )  # fmt: skip
        if diag is not None and len(diag.alternatives) > 1:
            diag = earliest_call(topo, diag)
        open_calls = [p for p in self.partials.values() if not self.completed(p)]
        if diag is not None and open_calls:
            # a call open since earlier, on the same communicator, names who failed first
            # (a dead rank's peers may stop beating after it; heartbeats that stopped
            # cannot say who stopped first, the calls' own times can)
            first = diagnose_hang(open_calls, list(self.stuck.ops.values()), members,
                                  self.went_past, self.in_call)  # fmt: skip
            if (
                first is not None
                and first.culprit_rank is not None
                and first.cause == Cause.COMPUTE
                and (
                    (first.comm_hash == diag.comm_hash and first.seq < diag.seq)
                    or diag.culprit_rank in stopped
                )
                and not self.waited_on(first.culprit_rank, diag.culprit_rank, members)
                and not self.never_heard(first.culprit_rank, diag.culprit_rank)
            ):
                diag = first
        return diag

    def completed(self, inst: Instance) -> bool:
        """A partial instance every present member's heartbeats say it completed
        (:meth:`went_past`), from members that went on beating well into the silence
        since (a member's last records lost with it: a frozen or killed process sends
        none). A call that failed also ends, as a peer's death fails it; but a rank whose
        call failed stops soon after."""
        alive = (self.hb_progress_ns + self.hb_now_ns) // 2
        return bool(inst.ranks) and all(
            (hb := self.hb_latest.get(r)) is not None
            and hb.ts_ns > alive
            and self.went_past(r, inst)
            for r in inst.ranks
        )

    def never_heard(self, rank: int, named: int | None) -> bool:
        """``rank``, named by the heartbeats too, never sent one (e.g. it wrote no Flight
        Recorder dump): it is missing from every call of its communicators, and the oldest
        of them says nothing about when it stopped; the heartbeats' call (the newest its
        peers issued) says where it was needed."""
        return rank == named and rank not in self.hb_latest

    def waited_on(self, rank: int, other: int | None, members: dict[int, tuple[int, ...]]) -> bool:
        """``rank``'s last heartbeat says it was in a call that ``other`` (a member of its
        communicator) never issued: whatever calls ``rank`` missed since, it was held up."""
        mine, theirs = self.hb_latest.get(rank), self.hb_latest.get(-1 if other is None else other)
        if mine is None or theirs is None or other is None:
            return False
        calls = [
            (cp.comm_hash, cp.issued_seq) for cp in mine.comms if cp.issued_seq > cp.completed_seq
        ]
        theirs_issued = issued_seqs(theirs, self.joined.get(other))
        issued = {comm: {other: seq} for comm, seq in theirs_issued.items()}
        return held_up_by(calls, other, issued, members)

    def blind(self, topo: Topology) -> bool:
        """Some communicator's calls are not followed by the heartbeats (a source that
        counts collectives only, and a pipeline's transfers): a hang that began there
        shows only in its calls, whose partial instances come after the heartbeats (on
        another topic, once their aligner's timeout passed on their own clock)."""
        followed = self.followed()
        return any(h not in followed and len(c.ranks) > 1 for h, c in topo.comms.items())

    def followed(self) -> set[int]:
        """The communicators the heartbeats report progress on."""
        return {cp.comm_hash for hb in self.hb_latest.values() for cp in hb.comms}

    def unfollowed(self, members: dict[int, tuple[int, ...]]) -> HangDiagnosis | None:
        """A hang that began on a communicator the heartbeats do not follow, from the
        partial instances (those the aligners reported open too long).

        Heartbeats report progress per communicator as a source counts it: NCCL's
        profiler plugin counts collectives, not point-to-point transfers, whose
        sequence numbers run per peer. When the earliest call still open is on such a
        communicator, the heartbeats cannot say who never joined it (whoever is behind
        on a collective is only held up); the partial instances can: the end that never
        posted its side of the transfer, or a transfer both ends joined (the network)."""
        if not self.partials:
            return None
        followed = self.followed()
        first = min(self.partials.values(), key=lambda i: i.first_arrival_ns)
        if first.comm_hash in followed:
            return None
        return diagnose_hang(
            list(self.partials.values()), list(self.stuck.ops.values()), members, self.went_past
        )

    def went_past(self, rank: int, inst: Instance) -> bool:
        """Whether ``rank``'s heartbeats say it completed the collective ``inst`` (then its
        record of that call was lost on the way, and it is not missing from it).
        Transfers are not judged so: sources count them differently (per peer, or not
        at all) in heartbeats."""
        if inst.sender >= 0:
            return False
        done = self.hb_done.get(rank)
        return done is not None and done.get(inst.comm_hash, -1) >= inst.seq

    def in_call(self, rank: int, inst: Instance) -> bool:
        """Whether ``rank``'s latest heartbeat, from after the job stopped progressing,
        says it issued the collective ``inst`` and has not completed it: it waits in it (a
        source that writes a call's record when the call ends has sent none of it yet).
        A rank that stopped beating is not waiting, whatever it was in. Transfers are not
        judged so (as in :meth:`went_past`)."""
        hb = self.hb_latest.get(rank)
        if inst.sender >= 0 or hb is None or hb.ts_ns < self.hb_progress_ns:
            return False
        return any(
            cp.comm_hash == inst.comm_hash and cp.completed_seq < inst.seq <= cp.issued_seq
            for cp in hb.comms
        )

    def oldest_open(self, comm_hash: int) -> Instance | None:
        """The partial instance of ``comm_hash`` its first member joined earliest, of those
        not completed since."""
        open_calls = [i for (c, *_), i in self.partials.items()
                      if c == comm_hash and not self.completed(i)]  # fmt: skip
        return min(open_calls, key=lambda i: i.first_arrival_ns, default=None)

    def partial(self, comm_hash: int, sender: int, seq: int) -> Instance | None:
        """The partial instance ``seq`` of ``comm_hash`` sent by ``sender`` (to any peer)."""
        for (comm, by, _, q), inst in self.partials.items():
            if comm == comm_hash and by == sender and q == seq:
                return inst
        return None


__all__ = ["HangEvidence"]
