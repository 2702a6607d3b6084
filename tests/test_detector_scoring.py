"""Scoring detection (``megatrace eval``): the quality table, the peers' rules, what missed
faults cost, and incidents naming several culprits."""

from __future__ import annotations

from schemas.enums import Cause, VerdictKind
from schemas.results import Verdict


def test_eval_prints_the_quality_table_on_a_small_catalogue() -> None:
    from click.testing import CliRunner

    from megatrace.cli import cli

    res = CliRunner().invoke(
        cli,
        [
            "eval",
            "--no-baselines",
            "--seeds",
            "1",
            "--scenario",
            "missing-recv",
            "--scenario",
            "slow-link",
            "--scenario",
            "healthy",
        ],
    )
    assert res.exit_code == 0, res.output

    rows = {line.split()[0]: line.split() for line in res.output.splitlines() if line}
    assert rows["hang"][1:4] == ["1", "0", "0"]  # TP, FP, FN
    assert rows["link_degradation"][1:4] == ["1", "0", "0"]
    assert "false alarms per 10,000 healthy steps: 0.0" in res.output


def test_eval_scores_the_peers_rules_too() -> None:
    from click.testing import CliRunner

    from megatrace.cli import cli

    res = CliRunner().invoke(cli, ["eval", "--seeds", "1", "--scenario", "missing-recv"])
    assert res.exit_code == 0, res.output
    fr = res.output.split("== flight-recorder")[1].split("==")[0]
    hang = next(line for line in fr.splitlines() if line.startswith("hang"))
    assert "600." in hang  # the watchdog timeout is its latency
    assert "== hta" in res.output and "== nvrx" in res.output and "== fixed-threshold" in res.output


def test_a_degraded_link_that_costs_nothing_is_still_a_true_positive() -> None:
    from detectors.scoring import Score
    from schemas.results import FaultLabel

    link = "node-1/mlx5_0->node-2/mlx5_0"
    label = FaultLabel(
        job="j", fault_id="f", kind=VerdictKind.LINK_DEGRADATION, cause=Cause.NETWORK_LINK,
        link=link, onset_step=3, onset_ns=100, on_critical_path=False, throughput_cost=0.0,
    )  # fmt: skip
    found = Verdict(
        job="j", verdict_id="v", kind=VerdictKind.LINK_DEGRADATION, cause=Cause.NETWORK_LINK,
        link=link, onset_ns=100, detected_ns=200,
    )  # fmt: skip
    s = Score()
    s.add_run([label], [found], steps=10, step_ns=10.0)
    k = s.kinds["link_degradation"]
    assert (k.tp, k.fp, k.fn, k.culprit_ok) == (1, 0, 0, 1)
    s = Score()
    s.add_run([label], [], steps=10, step_ns=10.0)  # and missing it is not held against us
    assert s.kinds["link_degradation"].fn == 0


def test_the_score_says_what_the_faults_it_missed_cost_and_adds_up_over_folders() -> None:
    """A 7% slowdown missed and a one-step straggler at twice its step found are told
    apart (two runs, scored apart and added: as `megatrace eval` sums its folders); a
    fault that cost less than a slowdown must is in no band."""
    from detectors.scoring import Score
    from schemas.results import FaultLabel

    def label(kind: VerdictKind, cost: float, rank: int) -> FaultLabel:
        return FaultLabel(
            job="j", fault_id=f"f{rank}", kind=kind, cause=Cause.COMPUTE, rank=rank,
            onset_step=3, onset_ns=100, throughput_cost=cost,
        )  # fmt: skip

    straggler = Verdict(
        job="j", verdict_id="v", kind=VerdictKind.TRANSIENT_STRAGGLER, cause=Cause.COMPUTE,
        rank=2, onset_ns=100, detected_ns=200,
    )  # fmt: skip
    one, two = Score(), Score()
    one.add_run([label(VerdictKind.SLOWDOWN, 0.07, 1)], [], steps=10, step_ns=10.0)
    one.add_run([label(VerdictKind.SLOWDOWN, 0.03, 1)], [], steps=10, step_ns=10.0)
    two.add_run(
        [label(VerdictKind.TRANSIENT_STRAGGLER, 0.5, 2)], [straggler], steps=10, step_ns=10.0
    )
    one.add(two)
    table = one.table()
    at = table.index("found, by the throughput the fault cost:")
    assert table[at + 1 : at + 3] == [
        "  slowdown: 5-10% 0 of 1",
        "  transient_straggler: 50%+ 1 of 1",
    ]
    assert (one.kinds["slowdown"].fn, one.kinds["transient_straggler"].tp) == (1, 1)


def test_one_incident_naming_two_faulted_ranks_finds_both_and_nothing_else() -> None:
    """Two ranks slowed from the same step are two labels; the one slowdown that names
    them both (one alert) finds each, and is no false alarm. A third rank it does not
    name is missed, and a verdict naming the first alone does not find the second."""
    from detectors.scoring import Score
    from schemas.results import FaultLabel

    def label(rank: int) -> FaultLabel:
        return FaultLabel(
            job="j", fault_id=f"f{rank}", kind=VerdictKind.SLOWDOWN, cause=Cause.COMPUTE,
            rank=rank, onset_step=3, onset_ns=100, throughput_cost=0.2,
        )  # fmt: skip

    def slowdown(*ranks: int) -> Verdict:
        return Verdict(
            job="j", verdict_id="v", kind=VerdictKind.SLOWDOWN, cause=Cause.COMPUTE,
            rank=ranks[0], culprit_ranks=list(ranks) if len(ranks) > 1 else [], onset_ns=100,
            detected_ns=200,
        )  # fmt: skip

    both, alone = Score(), Score()
    both.add_run([label(1), label(6), label(3)], [slowdown(1, 6)], steps=10, step_ns=10.0)
    alone.add_run([label(1), label(6)], [slowdown(1)], steps=10, step_ns=10.0)
    k, a = both.kinds["slowdown"], alone.kinds["slowdown"]
    assert (k.tp, k.fp, k.fn, k.culprit_ok) == (2, 0, 1, 2)
    assert (a.tp, a.fp, a.fn, a.culprit_ok) == (1, 0, 1, 1)
