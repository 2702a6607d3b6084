"""Verdicts on real recordings of jobs starved of CPU (`megatrace lab`'s quotas on a
rank's or a node's cgroup), alone and beside a slow link: see tests/recordings.py."""

from __future__ import annotations

import msgspec
import pytest

from detectors.replay import Replay
from schemas.records import Heartbeat
from schemas.results import Verdict
from tests.recordings import ORDERS, case_records, last_verdicts, read_records, replayed


@pytest.mark.parametrize("order", ORDERS)
def test_a_rank_starved_of_cpu_is_named_not_the_network_its_slow_transfers_suggest(
    order: str,
) -> None:
    """Case custom-slow-rank (its first 30 steps): a hand-written Gloo loop, rank 1 held
    to a tenth of a CPU from step 13. Gloo moves the data on the CPU, so nobody arrives
    late: the all-reduces themselves take 2.8x as long, for every rank, as over a slow
    network (what the collectives alone said). Rank 1's heartbeats say its threads
    waited for a CPU over a second a second, the others' a quarter."""
    (v,) = last_verdicts("lab_custom_slow_rank1_cpu.jsonl.gz", order)
    assert (v.kind.value, v.rank, v.cause.value) == ("slowdown", 1, "host_cpu")
    assert v.evidence["cpu_wait_share"] > 3 * v.evidence["usual_cpu_wait_share"]


@pytest.mark.parametrize("order", ORDERS)
def test_a_host_starved_of_cpu_is_one_incident_from_its_onset(order: str) -> None:
    """Case ddp-slow-node (its first 30 steps): both ranks of lab-n1 held to a quarter of
    a CPU from step 13. The step time rose at step 12, the first steps named rank 1 of
    the other node, and rose again at step 17, when rank 2's heartbeats were late. Once
    the first shift settled, both ranks of lab-n1 were waiting for a CPU: the first
    incident is the host's from step 12, and the second, the same fault told again, is
    closed."""
    got = last_verdicts("lab_ddp_slow_node1_cpu.jsonl.gz", order)
    still = [v for v in got if v.status.value != "resolved"]
    (v,) = still
    assert (v.rank, v.node, v.onset_step, v.cause.value) == (None, "lab-n1", 12, "host_cpu")
    assert all(v.node == "lab-n1" for v in got)


@pytest.mark.parametrize("order", ORDERS)
def test_a_quota_that_explains_its_slowdown_is_the_whole_of_it(order: str) -> None:
    """Case ddp-slow-rank (its first 40 steps, 2.6 s past the onset: the quota's shares
    read over ten heartbeats): rank 1 held to a tenth of a CPU from step 13. Gloo's
    all-reduces themselves took 2-4x as long, as over a slow network, but rank 1 was
    kept from running 1.9 s a second more than the others (its threads together) for
    steps 3.8x as long: its quota explains the step, and nothing else is looked for."""
    got = last_verdicts("lab_ddp_slow_rank1_cpu.jsonl.gz", order)
    (v,) = got
    assert (v.kind.value, v.rank, v.cause.value) == ("slowdown", 1, "host_cpu")
    assert v.severity > 0.7


@pytest.mark.parametrize("order", ORDERS)
def test_a_slow_link_behind_a_rank_its_quota_holds_back_is_found_beside_it(order: str) -> None:
    """Case ddp-link-and-rank (its first 24 steps): a DDP job over two nodes, the link
    between them rate-limited from step 12 (steps 20x as long) and rank 3 held by a CPU
    quota that throttled it 0.11 s a second. Rank 3 stands apart by its CPU counters and
    is named first, but it was kept from running a quarter of the time more than usual
    while the step lost 95% of its throughput: the rest is the network's. Both are
    reported, each with its own cost; the network with the most of it."""
    got = {v.kind.value: v for v in last_verdicts("lab_ddp_link_and_rank3_cpu.jsonl.gz", order)}
    assert set(got) == {"slowdown", "link_degradation"}
    rank, link = got["slowdown"], got["link_degradation"]
    assert (rank.rank, rank.cause.value) == (3, "host_cpu")
    assert (link.link, link.cause.value) == ("lab-n0<->lab-n1", "network_link")
    assert rank.onset_step == link.onset_step == 14
    assert rank.severity < 0.3 < 0.6 < link.severity
    assert rank.severity + link.severity == pytest.approx(0.95, abs=0.02)
    # why the rank's cost fell, and what the network's is: in their evidence
    assert rank.evidence["step_share_explained"] == pytest.approx(rank.severity, abs=0.01)
    assert link.evidence["step_share_unexplained_by_cpu"] > 0.6


