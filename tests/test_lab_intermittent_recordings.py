"""Verdicts on real recordings of one rank stalled now and then (kept from `megatrace
lab` runs of case megatron-intermittent: a Megatron-style 1F1B job, TP 2 x PP 2 x DP 2,
over Gloo on two network-namespace nodes, rank 1's cgroup frozen for about two steps at
a time). A stall that catches a rank inside a collective holds its peers there with it,
so its bursts name it, its peers or both: still one rank's stalls."""

from __future__ import annotations

import pytest

from tests.recordings import ORDERS, case_records, last_verdicts, replayed


@pytest.mark.parametrize("order", ORDERS)
def test_ranks_held_up_together_inside_one_collective_are_named_together(order: str) -> None:
    """Case megatron-intermittent: the same job, rank 1 frozen (its cgroup's freezer) for
    0.3 s at steps 9, 17, 25 and 33. At step 17 the freeze caught it inside a tensor-
    parallel all-reduce with rank 0, which took 390 ms: both had come to it on time, and
    came out of it within 5 ms of each other. Everybody else waited for the two; which
    of them came last to the calls after it (rank 0, by milliseconds) tells nothing of
    which one stopped. The stalls recur, so it is an intermittent slowdown: of ranks 0
    and 1, never of rank 0 alone. The same in whatever order the records come."""
    vs = last_verdicts("lab_megatron_intermittent_rank1.jsonl.gz", order)
    (v,) = [v for v in vs if v.kind.value == "intermittent_slowdown"]
    assert (sorted(v.culprit_ranks), v.onset_step) == ([0, 1], 17)
    assert all(1 in v.culprit_ranks for v in vs), [(v.kind, v.culprit_ranks) for v in vs]


@pytest.mark.parametrize("order", ORDERS)
def test_bursts_naming_a_rank_then_it_and_its_peer_are_one_intermittent_slowdown(
    order: str,
) -> None:
    """Case megatron-intermittent, another run: rank 1 frozen for two steps now and then
    from step 9. The first stalls' bursts named its tensor-parallel peer, rank 0 (held up
    with it), a later one ranks 0 and 1, the last rank 1: one rank's stalls, told as one
    intermittent slowdown naming the ranks its bursts named, not one of rank 0 and
    another of rank 1."""
    vs = last_verdicts("lab_megatron_intermittent_rank1_run2.jsonl.gz", order)
    (v,) = [v for v in vs if v.kind.value == "intermittent_slowdown"]
    assert (sorted(v.culprit_ranks), v.onset_step) == ([0, 1], 9)


@pytest.mark.parametrize("order", ORDERS)
def test_bursts_naming_a_rank_and_then_its_tensor_parallel_peer_are_one_rank_s_stalls(
    order: str,
) -> None:
    """Case megatron-intermittent, a third run (its first 40 steps): rank 1 frozen for 0.3 s
    at steps 9, 17, 25 and 33. The first burst named ranks 5 and 1 (its pipeline peer was
    held up with it), the second rank 0 alone (its tensor-parallel peer, with whom it
    left the all-reduce the freeze caught it in), then rank 1, then both. Bursts of one
    tensor-parallel group are one rank's stalls: one intermittent slowdown from step 9,
    of the group's ranks the bursts named, not a straggler of rank 0 and a second
    intermittent slowdown."""
    vs = last_verdicts("lab_megatron_intermittent_rank1_run3.jsonl.gz", order)
    (v,) = [v for v in vs if v.kind.value == "intermittent_slowdown"]
    assert (v.rank, sorted(v.culprit_ranks), v.onset_step) == (1, [0, 1], 9)
    assert all(1 in v.culprit_ranks for v in vs), [(v.kind, v.culprit_ranks) for v in vs]


@pytest.mark.parametrize("order", ORDERS)
def test_bursts_naming_a_host_then_one_of_its_ranks_are_that_rank_s_stalls(order: str) -> None:
    """Case moe-intermittent, kept in `tests/corpus/lab41/run3`: a mixture of experts,
    rank 1's cgroup frozen for two steps every 8. The first stall held both ranks of
    lab-n0 up (a burst of its host, 2.9x), the second named rank 1 (2.5x): one
    straggler's stalls, an intermittent slowdown of rank 1 from the first."""
    records = case_records("run3", "moe-intermittent")
    (v,) = [v for v in replayed(records, order) if v.kind.value == "intermittent_slowdown"]
    assert (v.rank, v.node, v.onset_step) == (1, "lab-n0", 13)


def test_a_slower_stretch_while_the_stalls_recur_is_no_slowdown_of_the_peer() -> None:
    """Case megatron-intermittent, kept in `tests/corpus/lab41/run1`: rank 1 frozen for
    two steps every 8. Once its stalls recurred (an intermittent slowdown of ranks 1
    and 0, its tensor-parallel peer), the job's steps ran 1.3-1.6x slower for stretches
    of ten steps or more, which named rank 0: the stalls again, carried by their
    intermittent verdict, not slowdowns of rank 0 (two false ones, before)."""
    records = case_records("run1", "megatron-intermittent")
    got = replayed(records)
    assert [v.kind.value for v in got if v.kind.value != "transient_straggler"] == [
        "intermittent_slowdown"
    ]
    (v,) = [v for v in got if v.kind.value == "intermittent_slowdown"]
    assert (v.rank, sorted(v.culprit_ranks), v.onset_step) == (1, [0, 1], 9)
