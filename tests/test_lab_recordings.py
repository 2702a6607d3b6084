"""Verdicts on real recordings kept from `megatrace lab` runs: torch.distributed jobs
over Gloo on two network-namespace nodes, faults from the operating system, recorded
through the PyTorch collector, the node agents and the broker (see `megatrace lab`).
Each file is the records as the flow read them; its case and its truth are named in
the test."""

from __future__ import annotations

import pytest

from detectors.replay import Replay
from schemas.records import Collective, CommInfo, Iteration, JobInfo, RankInfo
from schemas.results import StepSummary, Verdict
from tests.recordings import ORDERS, last_verdicts, read_records


@pytest.mark.parametrize("order", ORDERS)
def test_a_killed_rank_is_named_although_healthy_ranks_lost_a_step_of_records(
    order: str,
) -> None:
    """Case megatron-killed: a Megatron-style 1F1B job, TP 2 x PP 2 x DP 2, rank 3
    SIGKILLed at step 8. The collectors of every rank lost their records of step 1
    (their socket to the node agent was full: 204 of 1,855 calls). Taken at face
    value, rank 1 never joined an all-reduce of step 1, and that was the verdict; its
    later calls and heartbeats show it went on. The same in whatever order the records
    come."""
    (hang,) = last_verdicts("lab_megatron_killed_rank3.jsonl.gz", order)
    assert (hang.kind.value, hang.rank, hang.onset_step) == ("hang", 3, 8)


def test_a_killed_rank_is_named_from_heartbeats_alone_not_a_peer_that_failed_after_it() -> None:
    """The same job from its heartbeats alone (the calls' topic read later, as a flow
    catching up on a backlog reads it). The peers failed in rank 3's calls and stopped
    beating within 0.2 s after it, each behind somewhere too; their last heartbeats say
    what they waited in, and rank 2 waited in the tensor-parallel call rank 3 never
    issued. Rank 3 stopped after its step 8's gradient sync (its peer completed it) and
    before its first call of step 9."""
    (hang,) = last_verdicts("lab_megatron_killed_rank3.jsonl.gz", "no-calls")
    assert (hang.kind.value, hang.rank, hang.onset_step) == ("hang", 3, 9)


@pytest.mark.parametrize("order", ORDERS)
def test_a_one_step_straggler_in_a_pipeline_is_named_with_the_time_it_cost(order: str) -> None:
    """Case megatron-transient (its first 16 steps): the same job, rank 1's CPU quota
    cut for a moment at step 9, which took 854 ms against 245 ms. In a pipeline the
    other stage waits for the slow one, so the step loses far more than rank 1's own
    lateness against its tensor-parallel peer (146 ms); no other rank's grew a third
    as much. The same in whatever order the records come."""
    transient = [v for v in last_verdicts("lab_megatron_transient_rank1.jsonl.gz", order)
                 if v.kind.value == "transient_straggler"]  # fmt: skip
    (v,) = transient
    assert (v.rank, v.onset_step, v.status.value) == (1, 9, "resolved")
    assert 0.5e9 < v.evidence["time_lost_ns"] < 0.7e9
    assert 3.2 < v.evidence["step_time_ratio"] < 3.7


def test_what_follows_a_one_step_straggler_is_priced_against_the_level_before_it() -> None:
    """The same recording: after the straggler, steps 10-12 ran 1.2x slower than before it
    (291-300 ms against 245 ms). Whatever that is called, its cost is the time it added
    to the steps before the straggler, not to a level the straggler's one step raised
    (the steps before it, with it, averaged 446 ms: nothing lost, "0%")."""
    for v in last_verdicts("lab_megatron_transient_rank1.jsonl.gz"):
        if v.kind.value == "slowdown":
            ratio = v.evidence["step_time_ratio"]
            assert v.severity >= 0.5 * (1 - 1 / ratio) > 0, v.summary


def test_a_killed_rank_is_named_when_its_peer_dies_waiting_for_it() -> None:
    """Case megatron-killed again, another run: rank 3 SIGKILLed at step 8. Its tensor-
    parallel peer, rank 2, waited in a call rank 3 never issued, failed and stopped a
    moment later; the next stage's ranks wait for rank 2's pipeline Send, opened
    earlier than anything else. The calls alone blame rank 2 for that Send; rank 2's
    last heartbeat says it was held up by rank 3."""
    (hang,) = last_verdicts("lab_megatron_killed_rank3_run2.jsonl.gz")
    assert (hang.kind.value, hang.rank) == ("hang", 3)
    assert hang.onset_step in (8, 9)  # killed after its step 8's calls or before step 9's