@pytest.mark.parametrize(("run", "case"), [("run4", "ddp-link-and-rank"),
                                         ("run6", "ddp-link-and-rank"),
                                         ("run6", "moe-link-and-rank")])  # fmt: skip
def test_a_slow_link_behind_a_rank_kept_from_a_cpu_half_the_time_is_found_beside_it(
    run: str, case: str
) -> None:
    """The same two faults in later live runs, on a busier host: rank 3 waited for a CPU
    (its quota's throttling and the host's other ranks together) a third to three fifths
    of the time more than usual, while the step lost nine tenths of its throughput. A
    rank kept from running that share of the time explains at most that share of the
    step: the rest is the network's, found beside it."""
    got = {v.kind.value: v for v in replayed(case_records(run, case))}
    assert set(got) == {"slowdown", "link_degradation"}
    rank, link = got["slowdown"], got["link_degradation"]
    assert (rank.rank, rank.cause.value) == (3, "host_cpu")
    assert (link.link, link.cause.value) == ("lab-n0<->lab-n1", "network_link")
    assert rank.evidence["step_share_explained"] < 0.7
    assert link.evidence["step_share_unexplained_by_cpu"] > 0.25


@pytest.mark.parametrize(("run", "case", "onset"), [("run7", "megatron-slow-rank", 10),
                                                  ("run2", "ddp-mild-rank", 37)])  # fmt: skip
def test_a_slowdown_that_came_back_after_a_few_quiet_steps_is_one_incident(
    run: str, case: str, onset: int
) -> None:
    """Rank 1 under a CPU quota to the end of the job. Megatron's steps came back to their
    old speed for three steps 27 steps after its onset, and the slowdown was resolved; the
    next steps were slow again. DDP's rank held just under what it uses did the same.
    Each is one incident, reopened (the same verdict, its first onset kept), not a
    resolved one and a new one beside it."""
    got = [v for v in replayed(case_records(run, case)) if v.kind.value == "slowdown"]
    (v,) = got
    assert (v.rank, v.onset_step, v.status.value) == (1, onset, "update")


@pytest.mark.parametrize(
    "name", ["lab_ddp_slow_rank1.jsonl.gz", "lab_ddp_slow_rank1_cpu.jsonl.gz",
             "lab_ddp_slow_node1_run3.jsonl.gz", "lab_zero_slow_rank1.jsonl.gz",
             "lab_custom_slow_rank1_cpu_run2.jsonl.gz"],
)  # fmt: skip
def test_a_fast_step_a_quota_lets_through_is_not_the_cost_gone(name: str) -> None:
    """A CPU quota lets a step through at the old speed now and then (its period's time
    came back just then), or, in lab_custom_slow_rank1_cpu_run2, two fast steps in
    five. The slowdown's cost is the mean step time it adds lately (throughput is steps
    over time), not that of the newest step nor a median: no revision says it cost
    nothing while it goes on."""
    costs = [v.severity for v in Replay().run(read_records(name))
             if isinstance(v, Verdict) and v.kind.value == "slowdown"]  # fmt: skip
    assert costs and min(costs) > 0.35


@pytest.mark.parametrize("order", ORDERS)
def test_a_hosts_ranks_taking_turns_to_come_last_are_one_slowdown_of_the_host(
    order: str,
) -> None:
    """Case ddp-slow-node (its first 34 steps): both ranks of lab-n1 held to a quarter of
    a CPU from step 13. The quota bit in bursts at first: steps 17-18, 20-21 (rank 3
    last) and 23 (rank 2 last), fast steps between, then a shift. Two ranks of one host
    taking turns are one episode, the shift's first steps: one slowdown of the host
    from the first burst, step 17, no transient straggler of rank 3 beside it."""
    (v,) = last_verdicts("lab_ddp_slow_node1_cpu_run2.jsonl.gz", order)
    assert (v.kind.value, v.rank, v.node, v.cause.value) == ("slowdown", None, "lab-n1", "host_cpu")
    assert v.onset_step == 17


