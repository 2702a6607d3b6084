"""The hang watchdog of one job: hangs are silence, so liveness is watched explicitly.

:class:`HangWatch` keeps what a hang is judged from: every rank's latest heartbeat and
the sequence numbers it completed per communicator, the newest completed collective,
the instances the aligners reported open too long (partial), and the proxy operations
posted and not completed. :meth:`HangWatch.tick` calls a hang when the job made no
progress for ``hang_factor`` x its expected step time, or x a silence it came out of
lately where that was longer (its present pace: a job slowed by a link under a large
call is silent in it every step; at least ``min_hang_ms``; a recording's end is silence
that goes on, and where it ended before a step's silence, a call it ended in that had
stayed open twice as long as any call of its communicator did is where the job stopped:
:mod:`detectors.hang_pace`; while a rank saves a checkpoint, at least ``save_hang_s``:
the job's own pause, which its peers wait out at their next collective, and no pace;
before a start of the job completed a collective, at least ``start_hang_s``; a call
every member joined, with no proxy operation to show its transfer stopped, at least
``stall_hang_s``: a slow transfer is silent as long), and localises it from what its
records say of each rank (:mod:`detectors.hang_evidence`, with :mod:`detectors.hang`):
the member missing from the earliest call the others wait in (several, if several never
joined it; without heartbeats, one not seen calling since it began before one that
was), or, where every member joined, the edge whose proxy operations never completed
and whether the network or a GPU stopped. The verdict is written by
:func:`detectors.hang_report.report_hang`. Progress after the call resolves it.

It is pure: the job's clock comes in the records and in :meth:`tick`'s argument, what
it needs of the job (its layout, where a call sits in the schedule, the verdict book)
comes in a :class:`JobView`.

>>> from detectors.verdicts import VerdictBook
>>> from schemas.enums import CommRole
>>> from schemas.records import CommInfo, CommProgress, Heartbeat, JobInfo
>>> from detectors.topology import Topology
>>> topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=2, tp=2))
>>> topo.add(CommInfo(job="j", ts_ns=0, comm_hash=7, role=CommRole.TP, ranks=[0, 1]))
>>> view = JobView(topo, VerdictBook("j"), expected_ns=100e6, coll_now_ns=0,
...                place=lambda diag, partial, op, sender_stage, receiver_stage, at: None)
>>> watch, sec = HangWatch(), 10**9
>>> def beat(rank, t, issued, completed):
...     return Heartbeat(job="j", node="n", rank=rank, ts_ns=t, comms=[
...         CommProgress(comm_hash=7, issued_seq=issued, completed_seq=completed)])
>>> for t in range(1, 5):  # both ranks complete a collective a second
...     _ = [watch.heartbeat(beat(r, t * sec, t, t), view.book) for r in (0, 1)]
>>> def stuck(t):  # rank 0 waits in seq 5; rank 1 never issued it
...     for rank, issued in ((0, 5), (1, 4)):
...         watch.heartbeat(beat(rank, t, issued, 4), view.book)
>>> stuck(4.3 * sec)
>>> watch.tick(4.3 * sec, view)  # silent for 0.3 s: not yet (0.5 s at least)
[]
>>> stuck(5 * sec)
>>> (v,) = watch.tick(5 * sec, view)
>>> v.kind.value, v.rank, v.seq, v.evidence["silent_ns"] / sec
('hang', 1, 5, 1.0)
"""

from __future__ import annotations

import msgspec

from detectors.align import Instance, Key
from detectors.edges import StuckProxies
from detectors.hang import (
    HangDiagnosis,
    diagnose_hang,
)
from detectors.hang_evidence import HangEvidence
from detectors.hang_pace import HangPace
from detectors.hang_report import JobView, report_hang
from detectors.verdicts import VerdictBook
from schemas.enums import VerdictKind
from schemas.records import Heartbeat, ProxySummary


