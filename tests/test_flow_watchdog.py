"""The flow's hang watchdog reads the collectives' clock, not the fastest topic's."""

from __future__ import annotations

import msgspec

from detectors.align import Instance
from detectors.replay import Replay
from flows.state import QUIET_NS, AnalyzeLogic
from producers.sim.scenarios import build
from schemas.config import DetectSettings
from schemas.enums import CollOp, CommRole, VerdictKind
from schemas.records import Heartbeat, LinkSample
from schemas.results import Verdict


def _hangs(batches: list[list[msgspec.Struct]]) -> list[Verdict]:
    return [
        v
        for batch in batches
        for v in batch
        if isinstance(v, Verdict) and v.kind == VerdictKind.HANG
    ]


def test_link_samples_read_ahead_of_the_collectives_are_not_a_hang() -> None:
    """A source without heartbeats (e.g. MEGATRACE logs): a collective is waiting on a
    rank whose record sits in a partition read later, while the link topic, read faster,
    is already 30 s ahead. That is lag, not silence; silence is the collectives showing
    nothing new while the wall clock runs on."""
    run = build("healthy", scale="tiny", seed=0, steps=12, kernels=False)
    replay = Replay()
    for rec in run.records():
        if not isinstance(rec, Heartbeat):
            replay.update(rec)
    job = replay.jobs[run.spec.job]
    assert job.recent and not job.hangs.hb_latest
    logic = AnalyzeLogic(DetectSettings(), (job, job.coll_now_ns))
    topo = job.topo
    assert topo is not None
    tp = next(c for c in topo.comms.values() if c.role == CommRole.TP)
    t = job.coll_now_ns + 1_000_000
    waiting = Instance(
        run.spec.job,
        tp.comm_hash,
        10**6,
        CollOp.ALL_REDUCE,
        -1,
        len(tp.ranks),
        1 << 20,
        (tp.ranks[0],),
        (t,),
        (t,),
        (-1,),
    )
    ahead = [
        LinkSample(
            job=run.spec.job,
            node=topo.node(0),
            rank=0,
            ts_ns=t + k * 1_000_000_000,
            window_ns=1_000_000,
            nic="mlx5_0",
            src_rank=0,
            dst_rank=1,
            throughput_gbps=400.0,
        )
        for k in range(1, 31)
    ]
    out, _ = logic.on_batch([[waiting], ahead])
    assert _hangs(out) == []
    # the collectives stay silent while the wall clock runs on: now it is a hang
    logic.clock.wall_ns -= QUIET_NS + 30_000_000_000
    out, _ = logic.on_notify()
    (hang,) = _hangs(out)
    assert (hang.comm_hash, hang.seq) == (tp.comm_hash, 10**6)
    assert hang.rank in tp.ranks and hang.rank != tp.ranks[0]  # the one that never came


def test_a_hang_judged_before_the_calls_that_show_its_start_is_revised_to_them() -> None:
    """Heartbeats that count collectives only (NCCL's profiler plugin) cannot follow a
    pipeline transfer. When the pipeline's calls come late (their partition read after
    the heartbeats' and the other calls'), the watchdog first names a rank held up
    behind the stuck transfer; once the transfer's calls show it began on the link, the
    same incident (one alert) is revised to the link."""
    from schemas.records import Collective, CommInfo

    run = build("network-hang", scale="tiny", seed=1, steps=30, heartbeat_p2p=False)
    recs = list(run.records())
    (label,) = run.labels
    pp = {r.comm_hash for r in recs if isinstance(r, CommInfo) and r.role == CommRole.PP}
    cut = max(r.arrival_ns for r in recs if isinstance(r, Collective)) - 2_000_000_000

    def late(r: msgspec.Struct) -> bool:
        return isinstance(r, Collective) and r.comm_hash in pp and r.arrival_ns >= cut

    out = list(Replay().run([*(r for r in recs if not late(r)), *filter(late, recs)]))
    hangs = [v for v in out if isinstance(v, Verdict) and v.kind == VerdictKind.HANG]
    first, last = hangs[0], hangs[-1]
    assert first.link is None and first.rank != label.rank  # judged before the calls came
    assert {v.verdict_id for v in hangs} == {first.verdict_id}
    assert (last.rank, last.link, last.revision) == (label.rank, label.link, 1)
