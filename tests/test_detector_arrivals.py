"""Records as the analysis gets them: out of order, late, unfinished, before their
communicator's schedule or their job record, iteration markers ahead of the calls; what each
communicator counted of them."""

from __future__ import annotations

import msgspec

from detectors.align import Instance
from detectors.replay import Replay
from producers.sim.scenarios import build
from schemas.enums import CollOp
from schemas.results import StepSummary, Verdict


def test_out_of_order_records_give_the_same_verdicts() -> None:
    run = build("slow-gpu", scale="tiny", seed=6)
    recs = list(run.records())
    straight = [v.verdict_id for v in Replay().run(recs) if isinstance(v, Verdict)]
    # reverse every window of 500 records (several ranks' calls, across step boundaries),
    # keeping the job metadata first as any producer sends it
    meta = [r for r in recs if type(r).__name__ in ("JobInfo", "RankInfo", "CommInfo")]
    rest = recs[len(meta) :]
    shuffled = meta + [r for i in range(0, len(rest), 500) for r in reversed(rest[i : i + 500])]
    replay = Replay()
    found = [v.verdict_id for v in replay.run(shuffled) if isinstance(v, Verdict)]
    assert straight and sorted(set(found)) == sorted(set(straight))
    analyzer = next(iter(replay.jobs.values()))
    assert analyzer.assembler.late_instances == 0  # nothing had to be dropped


def _accounts(out: list[msgspec.Struct]) -> dict[int, msgspec.Struct]:
    """Each communicator's newest AlignStats row (its cumulative account)."""
    from schemas.results import AlignStats

    return {s.comm_hash: s for s in out if isinstance(s, AlignStats)}


