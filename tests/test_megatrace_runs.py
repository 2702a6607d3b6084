"""A run of the original tool as it leaves it (its call logs, the Megatron training log
and arguments or the analyser's config beside them) imported and analysed: steps placed by
the training log's iterations, or by the calls where it cannot mark them."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from megatrace.cli import cli
from producers.megatrace_run import import_dir
from producers.megatron_config import read_megatron_config
from producers.sim.scenarios import build
from schemas.records import Collective, JobInfo
from tests.call_logs import slow_run_records, write_logs
from tests.helpers import latest_verdicts


@pytest.fixture(scope="module")
def slow_run():
    return slow_run_records()


def _training_log(
    args: dict, ends_ns: list[int], utc_offset_h: int, every: int = 1, timed: bool = True
) -> str:
    """A Megatron training log as it writes one: start-up noise, the arguments block,
    then an iteration line every ``every`` steps (``log_interval``), its time local and to
    the second (an older Megatron: no time) and the mean time of the steps since."""
    from datetime import UTC, datetime, timedelta

    lines = ["Global variable initialized: Initialized"] * 40
    lines.append("------------------------ arguments ------------------------")
    for k, v in sorted(args.items()):
        lines.append(f"  {k} {'.' * max(3, 48 - len(k))} {v}")
    lines.append("-------------------- end of arguments ---------------------")
    lines += ["> building GPT2BPETokenizer tokenizer ...", "[Rank 0] (after 1 iterations) memory"]
    for k, end in enumerate(ends_ns[1:], 1):
        if k % every:
            continue
        local = datetime.fromtimestamp(end / 1e9, UTC) + timedelta(hours=utc_offset_h)
        ms = (end - ends_ns[k - every]) / 1e6 / every
        when = f" [{local:%Y-%m-%d %H:%M:%S}]" if timed else ""
        lines.append(
            f"{when} iteration {k:8d}/{len(ends_ns) - 1:8d} | consumed "
            f"samples: {64 * k:12d} | elapsed time per iteration (ms): {ms:.1f} | learning "
            f"rate: 1.000000E-05 | global batch size:    64 |"
        )
    return "\n".join(lines) + "\n"


def test_a_run_directory_imports_as_the_tool_leaves_it(slow_run, tmp_path: Path) -> None:
    """Call logs of the oldest variant, the training log beside them (its arguments are the
    configuration, its iteration lines the clock), and a file that is neither."""
    from detectors.replay import Replay
    from schemas.records import Iteration
    from schemas.results import StepSummary

    run, records = slow_run
    d = tmp_path / "TP2PP2DP2"
    config = write_logs(run, records, d, ids=False, save_count=False)
    steps = sorted(
        (s for s in Replay().run(records) if isinstance(s, StepSummary)), key=lambda s: s.step
    )
    ends = [steps[0].start_ns] + [s.end_ns for s in steps]
    args = json.loads(config.read_text())
    (d / "training_performance.log").write_text(_training_log(args, ends, utc_offset_h=8))
    (d / "README.txt").write_text("how this run was made\n")
    got, report = import_dir(d, None, "run")
    assert report.config_from == "the arguments in training_performance.log"
    assert report.skipped_files == {"README.txt": report.skipped_files["README.txt"]}
    assert report.utc_offset_s == 8 * 3600 and report.iterations == len(steps)
    marks = sorted((r for r in got if isinstance(r, Iteration)), key=lambda m: m.step)
    assert [m.step for m in marks] == list(range(1, len(steps) + 1))
    # on the calls' clock, to the printed second: each end is placed at the earliest the
    # printed seconds and the elapsed times allow, which is at most a second early
    for m, s in zip(marks, steps, strict=True):
        assert -1_000_000_000 < m.end_ns - s.end_ns <= 2_000_000, (m.step, m.end_ns, s.end_ns)
        assert abs(m.duration_ns - s.duration_ns) <= 100_000
    res = CliRunner().invoke(cli, ["import", "megatrace-logs", str(d), "--job", "run",
                                   "--to", str(tmp_path / "out.jsonl")])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "skipped file README.txt" in res.output and "iteration clock" in res.output
    # read in place, the run gives what its import gives
    found = []
    for target in (tmp_path / "out.jsonl", d):
        res = CliRunner().invoke(cli, ["analyze", str(target), "--json"])
        assert res.exit_code == 0, res.output
        found.append(sorted((v["kind"], v["rank"], v["onset_step"])
                            for v in latest_verdicts(res.stdout)))  # fmt: skip
    assert found[0] == found[1] and found[0][0][:2] == ("slowdown", run.labels[0].rank)


@pytest.mark.parametrize(
    ("every", "timed", "why"),
    [(4, True, "a line every 4 iterations (log_interval 4)"), (1, False, "carry no time")],
    ids=["log-interval", "no-time"],
)
def test_a_training_log_that_cannot_mark_steps_leaves_them_to_the_calls(
    slow_run, tmp_path: Path, every: int, timed: bool, why: str
) -> None:
    """Megatron prints a line every ``log_interval`` iterations (100 unless told) with their
    mean time, and older releases print no time: such lines mark no steps (a "step" of
    100 iterations would hide what happens in each); the calls' own cycle does."""
    from schemas.records import Iteration

    run, records = slow_run
    d = tmp_path / "run"
    config = write_logs(run, records, d, ids=False, save_count=False)
    ends = sorted({r.end_ns for r in records if isinstance(r, Collective) and r.end_ns})[::50]
    args = json.loads(config.read_text())
    (d / "training_performance.log").write_text(_training_log(args, ends, 0, every, timed))
    got, report = import_dir(d, None, "run")
    assert not [r for r in got if isinstance(r, Iteration)]
    assert why in report.no_clock
    assert "the steps are placed by the calls' own cycle" in "\n".join(report.lines_out())
    res = CliRunner().invoke(cli, ["analyze", str(d), "--json"])
    assert res.exit_code == 0, res.output
    (slow,) = [v for v in latest_verdicts(res.stdout) if v["kind"] == "slowdown"]
    assert slow["rank"] == run.labels[0].rank