class HangWatch(HangPace):
    """Liveness of one job, and its hang verdict (see the module docstring)."""

    def __init__(self) -> None:
        self._reset()

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        # snapshots of versions without them
        self.__dict__.setdefault("revisable", False)
        self.__dict__.setdefault("saw_save_ns", 0)
        self.__dict__.setdefault("exited", {})
        if isinstance(self.__dict__.get("final"), bool):  # (a flag once)
            self.final = "the recording ended there" if self.final else ""
        self.__dict__.setdefault("joined", {})
        self.__dict__.setdefault("silence", (0, 0, 0))
        self.__dict__.setdefault("starting", False)  # (a snapshot of a job under way)
        self.__dict__.setdefault("woke_ns", 0)
        self.__dict__.setdefault("open_times", {})

    def _reset(self) -> None:
        self.partials: dict[Key, Instance] = {}
        self.stuck = StuckProxies()
        self.last_progress_ns = 0  # the newest end of a completed collective
        self.hb_latest: dict[int, Heartbeat] = {}
        self.hb_done: dict[int, dict[int, int]] = {}  # rank -> comm -> completed seq
        self.hb_progress_ns = 0
        self.hb_now_ns = 0
        self.open: str | None = None  # the open hang incident's culprit
        self.detected_ns = 0
        self.final = ""  # what ended where the hang being judged is: the input, the job
        self.revisable = False  # the open hang may be blamed elsewhere (see _revise)
        self.joined: dict[int, dict[int, int]] = {}  # rank -> comm -> newest partial it joined
        # the job's pace: a silence it came out of, until when it counts, when it began
        self.silence = (0, 0, 0)
        self.saw_save_ns = 0  # the newest heartbeat that showed a rank saving a checkpoint
        self.exited: dict[int, int] = {}  # rank -> its process's last heartbeat (exiting)
        self.starting = True  # this start of the job has completed no collective yet
        self.woke_ns = 0  # the first heartbeat after the job's last progress
        self.open_times: dict[int, int] = {}  # comm -> the longest its calls stayed open

    # ------------------------------------------------------------------ inputs
    def heartbeat(self, hb: Heartbeat, book: VerdictBook) -> list[msgspec.Struct]:
        """Liveness and progress: a completed sequence number that moved is progress (and
        ends an open hang); so is a rank's new process (:meth:`started_again`)."""
        ts = hb.ts_ns
        before = self.hb_latest.get(hb.rank)
        out: list[msgspec.Struct] = []
        if before is not None and before.pid != hb.pid and self.restarted(hb, before):
            out, before = self.started_again(ts, book), None
        self.hb_latest[hb.rank] = hb
        if hb.save_ns and (hb.saving_since_ns is not None or (
            before is not None and before.save_ns is not None and hb.save_ns > before.save_ns
        )):  # fmt: skip
            self.saw_save_ns = ts
        if ts > self.hb_now_ns:
            self.hb_now_ns = ts
        done = self.hb_done.get(hb.rank)
        if hb.exiting:
            self.exited[hb.rank] = ts
        if done is None:
            done = self.hb_done[hb.rank] = {}
        if not self.hb_progress_ns:  # the job's first heartbeat: its start, as progress
            self.hb_progress_ns = ts
        if ts > self.hb_progress_ns and not self.hb_progress_ns < self.woke_ns <= ts:
            self.woke_ns = ts  # the first heartbeat since the job's last progress
        moved = False
        for cp in hb.comms:
            if cp.completed_seq > done.get(cp.comm_hash, -1):
                done[cp.comm_hash] = cp.completed_seq
                moved = True
        if not moved:
            return out
        starting, self.starting = self.starting, False
        if (
            not starting
            and before is not None
            and before.ts_ns > self.hb_progress_ns > max(0, self.saw_save_ns)
        ):
            # silent at least from its last progress to this rank's heartbeat before,
            # which showed none (what came after, up to a heartbeat apart, is not known);
            # not a silence a rank spent saving a checkpoint, nor the job's start: no pace
            self._came_out(self.hb_progress_ns, before.ts_ns - self.hb_progress_ns, ts)
        self.hb_progress_ns = max(self.hb_progress_ns, ts)
        if self.open and ts > self.detected_ns:
            return out + self._resolve(book, ts)
        return out

    def started_again(self, ts_ns: int, book: VerdictBook) -> list[msgspec.Struct]:
        """The job was started again (a rank's new process beat at ``ts_ns``): a hang its
        first start ended in is over, and what that start left (its ranks' heartbeats, its
        calls open, its pace) is no evidence of the new one: a start, judged as one
        (``start_hang_s``), whose silence counts from ``ts_ns`` (the job's caller judges
        the first start's end before: :meth:`tick`'s ``ended``)."""
        out = self._resolve(book, ts_ns) if self.open else []
        self._reset()
        self.hb_progress_ns = self.hb_now_ns = ts_ns
        return out

    @staticmethod
    def restarted(hb: Heartbeat, before: Heartbeat) -> bool:
        """Whether ``hb`` comes from a new process of its rank (the job was started again):
        its pid is not the one of the rank's heartbeat ``before`` (0: a source that tells
        none)."""
        return hb.pid != before.pid and bool(hb.pid and before.pid)

    def progress(self, end_ns: int, book: VerdictBook) -> list[msgspec.Struct]:
        """Collectives completed up to ``end_ns``: the job moves (without heartbeats, and
        with nothing open, that ends a hang)."""
        if end_ns <= self.last_progress_ns:
            return []
        if self.last_progress_ns and not self.hb_latest:  # (with heartbeats, theirs)
            self._came_out(self.last_progress_ns, end_ns - self.last_progress_ns, end_ns)
        self.last_progress_ns = end_ns
        if self.open and not self.partials and not self.hb_latest:
            return self._resolve(book, end_ns)
        return []

    def partial(self, inst: Instance) -> None:
        """An instance open too long: a hang's evidence, until it completes. Its members
        issued it, whatever their heartbeats (which can stall) said."""
        self.partials[inst.key] = inst
        if inst.sender < 0:
            joined = self.joined
            for r in inst.ranks:
                mine = joined.setdefault(r, {})
                if inst.seq > mine.get(inst.comm_hash, -1):
                    mine[inst.comm_hash] = inst.seq

    def completed(self, key: Key) -> None:
        self.partials.pop(key, None)

    def proxy(self, p: ProxySummary) -> None:
        """Stuck proxy operations (and their completion)."""
        self.stuck.update(p)

    def _resolve(self, book: VerdictBook, ts_ns: int) -> list[msgspec.Struct]:
        assert self.open is not None
        v = book.resolve(VerdictKind.HANG.value, self.open, ts_ns)
        self.open = None
        return [v] if v else []

    # ------------------------------------------------------------------ judging
    def tick(
        self, now_ns: int, view: JobView, final: bool = False, ended: str = ""
    ) -> list[msgspec.Struct]:
        """Call periodically with the current (event) time.

        With heartbeats, progress is a completed sequence number that moved and the
        diagnosis uses every rank's latest heartbeat (robust to collective records that
        arrive late, e.g. from a lagging partition). Without heartbeats (old logs),
        progress is the newest completed instance and the diagnosis uses the partial
        instances reported by the aligners; then ``now_ns`` is read as the collective
        records' clock. Records in time order (offline) can pass the newest time of any
        record. A stream processor, whose topics are read at different paces, must not:
        link samples read seconds ahead of the collectives are not silence of the job
        (the flow passes the time the collectives showed, moved on by the wall clock only
        while they show nothing new).

        ``final``: the input ended (a recording): its end is silence that goes on. A call
        some ranks posted and others never did, at least a step's time before the end
        and with no progress since, is a hang (a recording cut in the middle of a step
        leaves only calls younger than that open). So is the end of the job's processes
        (:meth:`ended`), and of a start of the job that was started again (``ended``
        says what ended, in the verdict).
        """
        if self.open:
            return self._revise(view) if self.revisable else []
        st, exp = view.settings, view.expected_ns
        # a silence as long as one the job just came out of is no hang: a job that slowed
        # down (a link degraded under a call of many megabytes) is silent that long every
        # step, while its usual step time is still its old one
        pace = self.silence_lately(
            self.hb_now_ns if self.hb_latest else max(view.coll_now_ns, now_ns)
        )
        world = view.topo.job.world_size
        limit = max(st.hang_factor * max(exp, pace), st.min_hang_ms * 1e6)
        if final and not ended:
            ended = "the recording ended there"
        if not final and self.hb_latest and self.ended(world, limit):
            final, ended = True, "the job's processes ended there"
        elif self.starting and self.hb_latest:
            # a start (the first, or one started again) is silent until its first collective
            # completes: its ranks load the model and data, and join at their own pace
            # (a recording that ends there ended in the start, not in a hang)
            final, limit = False, max(limit, st.start_hang_s * 1e9)
        if final:
            limit = max(exp, 0.02 * st.min_hang_ms * 1e6)
        self.final = ended
        diag: HangDiagnosis | None
        if self.hb_latest:
            silent = self.hb_now_ns - self.hb_progress_ns
            if not self.hb_progress_ns or silent <= limit:
                return []
            if self.saw_save_ns > self.hb_progress_ns:  # a rank saved a checkpoint in it:
                # the job's own pause, until a save goes on too long; once over, the job's
                # silence counts from its end (the others' heartbeats show them moving later)
                if self.saving(limit):
                    if silent <= st.save_hang_s * 1e9:
                        return []
                else:
                    silent = self.hb_now_ns - self.saw_save_ns
                    if silent <= limit:
                        return []
            fresh = sum(hb.ts_ns > self.hb_progress_ns for hb in self.hb_latest.values())
            # wait until every rank reported after the freeze, or one has not for a hang's
            # limit since the first did (heartbeats that come together, as the ranks' dumps
            # at a watchdog's timeout do, are no rank's silence)
            since = self.hb_now_ns - self.woke_ns if self.woke_ns > self.hb_progress_ns else 0
            if fresh < world and (silent <= 3 * limit or since <= limit) and not final:
                return []
            calls_ns = max(view.coll_now_ns, now_ns) - self.hb_progress_ns
            evidence = self.evidence()
            blind = evidence.blind(view.topo)
            if not final and calls_ns <= limit + st.partial_timeout_ms * 1e6 and blind:
                return []  # the calls the heartbeats do not follow may still show the start
            diag = evidence.localise(view.topo, _members(view))
            detected = self.hb_now_ns
            # the calls the heartbeats do not follow may still come (a lagging partition)
            self.revisable = blind
        else:
            now = max(view.coll_now_ns, now_ns)
            silent = now - self.last_progress_ns
            if not self.partials or not self.last_progress_ns:
                return []
            if silent <= limit and not self.outwaited(final, now):
                return []
            members, evidence = _members(view), self.evidence()
            diag = evidence.stopped(members, view.last_seen()) or diagnose_hang(
                list(self.partials.values()), list(self.stuck.ops.values()), members,
                evidence.went_past,
            )  # fmt: skip
            detected = now
        if diag is None or (diag.unwitnessed and not final and silent <= st.stall_hang_s * 1e9):
            return []  # (a transfer every member joined, slow or stuck: only time tells)
        return self._verdict(diag, silent, detected, view)

    def saving(self, within_ns: float) -> dict[int, int]:
        """The ranks whose latest heartbeat, at most ``within_ns`` old, says a checkpoint
        save is under way, and since when (a rank heard from no more is not saving)."""
        now = self.hb_now_ns - within_ns
        return {r: hb.saving_since_ns for r, hb in self.hb_latest.items()
                if hb.saving_since_ns is not None and hb.ts_ns >= now}  # fmt: skip

    def evidence(self) -> HangEvidence:
        """What the watch's records say of each rank now (:mod:`detectors.hang_evidence`)."""
        return HangEvidence(self.hb_latest, self.hb_done, self.joined, self.partials,
                            self.stuck, self.hb_progress_ns, self.hb_now_ns)  # fmt: skip

    def _revise(self, view: JobView) -> list[msgspec.Struct]:
        """A hang judged from heartbeats that do not follow every communicator: once the
        calls they do not follow show it began there (their partial instances came after
        the verdict, e.g. from a partition read later), it is blamed where it began (one
        incident, revised)."""
        if not self.partials:
            return []
        diag = self.evidence().unfollowed(_members(view))
        if diag is None:
            return []
        self.revisable = False
        return self._verdict(diag, self.hb_now_ns - self.hb_progress_ns, self.detected_ns, view)

    def _verdict(
        self, diag: HangDiagnosis, silent: int, detected: int, view: JobView
    ) -> list[msgspec.Struct]:
        evidence = self.evidence()
        out, culprit = report_hang(
            diag,
            silent=silent,
            detected=detected,
            view=view,
            partial_of=evidence.partial,
            oldest_open=evidence.oldest_open,
            progress_ns=self.hb_progress_ns or self.last_progress_ns,
            reported=self.open,
            ended=self.final,
            saving=self.saving(silent) if self.hb_latest else {},
        )
        self.open = culprit
        self.detected_ns = detected
        return out


def _members(view: JobView) -> dict[int, tuple[int, ...]]:
    """Each communicator's member ranks (built when a hang is judged: thousands of
    communicators, and the watch is ticked every poll)."""
    return {h: tuple(c.ranks) for h, c in view.topo.comms.items()}


__all__ = ["HangWatch", "JobView"]