def test_a_killed_rank_is_named_though_its_peers_heartbeats_stalled_before_their_calls() -> None:
    """Case ddp-killed: data-parallel over 4 ranks, rank 3 SIGKILLed at step 12. Ranks 0,
    1 and 2 joined gradient all-reduces 23 and 24, which rank 3 never did; but the last
    heartbeats of ranks 0 and 2 (their threads starved on 2 shared cores) say they had
    issued 18 and 9. Their calls say how far they got: rank 3, whose own last heartbeat
    says it was in 23 and 24, was not held up by them."""
    (hang,) = last_verdicts("lab_ddp_killed_rank3.jsonl.gz")
    assert (hang.kind.value, hang.rank, hang.seq) == ("hang", 3, 23)


def test_a_rank_stopped_inside_a_call_every_member_joined_is_named_not_the_network() -> None:
    """Case ddp-hang: rank 2 SIGSTOPped at step 12, after it posted its share of
    gradient all-reduces 25 and 26 (every member joined them; Gloo needs the stopped
    process to finish them). Its heartbeats stopped, the others' went on: the call that
    never completed is rank 2's, not the network's."""
    (hang,) = last_verdicts("lab_ddp_stopped_rank2.jsonl.gz")
    assert (hang.kind.value, hang.cause.value, hang.rank) == ("hang", "compute", 2)


@pytest.mark.parametrize("order", ORDERS)
def test_a_rank_stopped_inside_a_call_its_peer_waits_in_is_named_not_the_peer(
    order: str,
) -> None:
    """Case megatron-hang: rank 2 SIGSTOPped at step 8, inside a tensor-parallel
    all-reduce (seq 147) it had posted. Its peer rank 3 posted it too and waited in it,
    but the PyTorch collector writes a call's record when the call ends: rank 3's came
    only when the job was torn down, 8 s later. Its heartbeats said it all along
    (issued 147, completed 146): rank 3 waited in the call, it did not miss it. Rank 2,
    whose heartbeats stopped, is the hang's culprit."""
    (hang,) = last_verdicts("lab_megatron_stopped_rank2.jsonl.gz", order)
    assert (hang.kind.value, hang.cause.value, hang.rank) == ("hang", "compute", 2)


@pytest.mark.parametrize("order", ORDERS)
def test_a_slow_rank_is_named_not_the_host_its_held_up_peers_share(order: str) -> None:
    """Case megatron-slow-rank: TP 2 x PP 2 x DP 2 on two nodes, rank 1 under a 0.1 CPU
    quota from step 9. Its whole pipeline replica arrives late: its tensor-parallel peer
    rank 0 waits for it inside their collectives, the next stage (ranks 4 and 5, the
    other node) waits for their input. Counting a stage's wait for its input as waiting,
    only ranks 0 and 1 spent the time added busy, and rank 1 held the others up most."""
    (slow,) = last_verdicts("lab_megatron_slow_rank1.jsonl.gz", order)
    assert (slow.kind.value, slow.rank, slow.node) == ("slowdown", 1, "lab-n0")
    assert slow.onset_step == 9


@pytest.mark.parametrize("order", ORDERS)
def test_a_slow_host_is_named_not_the_one_of_its_ranks_the_critical_path_shows(
    order: str,
) -> None:
    """Case megatron-slow-node: the same job, the four ranks of node lab-n1 under one 0.25
    CPU quota from step 9. Rank 6 is the latest of its tensor-parallel pair on the
    critical path, but every rank of lab-n1 spent most of the time added busy while the
    other node's waited: the host."""
    (slow,) = last_verdicts("lab_megatron_slow_node1.jsonl.gz", order)
    assert (slow.kind.value, slow.rank, slow.node) == ("slowdown", None, "lab-n1")
    assert slow.cause.value == "host_cpu"


def test_a_slow_rank_is_named_once_its_first_steps_settled() -> None:
    """Case ddp-slow-rank: data-parallel over 4 ranks, rank 1 under a 0.1 CPU quota from
    step 13 (its steps then go from 25 ms to about 100). In the first steps after the
    shift, ranks 0 and 1 of node lab-n0 both came late; over more, rank 1 alone did (a
    host named from a shift's first steps is believed only once it settled)."""
    (slow,) = last_verdicts("lab_ddp_slow_rank1.jsonl.gz")
    assert (slow.kind.value, slow.rank) == ("slowdown", 1)


