"""Steps assembled from communicators' calls: folding per communicator, step rows and their
accounts, lateness, transfers paired, step cycles, and steps that wait for every
communicator (records arriving out of order or early: ``test_detector_arrivals.py``)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from detectors.align import Instance
from detectors.replay import Replay
from producers.sim.scenarios import build
from schemas.config import DetectSettings
from schemas.enums import Cause, CollOp, VerdictKind
from schemas.results import StepSummary, Verdict
from tests.helpers import instance as _inst


def test_step_rows_say_whether_every_instance_came() -> None:
    """A step closed without some of its instances (here the hang's) says so in its row;
    the steps before it hold every instance a step has."""
    run = build("missing-recv", scale="tiny", seed=0, steps=20)
    steps = [s for s in Replay().run(run.records()) if isinstance(s, StepSummary)]
    hung = run.faults[0].onset_step
    assert steps[-1].step == hung
    expected = {s.expected_instances for s in steps}
    assert len(expected) == 1 and expected.pop() > 0
    assert all(s.instances == s.expected_instances for s in steps if s.step < hung)
    assert 0 < steps[-1].instances < steps[-1].expected_instances
    assert [s.step for s in steps if s.left_out] == [hung]
    assert all(s.late_instances == 0 for s in steps)


def test_step_rows_count_the_instances_that_came_after_their_step_closed() -> None:
    from detectors.align import CollectiveAligner
    from schemas.enums import CommRole
    from schemas.records import Collective, CommInfo

    recs = list(build("healthy", scale="tiny", seed=0, steps=12).records(emit_kernels=False))
    dp = next(r for r in recs if isinstance(r, CommInfo) and r.role is CommRole.DP)
    members = [
        r for r in recs if isinstance(r, Collective) and r.comm_hash == dp.comm_hash and r.seq == 0
    ]
    aligner = CollectiveAligner()
    (step0,) = [inst for r in members for inst in aligner.update(r)]  # an instance of step 0
    half = len(recs) // 2
    replay = Replay()
    before = [s for r in recs[:half] for s in replay.update(r) if isinstance(s, StepSummary)]
    assert before and min(s.step for s in before) == 0  # step 0 is closed
    (job,) = replay.jobs.values()
    job.update(step0)  # it comes again, after its step closed: in no step's figures
    after = [s for r in recs[half:] for s in replay.update(r) if isinstance(s, StepSummary)]
    after += [s for s in replay.finish() if isinstance(s, StepSummary)]
    assert [s.late_instances for s in before] == [0] * len(before)
    assert after and [s.late_instances for s in after] == [1] * len(after)
    assert all(s.instances == s.expected_instances for s in before + after)


def test_folding_per_communicator_changes_nothing_the_job_concludes() -> None:
    """The flow folds instances per communicator (StepFolder); feeding the job every
    instance instead must give the same tables and verdicts, record for record."""
    from detectors.align import CollectiveAligner
    from detectors.job import JobAnalyzer
    from schemas.codec import encode
    from schemas.records import Collective
    from schemas.results import AlignStats

    run = build("story", scale="demo", seed=1, steps=40, kernels=False)
    records = list(run.records())
    out = list(Replay().run(records))
    folded = sorted(encode(r) for r in out if not isinstance(r, AlignStats))
    job = JobAnalyzer(run.spec.job)
    aligners: dict[int, CollectiveAligner] = {}
    plain: list = []
    now = next_tick = 0

    told: set = set()  # instances given to the job as partial

    def tick() -> None:  # Replay's watchdog cadence
        nonlocal plain
        for al in aligners.values():
            for inst in al.expire(now):
                told.add(inst.key)
                plain += job.update(inst)
        plain += job.tick(now)

    for rec in records:
        if isinstance(rec, Collective):
            al = aligners.setdefault(rec.comm_hash, CollectiveAligner())
            for inst in al.update(rec):
                plain += job.update(inst)
        else:
            plain += job.update(rec)
        now = max(now, job.now_ns)
        if now >= next_tick:
            tick()
            next_tick = now + Replay().tick_ns
    tick()
    for al in aligners.values():  # the end of the input: open instances as they stand
        for inst in al.open_instances():
            if inst.key not in told:
                plain += job.update(inst)
    plain += job.finish()
    # proxy windows (EdgeThroughput) are made per communicator only: without them the job
    # has no SendGPUWait evidence, the one thing the plain path cannot know (nor has it
    # the communicators' accounts, AlignStats)
    assert sorted(encode(r) for r in plain) == [_without_gpu_wait(x) for x in folded]
    assert any(isinstance(r, Verdict) for r in plain)
    # the flow merges the parts per shard of the communicators: any number of shards
    one_shard = Replay(DetectSettings(part_shards=1)).run(records)
    assert sorted(encode(r) for r in one_shard) == sorted(map(encode, out))


def _without_gpu_wait(raw: bytes) -> bytes:
    from schemas.codec import decode, encode

    rec = decode(raw)
    if not isinstance(rec, Verdict):
        return raw
    ev = {k: v for k, v in rec.evidence.items() if not k.startswith("send_gpu_wait")}
    confirmed = rec.kind == VerdictKind.SLOWDOWN and len(ev) < len(rec.evidence)
    conf = 0.9 if confirmed and rec.confidence == 0.95 else rec.confidence
    return encode(msgspec.structs.replace(rec, evidence=ev, confidence=conf))


@pytest.mark.parametrize(
    "shape",
    [{"ep": 2}, {"cp": 2}, {"heartbeat_p2p": False}, {"pp_group_comm": True}],
    ids=["ep2", "cp2", "collective-heartbeats", "pp-group-comm"],
)
@pytest.mark.parametrize(
    ("scenario", "kind"),
    [
        ("missing-recv", VerdictKind.HANG),
        ("network-hang", VerdictKind.HANG),
        ("mixed", VerdictKind.SLOWDOWN),
        ("healthy", None),
    ],
)
def test_other_job_and_source_shapes_are_analysed_like_any_other(
    scenario: str, kind: VerdictKind | None, shape: dict[str, int]
) -> None:
    """With MoE AllToAll on expert-parallel communicators, keys and values gathered on
    context-parallel ones every layer, heartbeats that count collectives only (NCCL's
    profiler plugin: transfers' sequence numbers run per peer), or pipeline transfers
    batched over the pipeline group's communicator (a rank sends both ways on one
    communicator), steps still close complete, every instance has its own row, and the
    culprit is still the injected one (not a rank held up by it)."""
    from schemas.results import AlignedCollective

    run = build(scenario, scale="demo", seed=1, steps=30, **shape)
    replay = Replay()
    out = list(replay.run(run.records()))
    verdicts = [v for v in out if isinstance(v, Verdict)]
    (job,) = replay.jobs.values()
    hung_at = min(
        (lab.onset_step for lab in run.labels if lab.kind == VerdictKind.HANG), default=99
    )
    assert all(r.complete for r in job.recent if r.step < hung_at)
    assert job.assembler is not None and job.assembler.late_instances == 0
    # every communicator folds its own instances: the job gets parts, not instances
    assert all(comm.folder.clock.per_step() > 0 for comm in replay.comms.values())
    rows = [
        (r.comm_hash, r.seq, r.sender, r.receiver) for r in out if isinstance(r, AlignedCollective)
    ]
    assert len(set(rows)) == len(rows)  # the table's key: no row replaces another
    if kind is None:
        assert verdicts == []
        return
    (label,) = [lab for lab in run.labels if lab.kind == kind]
    mine = [v for v in verdicts if v.kind == kind][:1]
    assert [(v.rank, v.link) for v in mine] == [(label.rank, label.link)]
    if label.phase is not None and label.cause == Cause.COMPUTE:  # where it stopped
        assert [(v.phase, v.microbatch) for v in mine] == [(label.phase, label.microbatch)]


def test_a_sealed_step_part_refuses_more_instances() -> None:
    """A communicator seals its part of a step when it sends it; folding into it later
    would change what the job already merged, so it is an error that says so."""
    from detectors.parts import StepPart
    from detectors.topology import Topology
    from schemas.enums import CommRole

    run = build("healthy", scale="tiny", seed=0, steps=2, kernels=False)
    topo = Topology.from_job(run.spec.job_info())
    part = StepPart(0)
    part.fold(_inst(2, 0, (3,), (10,), (20,), size=1), "dp_sync", None, CommRole.DP, topo)
    part.seal()
    assert part.sealed is not None and part.sealed[0].tolist() == [3]
    inst = Instance("j", 1, 0, CollOp.ALL_REDUCE, 0, 2, 8, (0, 1), (0, 0), (1, 2), (3, 4))
    with pytest.raises(ValueError, match="sealed"):
        part.fold(inst, "forward", 0, CommRole.TP, topo)
    assert part.n == 1  # the refused instance is not counted


def test_lateness_is_exact_at_real_clock_readings() -> None:
    """Arrivals are nanoseconds since 1970 (~1.8e18), where a float's step is 256 ns: the
    wait-time model must measure a 1,000 ns spread as +-500 ns, not in 256 ns steps."""
    from detectors.parts import StepPart
    from detectors.rank_figures import dense_ranks
    from detectors.topology import Topology
    from schemas.enums import CommRole

    topo = Topology.from_job(build("healthy", scale="tiny", seed=0, steps=1).spec.job_info())
    t = 1_800_000_000_123_456_789
    part = StepPart(0)
    for seq in range(3):  # rank 1 is 1,000 ns late every time
        a = t + seq * 10**6
        part.fold(
            Instance("j", 1, seq, CollOp.ALL_REDUCE, -1, 2, 8, (0, 1), (a, a), (a, a + 1000),
                     (a + 5000, a + 5000)),
            "forward", 0, CommRole.TP, topo,
        )  # fmt: skip
    ranks = dense_ranks([part.seal()], 2)
    assert ranks["lateness"].tolist() == [-1500.0, 1500.0]
    assert ranks["blame"].tolist() == [0.0, 3000.0]
    assert ranks["wait"].tolist() == [3000.0, 0.0]


def test_a_stage_waiting_for_its_input_waits() -> None:
    """A pipeline transfer's receiver that posted its Recv 4 ms before the sender's Send
    waited those 4 ms for the stage before it, as a member of a collective waits for the
    last to arrive: who made the others wait counts it (its waits hold up nobody)."""
    from detectors.parts import StepPart
    from detectors.rank_figures import dense_ranks
    from detectors.topology import Topology
    from schemas.enums import CommRole

    topo = Topology.from_job(build("healthy", scale="tiny", seed=0, steps=1).spec.job_info())
    part = StepPart(0)
    t = 10**18
    # rank 0 sends to rank 2: its Send comes at t + 4 ms, rank 2's Recv at t
    part.fold(Instance("j", 7, 0, CollOp.SEND, 0, 2, 8, (0, 2), (t + 4_000_000, t),
                       (t + 4_000_000, t), (t + 5_000_000, t + 5_000_000)),
              "forward", 0, CommRole.PP, topo)  # fmt: skip
    ranks = dense_ranks([part.seal()], 3)
    assert ranks["wait"].tolist() == [0.0, 0.0, 4_000_000.0]
    assert ranks["blame_any"].tolist() == [0.0, 0.0, 0.0]


def test_a_communicator_that_goes_quiet_holds_merged_parts_back_two_steps_at_most() -> None:
    """A job restarted with new communicators leaves the old ones silent for good:
    the merger stops waiting for them instead of delaying every later step."""
    from detectors.merge import PartMerger
    from detectors.parts import StepPart

    def part(step: int, comm: int) -> StepPart:
        return StepPart(step, comm_hash=comm, n=1, start=step).seal()

    m = PartMerger(give_up_steps=2)
    assert [p.step for p in m.update(part(0, 1)) + m.update(part(0, 2))] == [0, 0]
    sent = {}
    for step in range(1, 7):  # communicator 2 never sends again
        sent |= {p.step: (step, p.comms) for p in m.update(part(step, 1))}
    # steps 1 and 2 waited for it until step 3; then it is no longer waited for
    assert sent == {1: (3, (1,)), 2: (3, (1,)), 3: (3, (1,)), 4: (4, (1,)), 5: (5, (1,)),
                    6: (6, (1,))}  # fmt: skip
    late = m.update(part(1, 2))  # what comes after all is sent on
    assert [(p.step, p.comms) for p in late] == [(1, (2,))]


def test_a_rank_sending_both_ways_on_one_communicator_makes_two_transfers() -> None:
    """A pipeline group's communicator (batched sends) carries a middle stage's
    activations down and gradients up with per-peer sequence numbers: both are seq 0,
    and each meets its own receiver's Recv."""
    from detectors.align import CollectiveAligner
    from schemas.enums import DType
    from schemas.records import Collective

    def call(rank: int, op: CollOp, peer: int, t: int) -> Collective:
        return Collective(job="j", node="n", rank=rank, comm_hash=9, comm_size=3,
                          rank_in_comm=rank, op=op, seq=0, count=1, size_bytes=2,
                          dtype=DType.BFLOAT16, enqueue_ns=t, start_ns=t, end_ns=t + 50,
                          peer=peer)  # fmt: skip

    al = CollectiveAligner()
    done = al.update_many(
        [
            call(1, CollOp.SEND, 2, 100),  # activations to stage 2
            call(1, CollOp.SEND, 0, 110),  # gradients to stage 0
            call(0, CollOp.RECV, 1, 120),
            call(2, CollOp.RECV, 1, 130),
        ]
    )
    assert sorted((i.sender, i.receiver, i.ranks) for i in done) == [
        (1, 0, (0, 1)),
        (1, 2, (1, 2)),
    ]
    assert (al.late, al.out_of_order, al.n_open) == (0, 0, 0)


def test_a_send_that_names_no_peer_still_meets_its_recv_on_a_pair() -> None:
    """A source may leave a Send's peer out (the schema allows it): on a pair's
    communicator the sender implies the receiver, and the Recv names the sender."""
    from detectors.align import CollectiveAligner
    from schemas.enums import DType
    from schemas.records import Collective

    def call(rank: int, op: CollOp, peer: int | None) -> Collective:
        return Collective(job="j", node="n", rank=rank, comm_hash=9, comm_size=2,
                          rank_in_comm=rank, op=op, seq=4, count=1, size_bytes=2,
                          dtype=DType.BFLOAT16, enqueue_ns=100, start_ns=100, end_ns=150,
                          peer=peer)  # fmt: skip

    al = CollectiveAligner()
    (inst,) = al.update_many([call(0, CollOp.SEND, None), call(1, CollOp.RECV, 0)])
    assert (inst.sender, inst.ranks, al.n_open) == (0, (0, 1), 0)


def test_a_groups_step_figures_equal_the_general_computation_bit_for_bit() -> None:
    """Parts whose instances all have the same members (nearly every part: a TP or DP
    group's, a pipeline pair's) take a shorter computation of their per-rank figures;
    it must give exactly what the general one gives, ties and rounding included."""
    from detectors.rank_figures import _any_figures, _member_figures

    rng = np.random.default_rng(7)
    for _ in range(400):
        k = int(rng.choice([1, 2, 3, 4, 8]))
        n = int(rng.choice([1, 2, 5, 32, 256]))
        who = np.sort(rng.choice(64, size=k, replace=False))
        arr = 10**18 + rng.integers(0, 10**9, size=(n, k))
        late = rng.random((n, k)) < 0.2
        arr = arr + late * rng.integers(0, 10**7, size=(n, k))
        if rng.random() < 0.3:  # ties for the last arrival
            arr[:, -1] = arr[:, 0]
        enq = arr - rng.integers(0, 10**6, size=(n, k))
        end = arr.max(axis=1, keepdims=True) + rng.integers(0, 10**6, size=(n, k))
        flags = rng.choice([0, 2, 4, 6], size=n)  # WAIT_MODEL, ANY, both
        base = int(arr.min())
        dense = _member_figures(who, arr, end, enq, flags, base)
        general = _any_figures(
            np.tile(who, n), arr.ravel(), end.ravel(), enq.ravel(), np.repeat(flags, k),
            np.full(n, k), base,
        )  # fmt: skip
        assert np.array_equal(dense, general), (k, n)


def test_a_cycle_shorter_than_the_step_is_not_numbered_by_two_of_its_repeats() -> None:
    """A pattern of calls can recur within one iteration (the same few collectives every
    layer): a cycle learned from it is shorter than the step. Two of its repeats that
    straddle a step's end agree with the markers by chance; numbered by them, every
    later instance would land in a step of its own. The markers place such a sequence,
    instance by instance, and every instance sits in its marked step."""
    from detectors.cycle import Cycle
    from detectors.step_clock import StepClock
    from schemas.enums import CommRole
    from schemas.results import CommStructure

    clock = StepClock()
    note = CommStructure(job="j", comm_hash=7, ts_ns=0, role=CommRole.TP, per_step=4,
                         clock="pauses")  # fmt: skip
    clock.adopt(note)  # a four-call pattern; a step holds twelve calls
    assert clock.cycles[(-1, -1)].cycle == Cycle(4, 0, "pauses")
    for step in range(6):  # every marker known first, as a flow may read them
        clock.mark(step, 1200 * (step + 1) - 1)

    def inst(seq: int) -> Instance:
        t = 100 * seq
        return Instance("j", 7, seq, CollOp.ALL_REDUCE, -1, 2, 8, (0, 1), (t, t), (t, t),
                        (t + 5, t + 5))  # fmt: skip

    placed = {seq: clock.step_of(inst(seq), 100 * seq, force=False) for seq in range(8, 72)}
    assert placed == {seq: seq // 12 for seq in range(8, 72)}


def test_steps_wait_for_every_communicator_until_one_goes_quiet() -> None:
    """Each step closes once every communicator sent its part. One whose parts stop (its
    newest ended long before the others' newest) is no longer waited for: the steps
    after it close on the others' parts, and it is waited for again once it comes back."""
    from detectors.parts import StepPart
    from detectors.steps import StepAssembler
    from detectors.topology import Topology
    from schemas.records import JobInfo

    asm = StepAssembler(Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=2)))
    asm.quiet_ns, asm.quiet_steps = 1_000, 0  # quiet: 1 us of event time behind

    def part(step: int, comm: int, end: int) -> list[int]:
        p = StepPart(step, comm_hash=comm, job="j", n=1, start=end - 50, end=end).seal()
        return [r.step for r in asm.add_part(p)]

    asm.expect(1), asm.expect(2)  # (their folders said parts will come)
    closed: list[int] = []
    for step in range(3):  # both, 100 ns a step
        closed += part(step, 1, 100 * step + 100)
        assert closed == list(range(step)), "a step waits for its last communicator"
        closed += part(step, 2, 100 * step + 100)
        assert closed == list(range(step + 1))
    closed_at = {}  # communicator 2 stops: the step whose part closed each step
    for step in range(3, 20):
        closed_at |= dict.fromkeys(part(step, 1, 100 * step + 100), step)
    # its last part ended at 300 ns: it is quiet once the newest end passes 1,300 ns
    assert closed_at == {**dict.fromkeys(range(3, 14), 13), **{s: s for s in range(14, 20)}}
    assert part(20, 2, 2_100) == [] and part(20, 1, 2_100) == [20], "waited for again"
    assert part(21, 1, 2_200) == [] and part(21, 2, 2_200) == [21]
