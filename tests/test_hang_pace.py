"""Hangs against what the job does: the call it is stuck in, and its present pace (a job
whose link degraded under a large call is silent in it every step, and moves on)."""

from __future__ import annotations

from detectors.hang_heartbeats import diagnose_from_heartbeats
from detectors.topology import Topology
from detectors.verdicts import VerdictBook
from detectors.watchdog import HangWatch, JobView
from schemas.config import DetectSettings
from schemas.enums import Cause, CommRole
from schemas.records import CommInfo, CommProgress, Heartbeat, JobInfo

S = 10**9
EXPERTS, SYNC = 10, 20  # an expert-parallel pair (0, 1), and a gradient sync (0, 2)
MEMBERS = {EXPERTS: (0, 1), SYNC: (0, 2)}


def beat(rank: int, t: float, calls: dict[int, tuple[int, int]]) -> Heartbeat:
    """Rank ``rank``'s heartbeat at ``t`` s: communicator -> (issued, completed)."""
    return Heartbeat(job="j", node=f"n{rank // 2}", rank=rank, ts_ns=int(t * S), comms=[
        CommProgress(comm_hash=c, issued_seq=i, completed_seq=d) for c, (i, d) in calls.items()
    ])  # fmt: skip


def _sync_beats(rank0: tuple[int, int], rank2: tuple[int, int]) -> dict[int, Heartbeat]:
    """Latest heartbeats: ranks 0 and 2's gradient sync (issued, completed) as given; rank 0
    and its expert-parallel peer 1 completed every call of theirs (111)."""
    return {
        0: beat(0, 1, {EXPERTS: (111, 111), SYNC: rank0}),
        1: beat(1, 1, {EXPERTS: (111, 111)}),
        2: beat(2, 1, {SYNC: rank2}),
    }


def test_the_call_every_member_waits_in_is_named_not_one_they_all_completed() -> None:
    """Ranks 0 and 2 both wait in their gradient sync (issued 13, completed 12); rank 0
    and its expert-parallel peer completed every call of theirs (111). Rank 0 waiting
    elsewhere leaves nothing of the experts' stuck: the sync is where the job stands."""
    diag = diagnose_from_heartbeats(_sync_beats((13, 12), (13, 12)), MEMBERS, [])
    assert diag is not None
    assert (diag.cause, diag.comm_hash, diag.seq) == (Cause.NETWORK_LINK, SYNC, 13)


def test_a_call_one_member_completed_and_the_others_wait_in_is_where_the_job_is_stuck() -> None:
    """Rank 0's share of the gradient sync 13 came before the link went: it completed it
    and waits in sync 14, which rank 2, still waiting in 13, never reached. No one is
    missing from 13 (both issued it): the job is stuck in that transfer, rank 2 in it."""
    diag = diagnose_from_heartbeats(_sync_beats((14, 13), (13, 12)), MEMBERS, [])
    assert diag is not None
    assert (diag.cause, diag.comm_hash, diag.seq, diag.culprit_rank, diag.waiting) == (
        Cause.NETWORK_LINK, SYNC, 13, None, (2,)
    )  # fmt: skip


def test_a_member_that_never_issued_the_call_its_peer_waits_in_is_named() -> None:
    """The same, but rank 2 completed sync 12 and issued nothing since: it never joined
    13, which rank 0 waits in (the collective after it is not reached by anyone)."""
    diag = diagnose_from_heartbeats(_sync_beats((13, 12), (12, 12)), MEMBERS, [])
    assert diag is not None
    assert (diag.cause, diag.culprit_rank, diag.seq) == (Cause.COMPUTE, 2, 13)


def _watch(stall_hang_s: float = DetectSettings().stall_hang_s) -> tuple[HangWatch, JobView]:
    topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=3, dp=3))
    for comm, ranks in MEMBERS.items():
        topo.add(CommInfo(job="j", ts_ns=0, comm_hash=comm, role=CommRole.OTHER,
                          ranks=list(ranks)))  # fmt: skip
    view = JobView(topo, VerdictBook("j"), expected_ns=0.1 * S, coll_now_ns=0,
                   place=lambda *_: None,
                   settings=DetectSettings(stall_hang_s=stall_hang_s))  # fmt: skip
    return HangWatch(), view