def test_a_slowdown_right_after_a_burst_is_priced_against_the_baseline() -> None:
    """Case ddp-slow-node: node lab-n1 under a 0.25 CPU quota from step 13. Steps 16-17
    ran 3x slower, step 18 at full speed, then 3x slower again from step 19. The burst
    began the slowdown (its onset) and is no level it adds to: nothing else was open, so
    the slowdown costs what it added to the baseline (it was priced at a few percent
    against the burst's steps)."""
    records = read_records("lab_ddp_slow_node1.jsonl.gz")
    first = {}
    for v in Replay().run(records):
        if isinstance(v, Verdict) and v.kind.value == "slowdown":
            first.setdefault(v.verdict_id, v)
    (slow,) = first.values()
    assert slow.onset_step == 16
    assert slow.severity >= 0.5, slow.summary


def test_a_slow_rank_is_named_where_every_rank_also_spent_longer_in_transfers() -> None:
    """Case zero-slow-rank: sharded data parallelism over 4 ranks, rank 1 under a 0.1 CPU
    quota from step 13. Gloo runs collectives on the CPU, so every rank's transfers got
    longer with it; but the other three also waited for rank 1 about half the time
    added, and its own waiting did not grow: the widest break in who waited longer."""
    (slow,) = last_verdicts("lab_zero_slow_rank1.jsonl.gz")
    assert (slow.kind.value, slow.rank, slow.node) == ("slowdown", 1, "lab-n0")


def test_bursts_of_noise_in_transfers_are_no_intermittent_straggler() -> None:
    """Case zero-healthy: nothing injected; two steps about 1.9x their neighbours', their
    time in longer transfers (on 2 shared cores, a collective run by a CPU that was
    busy elsewhere). Bursts are a straggler's only with a rank or host named."""
    assert last_verdicts("lab_zero_healthy.jsonl.gz") == []


@pytest.mark.parametrize("order", ORDERS)
def test_a_slow_rank_is_found_in_steps_noisier_than_its_slowdown(order: str) -> None:
    """Case megatron-slow-rank, another run: rank 1 under a 0.1 CPU quota from step 9.
    The job's first steps ran 133 to 309 ms (noise three times as wide as the 1.5x the
    quota then added), so the step times alone never stand out of their noise. But from
    step 9 rank 1 held the others up by most of every step, far past its usual share:
    a cause seen beside the slower steps, which are judged against the least shift."""
    (slow,) = last_verdicts("lab_megatron_slow_rank1_run2.jsonl.gz", order)
    assert (slow.kind.value, slow.rank, slow.node) == ("slowdown", 1, "lab-n0")
    assert 9 <= slow.onset_step <= 11


@pytest.mark.parametrize("order", ORDERS)
def test_a_slow_link_that_costs_no_step_time_is_found_from_transfer_times(order: str) -> None:
    """Case megatron-slow-link (its first 18 steps): the same job, lab-n1's link limited to
    60 Mbit/s (tbf) from step 9. The pipeline hides it (the step time barely moves), and
    a Gloo job has no link counters; but every one of the four communicators whose
    transfers cross the two nodes now takes over twice its usual transfer time, with no
    rank in all of them: the network between the nodes."""
    (link,) = last_verdicts("lab_megatron_slow_link.jsonl.gz", order)
    assert (link.kind.value, link.cause.value, link.link) == (
        "link_degradation",
        "network_link",
        "lab-n0<->lab-n1",
    )
    assert link.onset_step == 9
    assert link.evidence["communicators"] == 4


@pytest.mark.parametrize("order", ORDERS)
def test_transfers_a_slow_host_made_longer_are_no_slow_link(order: str) -> None:
    """Case megatron-slow-node (its first 26 steps): lab-n1's four ranks under one CPU
    quota from step 9. From step 15 the communicators across the nodes transfer over
    twice as slowly as usual too (a CPU-bound Gloo rank moves its buffers slowly); the
    host's slowdown explains them, so no link is reported beside it."""
    (slow,) = last_verdicts("lab_megatron_slow_node1_run2.jsonl.gz", order)
    assert (slow.kind.value, slow.node, slow.cause.value) == ("slowdown", "lab-n1", "host_cpu")