@pytest.mark.parametrize("order", ORDERS)
def test_bursts_of_a_quota_on_a_noisy_job_are_one_slowdown_from_the_first(order: str) -> None:
    """Case custom-slow-rank, another run (all 90 steps): rank 1 under a CPU quota from
    step 14, on a job whose steps vary by half from one to the next (its noise bar is
    1.2x the baseline). For 18 steps the quota let a fast step through after every one
    or two slow ones (4-6x) before three slow came in a row. Lone ones had been clipped
    by the change-point test to 3x, under the twice-the-bar a lone step must clear, and
    the excursion broken by each fast step. The slow steps, fast ones among them, are
    one slowdown: of rank 1, host CPU, from step 19, none told as a transient
    straggler before it; its first cost the steps' own mean (not the clipped 3x: 67%)."""
    (v,) = last_verdicts("lab_custom_slow_rank1_cpu_run2.jsonl.gz", order)
    assert (v.kind.value, v.rank, v.cause.value, v.onset_step) == ("slowdown", 1, "host_cpu", 19)
    assert v.evidence["step_time_ratio"] > 3.5


@pytest.mark.parametrize("order", ORDERS)
def test_a_host_quota_alternating_slow_and_fast_steps_is_a_slowdown(order: str) -> None:
    """Case ddp-slow-node, a third run (all 90 steps): both ranks of lab-n1 held to a
    quarter of a CPU from step 13, on a job whose healthy steps ran 10-40 ms. From step
    17 the quota let every other step through: about 15 ms, then 85 ms, for 70 steps (61%
    of the throughput lost, by the lab's measure). Lone slow steps fell short of twice
    the noise bar, were taken as the job's noise and raised the bar with them, and no
    three came in a row: nothing was reported. Slow steps with single fast ones among
    them are one excursion: a slowdown of the host from step 19, costing half the
    throughput or more in every revision."""
    (v,) = last_verdicts("lab_ddp_slow_node1_cpu_run3.jsonl.gz", order)
    assert (v.kind.value, v.node, v.cause.value, v.onset_step) == (
        "slowdown",
        "lab-n1",
        "host_cpu",
        19,
    )
    revisions = [x for x in Replay().run(read_records("lab_ddp_slow_node1_cpu_run3.jsonl.gz"))
                 if isinstance(x, Verdict)]  # fmt: skip
    assert min(x.severity for x in revisions) > 0.45


@pytest.mark.parametrize("order", ORDERS)
def test_a_rank_that_held_the_others_up_for_two_steps_is_a_transient_straggler(order: str) -> None:
    """Case megatron-transient (its first 20 steps): rank 1 held to a tenth of a CPU for
    twice the job's usual step from step 9. Steps 9 and 10 ran 1.5x and 1.6x their
    level, not twice clear of the job's own noise (its steps vary by an eighth: its bar
    is 1.36x), but rank 1, the last to arrive, made the others wait half of each of them
    longer than it used to: no noise does that. One transient straggler of rank 1, its
    two steps and the time they lost, the cause its CPU quota."""
    (v,) = last_verdicts("lab_megatron_transient_rank1_quota.jsonl.gz", order)
    assert (v.kind.value, v.rank, v.onset_step, v.status.value) == (
        "transient_straggler", 1, 9, "resolved",
    )  # fmt: skip
    assert v.evidence["steps"] == 2 and 0.1e9 < v.evidence["time_lost_ns"] < 0.2e9
    assert v.cause.value == "host_cpu"


@pytest.mark.parametrize("order", ORDERS)
def test_two_ranks_starved_of_cpu_at_once_are_one_slowdown_naming_both(order: str) -> None:
    """Case megatron-two-ranks: TP 2 x PP 2 x DP 2, ranks 1 (stage 0, lab-n0) and 6
    (stage 1, lab-n1) each held to a tenth of a CPU from step 9. The kernel throttled
    both, and both are named in one slowdown from its onset (one alert). The job's
    steps vary by three quarters on their own: its first two slow steps stood out as a
    burst, and the steps after it, slower still though within the noise, made it the
    slowdown's beginning, not a straggler of its own."""
    (v,) = last_verdicts("lab_megatron_two_ranks_cpu.jsonl.gz", order)
    assert (v.kind.value, v.cause.value) == ("slowdown", "host_cpu")
    assert sorted(v.culprit_ranks) == [1, 6] and v.rank == v.culprit_ranks[0]
    assert v.onset_step <= 10