@pytest.mark.parametrize(
    "interleaved",
    ["virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage"],
    ids=["vpp", "layers-per-chunk"],
)
def test_an_interleaved_schedule_leaves_transfers_out_rather_than_pair_them_by_1f1b(
    slow_run, tmp_path: Path, interleaved: str
) -> None:
    """Logs name no peer of a Send or Recv; under Megatron's interleaved schedule (a virtual
    pipeline) the 1F1B order would pair them wrongly, and a transfer paired with the wrong
    peer waits for ever: a false hang. They are left out, counted and said."""
    from producers.megatron_config import config_from_arguments

    run, records = slow_run
    config = write_logs(run, records, tmp_path / "logs", ids=False, save_count=False)
    args = json.loads(config.read_text())
    chunks = 2  # model chunks a stage: as many, or as few layers each
    per_stage = args["num_layers"] // args["pipeline_model_parallel_size"]
    args[interleaved] = chunks if interleaved.startswith("virtual") else per_stage // chunks
    cfg = config_from_arguments(args, "args")
    assert cfg.vpp == 2
    got, report = import_dir(tmp_path / "logs", cfg, "j")
    p2p = sum(isinstance(r, Collective) and r.op.is_p2p for r in records)
    assert report.unpaired == p2p > 0
    assert not [r for r in got if isinstance(r, Collective) and r.op.is_p2p]
    assert "the interleaved schedule (a virtual pipeline of 2)" in "\n".join(report.lines_out())
    (job,) = [r for r in got if isinstance(r, JobInfo)]
    assert job.vpp == 2 and job.schedule.value == "interleaved_1f1b"
    out = tmp_path / "records.jsonl"
    out.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in got))
    res = CliRunner().invoke(cli, ["analyze", str(out), "--json"])
    assert res.exit_code == 0, res.output
    verdicts = latest_verdicts(res.stdout)
    assert [v["kind"] for v in verdicts] == ["slowdown"]
    assert verdicts[0]["rank"] == run.labels[0].rank


def test_the_megatrace_analysers_config_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "isSP: false\nlayers: 32\nppSize: 4\ntpSize: 2\nGBS: 64\nheaders: 32\n"
        "numRanks: 64\niterations: 50\nslowThreshold: 1\n"
    )
    c = read_megatron_config(cfg)
    assert (c.world_size, c.tp, c.pp, c.dp, c.num_layers, c.num_microbatches) == (
        64, 2, 4, 8, 32, 8,
    )  # fmt: skip
    assert not c.sequence_parallel


def test_a_one_step_straggler_in_a_pipeline_is_named_from_logs_without_ids(
    tmp_path: Path,
) -> None:
    """A GPU 3x slower for one step of a 64-rank TP x PP x DP job, logged as the original
    tool's oldest variant (no opCount, no groupHash): the ranks of its pipeline replica
    downstream are held up with it and wait no more than it does in their own
    collectives; it is the one that arrived last, far more than any other."""
    run = build("transient-gpu", scale="small", seed=4, steps=25)  # the fault at step 15
    records = list(run.records(emit_kernels=False))
    config = write_logs(run, records, tmp_path / "logs", ids=False, save_count=False,
                        streams="group")  # fmt: skip
    got, _ = import_dir(tmp_path / "logs", read_megatron_config(config), "j")
    from detectors.replay import Replay
    from detectors.route import POLL
    from schemas.results import Verdict

    (label,) = run.labels
    replay = Replay(poll=POLL)  # as `megatrace analyze` replays it
    found = [v for v in replay.run(got) if isinstance(v, Verdict) and v.revision == 0]
    assert [(v.kind, v.rank, v.onset_step) for v in found] == [
        (label.kind, label.rank, label.onset_step)
    ]