@pytest.mark.parametrize("order", ORDERS)
def test_a_peer_named_from_a_shifts_first_steps_gives_way_to_the_rank_that_held_it_up(
    order: str,
) -> None:
    """Case megatron-slow-rank, another run (its first 20 steps): rank 1 under a 0.1 CPU
    quota from step 9. In steps 9-11 its tensor-parallel peer rank 0 made the others
    wait as long as rank 1 did, and was named. Over the shift's first 8 steps rank 1
    held them up far longer (250-410 ms a step against rank 0's 150-240, while rank 0
    waited for it): the same incident, revised to rank 1, one alert."""
    (slow,) = last_verdicts("lab_megatron_slow_rank1_run3.jsonl.gz", order)
    assert (slow.kind.value, slow.rank, slow.node, slow.onset_step) == ("slowdown", 1, "lab-n0", 9)


def test_a_starved_host_without_cpu_figures_is_placed_on_its_node() -> None:
    """Case ddp-slow-node, another run (its first 26 steps, recorded before heartbeats
    carried CPU figures): node lab-n1 under a 0.25 CPU quota from step 13. Over the
    shift's first 8 steps lab-n0's ranks waited 60-62 ms a step longer than usual, rank
    2 (lab-n1) 42 ms, rank 3 21 ms: by how long they waited, rank 3 alone stayed busy
    (a slow rank's host peer waits less than the other node's ranks too: rank 0 beside
    a throttled rank 1 in lab_ddp_slow_rank1). One incident on lab-n1 from step 13;
    that it is the host, not rank 3, only CPU figures tell (lab_ddp_slow_node1_cpu*)."""
    (slow,) = last_verdicts("lab_ddp_slow_node1_run2.jsonl.gz")
    assert (slow.kind.value, slow.node, slow.onset_step) == ("slowdown", "lab-n1", 13)


@pytest.mark.parametrize("order", ORDERS)
def test_a_quotas_first_slow_steps_begin_its_slowdown_not_a_straggler(order: str) -> None:
    """Case ddp-slow-rank, another run (its first 28 steps): rank 1 under a 0.1 CPU quota
    from step 13. Steps 16-17 ran 3.5x slower, step 18 at the usual pace (the quota let
    it through), and from step 19 on all ran 3.5x slower again. The two steps were no
    straggler of their own: they began the slowdown, reported alone and from step 16."""
    (slow,) = last_verdicts("lab_ddp_slow_rank1_run2.jsonl.gz", order)
    assert (slow.kind.value, slow.rank, slow.onset_step) == ("slowdown", 1, 16)


def test_a_slow_link_found_from_transfer_times_is_no_level_a_noise_shift_adds_to() -> None:
    """Case megatron-slow-link, another run (its first 40 steps): its transfers across
    the nodes took about twice their usual from step 10 (one communicator 1.1-2.9x, its
    median of five steps 1.95x at step 13), the step time did not move. Steps 31-35 ran
    1.3x slower by the noise of 2 shared cores. The link costs no step time, so those
    steps are not a slower level it set: priced against the baseline, they are nobody's
    slowdown (priced against the level before them, two ranks were). The network is
    found once every communicator's median reached twice its usual, at step 32 (from
    step 10 while the usual time followed only the steps under 1.5x it, which held it
    under a noisy job's level)."""
    (link,) = last_verdicts("lab_megatron_slow_link_run2.jsonl.gz")
    assert (link.kind.value, link.link) == ("link_degradation", "lab-n0<->lab-n1")
    assert 10 <= link.onset_step <= 32
    assert link.severity == 0.0


def _outcome(records: list, late_first_call_s: float | None = None) -> tuple[list[int], list]:
    """The steps the job closed and its verdicts; ``late_first_call_s``: the flow's timers
    run that long after the first call's first record, before the rest of its records
    come (live, the collectors' records reach the flow later than its clock moves)."""
    replay, out, late = Replay(), [], late_first_call_s
    for rec in records:
        out += replay.update(rec)
        if late is not None and isinstance(rec, Collective):
            out += replay.tick(rec.arrival_ns + int(late * 1e9))
            late = None
    out += replay.finish()
    steps = sorted(s.step for s in out if isinstance(s, StepSummary))
    return steps, [v for v in out if isinstance(v, Verdict)]


@pytest.mark.parametrize("late_s", [None, 1.0])
def test_a_first_call_reported_partial_still_counts_in_its_step(late_s: float | None) -> None:
    """Case custom-healthy, a custom training loop whose steps come from its iteration
    markers. Its first all-reduce spread over 276 ms as the ranks started; live, the
    flow's clock passed the partial timeout before the last rank's record came, so the
    call was reported partial. Its completion then went to a folder of its own and
    never into step 0: the baseline lost its start-up step, and a 1.4x stretch at the
    edge of the noise came out as a slowdown and a transient straggler (what the live
    run said). Folded where the call's other instances are, step 0 is there and
    nothing is reported, whenever the records come."""
    steps, verdicts = _outcome(read_records("lab_custom_healthy.jsonl.gz"), late_s)
    assert steps == list(range(90))
    assert verdicts == []