def _steps(watch: HangWatch, view: JobView, until: float, silent: list[tuple[float, float]]):
    """Ranks 0 and 2 complete a sync every 0.1 s up to ``until``, except in the ``silent``
    spans (start, end), in which both wait in it; rank 1 beats, done with its calls. The
    verdicts told."""
    out, seq, t = [], 0, 0.0
    while t < until:
        t = round(t + 0.1, 3)
        waiting = any(a < t < b for a, b in silent)
        if not waiting:
            seq += 1
        calls = {SYNC: (seq + 1, seq) if waiting else (seq, seq)}
        for r in (0, 2):
            watch.heartbeat(beat(r, t, calls), view.book)
        watch.heartbeat(beat(1, t, {EXPERTS: (111, 111)}), view.book)
        out += watch.tick(int(t * S), view)
    return out


def test_a_transfer_every_member_joined_is_slow_before_it_is_hung() -> None:
    """Steps of 0.1 s, then syncs of 0.85 to 1.9 s (a link degraded under them), both
    ranks in each and no proxy operation to say whether its transfer moves: slow
    transfers, no hang. The same job stopped for good in a sync is hung, told once it
    was silent ``stall_hang_s`` (5 s)."""
    watch, view = _watch()
    lengths = (1.5, 1.5, 0.85, 1.9, 1.5)
    silences = [(2.0 + 2.5 * k, 2.0 + 2.5 * k + n) for k, n in enumerate(lengths)]
    assert not [v for v in _steps(watch, view, 14.0, silences) if v.kind.value == "hang"]
    watch, view = _watch()
    told = _steps(watch, view, 12.0, [(2.0, 3.5), (4.0, 99.0)])
    (hang,) = [v for v in told if v.kind.value == "hang"]
    assert hang.cause == Cause.NETWORK_LINK
    assert 5.0 <= hang.detected_ns / S - 4.0 <= 5.3


def test_a_job_silent_as_long_as_it_just_was_every_step_is_not_hung() -> None:
    """The job's pace, where a stall is a hang as soon as any silence is (a stall floor
    at the hang's, 0.5 s): steps of 0.1 s, then a sync that takes 1.5 s, then one
    every 2.5 s, of 0.85 to 1.9 s. The first silence is three times the floor of a
    hang, and five times the usual step, with nothing yet to say otherwise: a hang,
    over when the job moves. The next ones are the job's new pace: no hang, nor where
    one shorter than half the others is followed by the longest."""
    watch, view = _watch(stall_hang_s=0.5)
    lengths = (1.5, 1.5, 0.85, 1.9, 1.5)
    silences = [(2.0 + 2.5 * k, 2.0 + 2.5 * k + n) for k, n in enumerate(lengths)]
    told = _steps(watch, view, 14.0, silences)
    hangs = [v for v in told if v.kind.value == "hang" and v.status.value == "open"]
    assert [round(v.detected_ns / S, 1) for v in hangs] == [2.6]


def test_a_job_that_stops_after_a_slow_step_is_hung_all_the_same() -> None:
    """The same job (and stall floor), stopped for good after its first slow sync: a
    hang, told later than the floor would (the job just came out of a long silence),
    and no later than twice that silence."""
    watch, view = _watch(stall_hang_s=0.5)
    told = _steps(watch, view, 12.0, [(2.0, 3.5), (4.0, 99.0)])
    hangs = [v for v in told if v.kind.value == "hang" and v.status.value == "open"]
    assert len(hangs) == 2  # the slow sync, then the stop
    assert 1.0 <= hangs[1].detected_ns / S - 4.0 <= 2 * 1.6


def test_a_job_that_claims_no_layout_has_no_pipeline_stage_in_its_hang() -> None:
    """A job record that claims no layout (one rank each way, as the collector declares
    for a job told none): rank 2 never joins a sync rank 0 waits in. The hang names rank
    2, and no pipeline stage (its rank is not a stage of a pipeline the job has none of)."""
    topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=3, tp=1, pp=1, dp=1))
    topo.add(CommInfo(job="j", ts_ns=0, comm_hash=SYNC, role=CommRole.OTHER, ranks=[0, 2]))
    view = JobView(topo, VerdictBook("j"), expected_ns=0.1 * S, coll_now_ns=0,
                   place=lambda *_: None)  # fmt: skip
    watch, told = HangWatch(), []
    for k in range(1, 31):
        t = k / 10
        mine = {SYNC: (k, k) if t <= 1 else (11, 10)}  # rank 0 waits in seq 11 from 1.1 s
        theirs = {SYNC: (min(k, 10), min(k, 10))}  # rank 2 never issues it
        watch.heartbeat(beat(0, t, mine), view.book)
        watch.heartbeat(beat(2, t, theirs), view.book)
        watch.heartbeat(beat(1, t, {EXPERTS: (5, 5)}), view.book)
        told += watch.tick(int(t * S), view)
    (hang,) = [v for v in told if v.kind.value == "hang"]
    assert (hang.rank, hang.pp_stage) == (2, None)
    assert "PP stage" not in hang.summary