@pytest.mark.parametrize("order", ORDERS)
def test_two_ranks_starved_together_are_both_named_still_once_the_slowdown_settled(
    order: str,
) -> None:
    """The same case, another run (its first 26 steps): ranks 6 and 1 named together at
    the slowdown's onset, step 11. Localised again once it settled, both are found again,
    rank 1 now the more throttled (0.95 s a second, rank 6 0.70): the slowdown names the
    two still. The incident being localised again is no other incident that would
    explain its own ranks away."""
    (v,) = last_verdicts("lab_megatron_two_ranks_cpu_run2.jsonl.gz", order)
    assert (v.kind.value, v.cause.value, v.onset_step) == ("slowdown", "host_cpu", 11)
    assert sorted(v.culprit_ranks) == [1, 6] and v.rank == v.culprit_ranks[0]


@pytest.mark.parametrize("order", ORDERS)
def test_a_rank_a_little_slower_under_its_quota_is_a_slowdown_not_bursts(order: str) -> None:
    """Case megatron-mild-rank (TP 2 x PP 2 x DP 2): rank 1 held to 0.15 CPU from step 8,
    just under what it uses; the lab measured 13% of the throughput lost. The job's steps
    vary by half on their own, so the change-point detector's noise bar (0.4-0.7) is over
    what the quota adds (1.1-1.3x), and its slower steps came as bursts: an intermittent
    slowdown. The kernel throttled rank 1 0.02-0.47 s a second through most heartbeats,
    and nobody else: the slower steps are the quota's, judged against the least shift, and
    the slowdown is rank 1's, for its quota."""
    (v,) = last_verdicts("lab_megatron_mild_rank1_cpu.jsonl.gz", order)
    assert (v.kind.value, v.rank, v.cause.value) == ("slowdown", 1, "host_cpu")
    assert v.evidence["usual_cpu_throttled_share"] == 0.0 < v.evidence["cpu_throttled_share"]


@pytest.mark.parametrize("order", ORDERS)
def test_a_ddp_rank_a_little_slower_under_its_quota_is_a_slowdown(order: str) -> None:
    """Case ddp-mild-rank, with rank 1 held to a fifth of a CPU from step 12 (19% of the
    throughput lost, by the lab's measure), in a job whose steps vary by half: its slower
    steps were a transient straggler of rank 1 (from step 27). They are the quota's,
    which held rank 1 back through most heartbeats from then: a slowdown of rank 1."""
    (v,) = last_verdicts("lab_ddp_mild_rank1_cpu.jsonl.gz", order)
    assert (v.kind.value, v.rank, v.cause.value) == ("slowdown", 1, "host_cpu")


@pytest.mark.parametrize("order", ORDERS)
def test_a_quota_letting_fast_steps_through_is_no_recovery_while_it_holds(order: str) -> None:
    """Case ddp-mild-rank: rank 1 held to a quarter of a CPU from step 12 (30% of the
    throughput lost, by the lab's measure). Its quota's period spans four of the job's
    steps: slow steps (2-2.7x) came between runs of two or three fast ones (0.5-0.9x),
    and each such run read as the job back at its level, before the shift had lasted
    the second it must: nothing was reported. Fast steps while the quota still holds
    rank 1 back are ones it let through, not a recovery: a slowdown of rank 1."""
    (v,) = last_verdicts("lab_ddp_mild_rank1_cpu_run2.jsonl.gz", order)
    assert (v.kind.value, v.rank, v.cause.value) == ("slowdown", 1, "host_cpu")


def _transient_records(run: str, counted: bool = True, case: str = "ddp-transient") -> list:
    records = case_records(run, case)
    if counted:
        return records
    return [  # a source that does not read the cgroup's throttled counter
        msgspec.structs.replace(r, cpu_throttled_ns=None) if isinstance(r, Heartbeat) else r
        for r in records
    ]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("run", ["run1", "run2", "run3"])
def test_a_quota_that_held_a_rank_back_for_a_step_is_a_transient_straggler_of_it(
    run: str, order: str
) -> None:
    """Case ddp-transient (three kept runs): rank 1 held to a tenth of a CPU for two
    steps from step 13, in a job of 25-40 ms steps that vary by half on their own. Step
    14 took 2.2-2.7x the usual, 45-93 ms lost: inside the job's noise, or under what a
    host scheduler's hiccup costs. The kernel counted rank 1's cgroup throttled, and
    nobody else's, in the heartbeat interval (250 ms) that covers the step: a transient
    straggler of rank 1, for its quota."""
    got = [v for v in replayed(_transient_records(run), order) if v.kind.value != "slowdown"]
    (v,) = [v for v in got if v.kind.value == "transient_straggler"]
    assert (v.rank, v.cause.value, v.onset_step) == (1, "host_cpu", 14)
    assert v.evidence["cpu_throttled_share"] >= 0.1 > v.evidence["usual_cpu_throttled_share"]
    assert 0.04e9 < v.evidence["time_lost_ns"] < 0.1e9