def test_late_out_of_order_and_unfinished_records_are_counted_per_communicator() -> None:
    """What alignment handled besides complete collectives is told per communicator,
    so an SRE sees a replaying or reordering source: the exact number of duplicates
    that came after their collective completed, of records below a sequence number
    their rank already sent, and a collective that lost one member's record: that
    member went on to later calls, so the record was lost on the way (counted as lost,
    not reported partial: it holds nobody)."""
    from schemas.records import Collective

    recs = list(build("healthy", scale="tiny", seed=0, steps=6).records())
    colls = [i for i, r in enumerate(recs) if isinstance(r, Collective)]
    comm = recs[colls[0]].comm_hash
    mine = [i for i in colls if recs[i].comm_hash == comm]
    clean = _accounts(list(Replay().run(recs)))
    assert clean[comm].records == len(mine)
    assert all(
        (s.late_records, s.out_of_order_records, s.dropped_instances, s.partial_reports)
        == (0, 0, 0, 0)
        for s in clean.values()
    )
    # two consecutive calls of one rank on the communicator, swapped
    a = mine[0]
    b = next(i for i in mine if i > a and recs[i].rank == recs[a].rank)
    bad = list(recs)
    bad[a], bad[b] = bad[b], bad[a]
    lost = mine[len(mine) // 2]  # a member's record never arrives
    dupes = [bad[i] for i in mine[:5]]  # five records again, long after they completed
    bad = [r for i, r in enumerate(bad) if i != lost] + dupes
    s = _accounts(list(Replay().run(bad)))[comm]
    assert s.records == len(mine) - 1 + 5
    assert (s.late_records, s.out_of_order_records, s.dropped_instances) == (5, 1, 0)
    assert (s.lost_instances, s.partial_reports, s.open_instances) == (1, 0, 0)


def test_a_quiet_communicators_counts_come_once_per_stats_every_ns() -> None:
    """Nothing unusual: a communicator's account is a row per ``stats_every_ns`` of event
    time and one at the end, not a row per batch."""
    from detectors.comm import CommAnalyzer
    from schemas.records import Collective

    recs = list(build("healthy", scale="tiny", seed=0, steps=6).records())
    comm_hash = next(r.comm_hash for r in recs if isinstance(r, Collective))
    mine = [r for r in recs if isinstance(r, Collective) and r.comm_hash == comm_hash]
    span = mine[-1].enqueue_ns - mine[0].enqueue_ns
    comm = CommAnalyzer(stats_every_ns=span // 4)
    rows = []
    for i in range(0, len(mine), 7):  # batches of 7 records
        comm.update(mine[i : i + 7])
        rows += comm.stats()
    rows += comm.stats(final=True)
    assert 4 <= len(rows) <= 6, len(rows)
    assert rows[-1].records == len(mine) and rows[-1].late_records == 0
    assert comm.stats(final=True) == []


def test_a_communicators_records_read_before_its_schedule_are_placed_like_the_others() -> None:
    """In the flow a communicator's schedule crosses from the metadata partition, and its
    first records may be read before it: its steps are still whole, and the job
    concludes what it does when the metadata comes first."""
    from schemas.records import Collective, CommInfo

    run = build("story", scale="tiny", seed=4, steps=30, kernels=False)
    records = list(run.records())
    late = sorted({r.comm_hash for r in records if isinstance(r, CommInfo)})[::3]
    held = [r for r in records if isinstance(r, CommInfo) and r.comm_hash in late]
    reordered, first_calls = [], 0
    for r in records:
        if r in held:
            continue
        reordered.append(r)
        if isinstance(r, Collective) and r.comm_hash in late:
            first_calls += 1
            if first_calls == 40:  # a few steps of these communicators' calls came first
                reordered += held
    assert first_calls > 40

    def outcome(recs: list) -> tuple[list, list]:
        out = list(Replay().run(recs))
        steps = [(s.step, s.instances) for s in out if isinstance(s, StepSummary)]
        verdicts = sorted(
            (v.kind.value, v.rank, v.onset_step) for v in out
            if isinstance(v, Verdict) and v.revision == 0
        )  # fmt: skip
        return steps, verdicts

    assert outcome(reordered) == outcome(records)


def test_records_of_a_job_that_never_sent_its_job_record_are_bounded_and_kept() -> None:
    """Records may overtake their job record and wait for it, up to a bound; beyond it each
    one is a dead letter that says why, never dropped without a word."""
    from detectors.job import EARLY_HELD, JobAnalyzer
    from schemas.enums import DeadLetterReason
    from schemas.records import DeadLetter, Heartbeat

    job = JobAnalyzer("j")
    out = []
    for i in range(EARLY_HELD + 3):
        out += job.update(Heartbeat(job="j", node="n", rank=0, ts_ns=i + 1))
    assert len(out) == 3 and all(isinstance(d, DeadLetter) for d in out)
    assert {d.reason for d in out} == {DeadLetterReason.NO_JOB_RECORD}
    assert out[0].ts_ns == EARLY_HELD + 1 and "no job record" in out[0].error


def test_marks_read_ahead_of_a_communicators_calls_do_not_close_its_steps_empty() -> None:
    """The job's iteration markers come on another topic than the collectives: in a live
    flow they may be read steps ahead of a communicator's calls. Its steps are done when
    its calls (or its clock, idle) went past their ends, never because later markers came:
    each step's part holds that step's instances."""
    from detectors.align import Instance
    from detectors.folder import StepFolder
    from detectors.parts import StepPart
    from detectors.schedule import CommSchedule
    from schemas.enums import CommRole
    from schemas.records import CommInfo, JobInfo

    job = JobInfo(job="j", ts_ns=0, world_size=2, dp=2)
    folder = StepFolder()
    folder.learn(CommSchedule(job, CommInfo(job="j", ts_ns=0, comm_hash=7, role=CommRole.DP,
                                            ranks=[0, 1])))  # fmt: skip
    ms = 1_000_000

    def inst(seq: int) -> Instance:  # two all-reduces a step of 100 ms
        t = 100 * ms * (seq // 2) + 10 * ms + 40 * ms * (seq % 2)
        return Instance("j", 7, seq, CollOp.ALL_REDUCE, -1, 2, 8, (0, 1), (t, t + 1),
                        (t, t + 1), (t + 5 * ms, t + 5 * ms))  # fmt: skip

    parts: list[StepPart] = []
    for step in range(6):  # every marker first, as a lagging partition would show them
        told = folder.mark(step, 100 * ms * (step + 1) - 1)[1]
        parts += [x for x in told if isinstance(x, StepPart)]
    for seq in range(12):
        parts += [x for x in folder.update(inst(seq))[1] if isinstance(x, StepPart)]
    parts += [x for x in folder.flush()[1] if isinstance(x, StepPart)]
    assert [(p.step, p.n) for p in parts] == [(s, 2) for s in range(6)]


def test_a_job_given_its_items_in_batches_concludes_what_it_does_item_by_item() -> None:
    """The flow hands the job a poll's items at once (:meth:`JobAnalyzer.update_many`, which
    takes a run of edges' throughputs together): the same results, in the same order, as
    one at a time; an edge naming a rank outside the layout is a dead letter in its turn,
    and items before the job record are held as :meth:`JobAnalyzer.update` holds them."""
    import random

    from detectors.edges import EdgeThroughput
    from detectors.job import JobAnalyzer
    from schemas.records import DeadLetter, LinkSample

    run = build("slow-link", scale="tiny", seed=1, kernels=False)
    # no link samples: the edges' throughputs are the links' measure, and find the link
    recs = [r for r in run.records() if not isinstance(r, LinkSample)]
    items: list[object] = []
    update, update_many = JobAnalyzer.update, JobAnalyzer.update_many
    inside = [False]

    def record(self: JobAnalyzer, item: object) -> list[msgspec.Struct]:
        if not inside[0]:
            items.append(item)
        return update(self, item)

    def record_many(self: JobAnalyzer, batch: list[object]) -> list[msgspec.Struct]:
        items.extend(batch)
        inside[0] = True
        try:
            return update_many(self, batch)
        finally:
            inside[0] = False

    JobAnalyzer.update, JobAnalyzer.update_many = record, record_many  # type: ignore[method-assign]
    try:  # the items a job takes, in their order
        list(Replay().run(recs))
    finally:
        JobAnalyzer.update, JobAnalyzer.update_many = update, update_many  # type: ignore[method-assign]
    edges = [i for i, x in enumerate(items) if isinstance(x, EdgeThroughput)]
    assert len(edges) > 100
    world = run.spec.world_size
    bad = items[edges[len(edges) // 2]]
    assert isinstance(bad, EdgeThroughput)
    items.insert(edges[len(edges) // 2], bad._replace(dst_rank=world + 3))
    # an edge that overtook the job record, held with the other early records
    first = next(x for x in items if isinstance(x, EdgeThroughput))
    items.insert(0, first)
    one_by_one = JobAnalyzer(run.spec.job, Replay().settings)
    expected = [o for x in items for o in one_by_one.update(x)]
    batched = JobAnalyzer(run.spec.job, Replay().settings)
    rng, got, i = random.Random(0), [], 0
    while i < len(items):
        n = rng.choice((1, 7, 300))
        got += batched.update_many(items[i : i + n])
        i += n
    got += batched.finish()
    expected += one_by_one.finish()
    assert [msgspec.json.encode(o) for o in got] == [msgspec.json.encode(o) for o in expected]
    # the senders' waits on their data, as each took its windows in order
    for rank in range(world):
        assert batched.gpu_wait.evidence(rank) == one_by_one.gpu_wait.evidence(rank)
    letters = [o for o in got if isinstance(o, DeadLetter)]
    assert len(letters) == 1 and f"rank {world + 3} is outside" in letters[0].error
    found = [o for o in got if isinstance(o, Verdict)]
    assert {(v.kind.value, v.link) for v in found} == {("link_degradation", run.labels[0].link)}
