"""A job saving a checkpoint pauses itself: its writers are out of the collectives and
their peers wait for them at the next one (PyTorch's DDP tutorial and Megatron have
everyone wait at a barrier). Where the heartbeats say who is saving, that is neither a
hang (until a save goes on too long) nor a straggler, and it sets no pace."""

from __future__ import annotations

import msgspec

from detectors.saves import Saves
from detectors.topology import Topology
from detectors.verdicts import VerdictBook
from detectors.watchdog import HangWatch, JobView
from schemas.config import DetectSettings
from schemas.enums import CommRole
from schemas.records import CommInfo, CommProgress, Heartbeat, JobInfo

S = 10**9
WORLD = 30


def beat(rank: int, t: float, issued: int, done: int, saved: float, since: float | None):
    return Heartbeat(
        job="j", node=f"n{rank}", rank=rank, ts_ns=int(t * S),
        comms=[CommProgress(comm_hash=WORLD, issued_seq=issued, completed_seq=done)],
        save_ns=int(saved * S), saving_since_ns=None if since is None else int(since * S),
    )  # fmt: skip


def _job(save_hang_s: float = 5.0) -> tuple[HangWatch, JobView]:
    topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=3, dp=3))
    topo.add(CommInfo(job="j", ts_ns=0, comm_hash=WORLD, role=CommRole.DP, ranks=[0, 1, 2]))
    view = JobView(topo, VerdictBook("j"), expected_ns=0.1 * S, coll_now_ns=0,
                   place=lambda *_: None,
                   settings=DetectSettings(save_hang_s=save_hang_s))  # fmt: skip
    return HangWatch(), view


def _run(
    watch: HangWatch,
    view: JobView,
    until: float,
    save: tuple[float, float] | None,
    stop_at: float | None = None,
    dead: tuple[int, float] | None = None,
    told: bool = True,
) -> list:
    """Steps of 0.1 s (a barrier each) to ``until``; rank 0 saves over ``save`` (start, end)
    while the others wait in the barrier; from ``stop_at`` rank 2 never issues its next
    call (a real hang); ``dead``: a rank that stops beating from then. Heartbeats every
    0.1 s, with the saves (``told``) or without, and one from rank 0 as its save ends,
    before the others' show the job moving again. The verdicts told."""
    out, seq, t, saved = [], 0, 0.0, 0.0
    while t < until - 1e-9:
        t = round(t + 0.1, 3)
        if save is not None and t - 0.1 < save[1] <= t and told:  # it joins the barrier
            end = save[1] + 0.001
            watch.heartbeat(beat(0, end, seq + 1, seq, save[1] - save[0], None), view.book)
            out += watch.tick(int(end * S), view)
        saving = save is not None and save[0] < t < save[1]
        stuck = stop_at is not None and t > stop_at
        if not saving and not stuck:
            seq += 1
        if save is not None:
            saved = min(max(0.0, t - save[0]), save[1] - save[0])
        for r in (0, 1, 2):
            if dead is not None and r == dead[0] and t > dead[1]:
                continue
            if saving:
                issued = seq if r == 0 else seq + 1  # rank 0 is saving, not in the call
            elif stuck:
                issued = seq if r == 2 else seq + 1
            else:
                issued = seq
            since = save[0] if saving and r == 0 else None
            hb = beat(r, t, issued, seq, saved if r == 0 else 0.0, since)
            if not told:
                hb = msgspec.structs.replace(hb, save_ns=None, saving_since_ns=None)
            watch.heartbeat(hb, view.book)
        out += watch.tick(int(t * S), view)
    return out


def _hangs(told: list) -> list:
    return [v for v in told if v.kind.value == "hang" and v.status.value == "open"]


def test_a_rank_saving_a_checkpoint_is_no_hang_while_its_save_is_short_of_the_limit() -> None:
    """Rank 0 saves for 3 s, thirty of the job's steps; the others wait in the barrier:
    no hang. Where the heartbeats do not say who saves, it is one (rank 0's)."""
    watch, view = _job()
    assert _hangs(_run(watch, view, 6.0, (2.0, 4.95))) == []
    watch, view = _job()
    (hang,) = _hangs(_run(watch, view, 6.0, (2.0, 4.95), told=False))
    assert hang.rank == 0


def test_a_save_that_goes_on_past_the_limit_is_a_hang_that_says_so() -> None:
    watch, view = _job(save_hang_s=5.0)
    (hang,) = _hangs(_run(watch, view, 9.0, (2.0, 60.0)))
    assert hang.rank == 0
    assert 5.0 < (hang.detected_ns / S) - 2.0 < 5.5
    assert "saving a checkpoint for 5 s" in hang.summary
    assert hang.evidence["saving_ns"] > 5 * S


def test_a_hang_after_a_long_save_is_told_as_soon_as_one_before_it() -> None:
    """A 3-s save is the job's own pause, not its pace: a rank that stops a little later
    is told a hang within the usual limit (0.5 s at least), not after 6 s."""
    watch, view = _job()
    (hang,) = _hangs(_run(watch, view, 9.0, (2.0, 5.0), stop_at=6.0))
    assert hang.rank == 2
    assert (hang.detected_ns / S) - 6.0 < 1.0


def test_a_rank_that_dies_while_saving_is_a_hang_within_the_usual_limit() -> None:
    """Its last heartbeat said it was saving; heard from no more, it is not."""
    watch, view = _job(save_hang_s=600.0)
    (hang,) = _hangs(_run(watch, view, 6.0, (2.0, 60.0), dead=(0, 2.3)))
    assert hang.rank == 0
    assert (hang.detected_ns / S) - 2.3 < 2.5


def test_what_a_rank_saved_around_a_window_counts_the_spans_its_heartbeats_bound() -> None:
    saves, before = Saves(), (0, 0)
    for t, n, since in ((1, 0.2, 0.8), (2, 1.1, None), (3, 1.1, None)):
        saves.update(4, int(t * S), int(n * S), None if since is None else int(since * S),
                     before)  # fmt: skip
        before = (int(t * S), int(n * S))
    assert saves.saved(4, int(1.5 * S), int(1.6 * S)) == int(0.9 * S)
    assert saves.saved(4, int(0.5 * S), int(2.5 * S)) == int(1.1 * S)
    assert saves.saved(4, int(2.1 * S), int(3 * S)) == 0
    saves.update(4, int(4 * S), int(1.3 * S), int(3.8 * S), before)  # one under way
    assert saves.saved(4, int(4.5 * S), int(5 * S)) == int(0.5 * S)
    assert saves.most(int(4.5 * S), int(5 * S)) == int(0.5 * S)
    # the job started again: its new process counts from 0
    saves.update(4, int(9 * S), int(0.4 * S), None, (int(8 * S), int(1.5 * S)))
    assert saves.saved(4, int(8.5 * S), int(8.6 * S)) == int(0.4 * S)