@pytest.mark.parametrize("run", ["run1", "run2", "run3"])
def test_without_the_kernel_s_count_that_step_is_the_job_s_noise(run: str) -> None:
    """The same records, the heartbeats' throttled counter taken out: the step is no
    straggler (what made it one is the kernel's count)."""
    got = replayed(_transient_records(run, counted=False))
    assert not [v for v in got if v.kind.value == "transient_straggler"]


#: quota steps the job's timings alone tell nothing of: (run, case, the step, its ratio)
_UNTOLD = [
    ("run7", "ddp-transient", 13, 2.2),  # its transfers took longer: nobody came late
    ("run4", "ddp-transient", 14, 2.5),
    ("run2", "moe-transient", 13, 1.4),  # within the job's noise (its bar 0.6)
    ("run7", "moe-transient", 13, 2.0),
    # Megatron's, within its noise, after a lone slow step of its own (no quota then)
    ("run1", "megatron-transient", 9, 1.9),
]


@pytest.mark.parametrize(("run", "case", "step", "ratio"), _UNTOLD)
def test_a_quota_s_step_that_names_nobody_is_its_rank_s_transient_straggler(
    run: str, case: str, step: int, ratio: float
) -> None:
    """Rank 1 held to a tenth of a CPU for a step or two. In DDP the step's all-reduces
    took longer and nobody arrived late at them (Gloo moves the data on the CPU: a busy
    host or a network as much as a slow rank); in the mixture of experts, whose steps
    vary by a fifth on their own, the slow step stood within the noise (a lone step
    must clear twice its bar). The kernel counted rank 1's cgroup throttled over the
    step, and not at all in its next heartbeat interval (the quota let go): a transient
    straggler of rank 1, for its quota."""
    got = replayed(_transient_records(run, case=case))
    (v,) = got
    assert (v.kind.value, v.rank, v.cause.value, v.onset_step) == (
        "transient_straggler",
        1,
        "host_cpu",
        step,
    )
    assert v.evidence["step_time_ratio"] > ratio
    assert v.evidence["cpu_throttled_share"] > 0.1


@pytest.mark.parametrize(("run", "case", "step", "ratio"), _UNTOLD[:3])
def test_without_the_kernel_s_count_a_step_that_names_nobody_is_no_straggler(
    run: str, case: str, step: int, ratio: float
) -> None:
    """The same records, the heartbeats' throttled counter taken out: nothing."""
    assert not replayed(_transient_records(run, counted=False, case=case))


@pytest.mark.parametrize(("run", "onset"), [("run2", 37), ("run7", 28)])
def test_a_quota_that_throttles_on_after_a_slow_step_is_no_transient_straggler(
    run: str, onset: int
) -> None:
    """Case ddp-mild-rank: rank 1 held just under what it uses, to the end. Its first
    slow steps name nobody, or are lone ones within the job's noise, and the kernel
    counted rank 1 throttled over them; it went on counting it throttled, a little,
    in most heartbeat intervals after: a quota that holds on is a slowdown's, not one
    let go. One slowdown of rank 1, and no straggler beside it."""
    got = replayed(case_records(run, "ddp-mild-rank"))
    assert [(v.kind.value, v.rank, v.onset_step) for v in got] == [("slowdown", 1, onset)]


@pytest.mark.parametrize("run", ["run3", "run7", "run8"])
def test_a_megatron_rank_held_just_under_what_it_uses_is_named_not_its_peer(run: str) -> None:
    """Case megatron-mild-rank (TP 2 x PP 2 x DP 2): rank 1 held to 0.15 CPU, just under
    what it uses. The kernel throttled it 0.03-0.08 s a second, and no other rank at all,
    for steps 1.3-1.4x as long: its stalls stop its tensor-parallel all-reduces whole,
    and its peer rank 0 comes late to the next. One slowdown of rank 1, for its quota;
    no second one on a rank that waited for it (a rank of its own is no remainder beside
    a starved one)."""
    got = replayed(case_records(run, "megatron-mild-rank"))
    assert [(v.kind.value, v.rank, v.cause.value) for v in got] == [("slowdown", 1, "host_cpu")]