def test_markers_read_before_the_job_record_still_place_the_first_steps() -> None:
    """Case zero-healthy, a sharded data-parallel job placed by its markers. The flow
    reads the job's topics at their own paces: here the communicator's record and the
    first two markers come before the job record. Those markers were kept and never
    given to the communicator, whose first three steps' calls then all fell in step 2
    (six all-gathers and reduce-scatters against the layout's two)."""
    records = read_records("lab_zero_healthy.jsonl.gz")
    marks = [r for r in records if isinstance(r, Iteration)][:2]
    ahead = [r for r in records if isinstance(r, CommInfo)] + marks
    rest = [r for r in records if not isinstance(r, CommInfo) and r not in marks]
    steps, verdicts = _outcome(ahead + rest)
    assert steps[:3] == [0, 1, 2] and len(steps) == len(set(steps)) >= 88
    assert verdicts == []


@pytest.mark.parametrize("order", [*ORDERS, "calls-last", "no-calls"])
def test_a_frozen_rank_is_named_at_the_call_it_never_issued_whatever_is_read_first(
    order: str,
) -> None:
    """Case ddp-hang: a DDP job, rank 2 frozen (cgroup freezer) in its 13th step. Its
    gradient all-reduces are issued without waiting, two a step: the others issued calls
    25 and 26, and their heartbeats say they completed 24. Rank 2's records of calls 23
    and 24 were still in its collector when it froze, so those look open although every
    rank completed them. The hung call is 25, in step 13 by the job's markers: from the
    calls, from the heartbeats alone, and with the calls' topic read behind the
    heartbeats' (live, the step was once read off the layout's one call a step: 26)."""
    records = read_records("lab_ddp_hang_rank2.jsonl.gz")
    if order == "calls-last":
        records = [r for r in records if not isinstance(r, Collective)] + [
            r for r in records if isinstance(r, Collective)
        ]
    elif order in ("markers-first", "no-calls"):
        ahead = (JobInfo, RankInfo, CommInfo, Iteration)
        records = [r for r in records if isinstance(r, ahead)] + [
            r for r in records if not isinstance(r, ahead)
        ]
    if order == "no-calls":
        records = [r for r in records if not isinstance(r, Collective)]
    replay = Replay(poll=300 if order == "polled" else None)
    last = {v.verdict_id: v for v in replay.run(records) if isinstance(v, Verdict)}
    (hang,) = last.values()
    assert (hang.kind.value, hang.rank, hang.seq, hang.step) == ("hang", 2, 25, 13)


@pytest.mark.parametrize("order", ORDERS)
def test_a_call_that_failed_with_a_killed_peer_is_not_taken_for_completed(order: str) -> None:
    """Case megatron-killed, a third run: rank 3 SIGKILLed. Its tensor-parallel peer,
    rank 2, saw their all-reduce (call 146) fail at once, and its collector counted the
    call as ended: rank 2's last heartbeat says it completed 146. A call its members
    completed is not where a job stopped, but only from members that went on beating
    after it: rank 2 stopped with the error, so the call is still rank 3's (taken for
    completed, the next open call blamed rank 2)."""
    (hang,) = last_verdicts("lab_megatron_killed_rank3_run3.jsonl.gz", order)
    assert (hang.kind.value, hang.rank) == ("hang", 3)


@pytest.mark.parametrize("order", ["as-read", "polled"])
def test_a_host_first_taken_for_one_of_its_peers_is_one_incident(order: str) -> None:
    """Case ddp-slow-node (a run whose heartbeats carry the quota's throttled time): node
    lab-n1 under a 0.25 CPU quota from step 13. The shift's first steps named rank 0 of
    the other node; a second shift (3x) named the host. That host took over the first
    incident: one slowdown of lab-n1 from step 13 held back by its quota, not a second
    one told after it and closed."""
    (slow,) = last_verdicts("lab_ddp_slow_node1_run3.jsonl.gz", order)
    assert (slow.kind.value, slow.node, slow.rank, slow.onset_step) == (
        "slowdown",
        "lab-n1",
        None,
        13,
    )
    assert slow.cause.value == "host_cpu" and slow.evidence["cpu_throttled_share"] > 0.3
