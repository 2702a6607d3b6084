"""How long a hang's silence must be, from what the job showed: its pace (the longest
silence it came out of lately: a job slowed down is silent that long every step), the end
of its processes (their last heartbeats said so), and, where a recording ended with no
silence to time, how long the call it ended in had stayed open against how long its
communicator's calls ever did. A part of :class:`~detectors.watchdog.HangWatch`, which
holds the state below.
"""

from __future__ import annotations

from detectors.align import Instance, Key
from schemas.records import Heartbeat

#: how long the job's pace (a silence it came out of) holds unless another about as long
#: renews it: this many times its length
SILENCES_KEPT = 4
#: a call a recording ended in, open this many times as long as its communicator's calls
#: ever were, is where the job stopped (see HangPace.outwaited)
OUTWAITED = 2


class HangPace:
    """The hang watch's yardsticks of silence (see the module docstring)."""

    hb_now_ns: int
    hb_latest: dict[int, Heartbeat]
    exited: dict[int, int]
    partials: dict[Key, Instance]
    open_times: dict[int, int]
    #: the job's pace: a silence it came out of, until when it counts, when it began
    silence: tuple[int, int, int]

    def _came_out(self, since_ns: int, gap_ns: int, at_ns: int) -> None:
        """The job, silent since ``since_ns`` for ``gap_ns`` at least, was seen moving at
        ``at_ns``. Its pace is the longest such silence lately: one at least half as long
        as the pace kept renews it for ``SILENCES_KEPT`` times its length (a job slowed
        down comes out of silences about as long, step after step, and each is seen a
        heartbeat apart or less); shorter ones leave it to lapse. Each rank's heartbeats
        see the end of one silence at their own time: the longest account counts."""
        kept, until, began = self.silence
        if at_ns > until:
            kept = 0
        if since_ns != began and 2 * gap_ns < kept:
            return
        pace = max(kept, gap_ns)
        self.silence = (pace, at_ns + SILENCES_KEPT * pace, since_ns)

    def silence_lately(self, now_ns: int) -> int:
        """The job's present pace between progress (0: none, or it lapsed; see
        :meth:`_came_out`). A hang's silence must exceed it, as it must the usual step
        time."""
        gap, until, _ = self.silence
        return gap if now_ns <= until else 0

    def ended(self, world: int, silent_ns: float) -> bool:
        """Whether the job's processes ended: some said their last heartbeat was their last
        (failed because a peer was gone, or done), and every other rank has been silent
        for ``silent_ns`` (a rank killed outright says nothing; one alive beats)."""
        exited = self.exited
        if not exited:
            return False
        before = self.hb_now_ns - silent_ns
        latest = self.hb_latest
        return all(
            r in exited or (hb := latest.get(r)) is None or hb.ts_ns < before for r in range(world)
        )

    def outwaited(self, final: bool, end_ns: int) -> bool:
        """Whether a recording with no heartbeats (nothing to time a silence by once the
        calls stop) ended (``final``, at ``end_ns``: its newest call) in a call some ranks
        posted that had stayed open by then ``OUTWAITED`` times as long as any call of its
        communicator did before it completed: the job stopped there, though its other
        ranks went on for a while (a pipeline's other stages, to the step's end), and the
        recording ended before a step's silence (a recording cut while the job ran ends in
        calls their ranks still join at their usual pace). With heartbeats, their silence
        after the calls is the measure."""
        if not final:
            return False
        times = self.open_times
        return any(
            (usual := times.get(p.comm_hash, 0)) > 0 and end_ns - min(p.arrival) > OUTWAITED * usual
            for p in self.partials.values()
        )


__all__ = ["OUTWAITED", "SILENCES_KEPT", "HangPace"]
