"""MEGATRACE's own logs in (both variants, with and without [save_count]), the
injected slow rank out of `megatrace analyze`."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from megatrace.cli import cli
from producers.megatrace_lines import format_line
from producers.megatrace_logs import MegatraceLogReader
from producers.megatrace_run import follow_dir, import_dir
from producers.megatron_config import read_megatron_config
from producers.sim.scenarios import build
from schemas.enums import CollOp
from schemas.records import Collective, CommInfo, JobInfo, LinkSample
from tests.helpers import latest_verdicts, megatron_args

CSV_HEADER = (
    "Time,Group,FromRank,ToRank,DevIndex,Func,FuncTimes,SrcIP,DstIP,Bandwidth,"
    "SendWrCounter,RemainWrDataSize,Timestamp"
)


@pytest.fixture(scope="module")
def slow_run():
    run = build("slow-gpu", scale="tiny", seed=5)  # rank 4 computes 2x slower from step 16
    records = list(run.records(emit_kernels=False))
    return run, records


def write_logs(
    run, records, directory: Path, *, ids: bool, save_count: bool, streams: str = "process"
) -> Path:
    """The records as the original tool logs them. ``streams``: "process", one stream for a
    rank's collectives and one for its transfers; "group", a stream per communicator as
    PyTorch gives each process group, and a loss all-reduce of the world after every
    data-parallel call on a stream of its own (as Megatron's training loop does)."""
    directory.mkdir()
    sp = run.spec
    colls = sorted((r for r in records if isinstance(r, Collective)), key=lambda r: r.enqueue_ns)
    dp_comms = {r.comm_hash for r in records if isinstance(r, CommInfo) and r.role.value == "dp"}
    by_rank: dict[int, list[str]] = {}
    losses: dict[int, int] = {}  # each rank's own count of calls on the world's communicator
    for i, c in enumerate(colls):
        base = 0x7F00_0000 + 0x100 * c.rank  # stream pointers are per process
        if streams == "process":
            stream = base + (1 if c.op.is_p2p else 0)
        else:
            stream = base + 2 + c.comm_hash % 97
        line = format_line(c, stream=stream, save_count=i if save_count else None, ids=ids)
        by_rank.setdefault(c.rank, []).append(line)
        if streams == "group" and c.comm_hash in dp_comms:
            seq = losses.get(c.rank, 0)
            losses[c.rank] = seq + 1
            loss = msgspec.structs.replace(
                c, op=CollOp.ALL_REDUCE, count=1, seq=seq, comm_hash=0x5EED
            )
            by_rank[c.rank].append(format_line(loss, stream=base + 1, ids=ids))
    for rank, lines in by_rank.items():
        (directory / f"rank_{rank}.log").write_text("\n".join(lines) + "\n")
    # each node's NIC ports' throughput, as the collector logs it: a file per port named
    # <host>_<NIC>_Port<i>_A.log, the time local to the second, the bandwidth whole Gb/s,
    # the window's last send completion in ns
    ports: dict[str, list[str]] = {}
    for s in (r for r in records if isinstance(r, LinkSample)):
        local = time.strftime("%Y%m%d%H%M%S", time.gmtime(s.ts_ns // 10**9))
        ports.setdefault(f"{s.node}_mlx5_{s.src_rank % 8}_Port0_A.log", [CSV_HEADER]).append(
            f"{local},{s.comm_hash},{s.src_rank},{s.dst_rank},{s.src_rank % 8},6,1,"
            f"10.0.0.{s.src_rank},10.0.0.{s.dst_rank},{round(s.throughput_gbps)},50,0,{s.ts_ns}"
        )
    for name, rows in ports.items():
        (directory / name).write_text("\n".join(rows) + "\n")
    config = directory.parent / f"{directory.name}-megatron.json"
    config.write_text(json.dumps(megatron_args(sp)))
    return config


@pytest.mark.parametrize(
    ("ids", "save_count", "streams"),
    [(True, True, "process"), (True, False, "group"), (False, True, "process"),
     (False, False, "group")],
)  # fmt: skip
def test_importing_megatrace_logs_names_the_slow_rank(
    slow_run, tmp_path: Path, ids: bool, save_count: bool, streams: str
) -> None:
    run, records = slow_run
    config = write_logs(
        run, records, tmp_path / "logs", ids=ids, save_count=save_count, streams=streams
    )
    out = tmp_path / "records.jsonl"
    runner = CliRunner()
    args = ["import", "megatrace-logs", str(tmp_path / "logs"), "--config", str(config)]
    res = runner.invoke(cli, [*args, "--job", "mt-logs", "--to", str(out)])
    assert res.exit_code == 0, res.output
    assert "inferred: point-to-point peer from the 1F1B order" in res.output
    if not ids and streams == "process":
        assert "inferred: tp communicator from the rank layout and call sizes" in res.output
    elif not ids:
        assert "inferred: tp communicator from its stream" in res.output
        assert "inferred: world communicator from the ranks whose streams begin" in res.output
    res = runner.invoke(cli, ["analyze", str(out), "--json"])
    assert res.exit_code == 0, res.output
    verdicts = latest_verdicts(res.output)
    (slow,) = [v for v in verdicts if v["kind"] == "slowdown"]
    label = run.labels[0]
    assert slow["rank"] == label.rank and abs(slow["onset_step"] - label.onset_step) <= 2
    assert all(v["kind"] == "slowdown" for v in verdicts)


def test_links_and_inferred_communicators_are_marked(slow_run, tmp_path: Path) -> None:
    run, records = slow_run
    config = write_logs(run, records, tmp_path / "logs", ids=False, save_count=False)
    got, _ = import_dir(tmp_path / "logs", read_megatron_config(config), "j")
    comms = [r for r in got if isinstance(r, CommInfo)]
    assert comms and all(c.inferred for c in comms)
    assert {c.role.value for c in comms} == {"tp", "dp", "pp"}
    links = [r for r in got if isinstance(r, LinkSample)]
    assert len(links) == sum(isinstance(r, LinkSample) for r in records)
    assert links[0].nic.startswith("mlx5_") and links[0].throughput_gbps > 0
    # metadata first, then everything in time order as a live collection would deliver it
    assert not isinstance(got[-1], CommInfo)


def test_a_torn_or_broken_throughput_row_is_skipped_and_counted(slow_run, tmp_path: Path) -> None:
    """A killed job's collector stops mid-row; the rest of the run is read all the same."""
    run, records = slow_run
    config = write_logs(run, records, tmp_path / "logs", ids=False, save_count=False)
    port = sorted((tmp_path / "logs").glob("*_Port0_A.log"))[0]
    rows = port.read_text().splitlines()
    broken = [rows[1].replace(",6,1,", ",6,x,"), "20250508143000,1,2,oops,0,6,1,a,b,9,1,0,1"]
    port.write_text("\n".join([*rows, *broken, rows[1][:30]]))  # no newline: torn
    got, report = import_dir(tmp_path / "logs", read_megatron_config(config), "j")
    links = [r for r in got if isinstance(r, LinkSample)]
    assert len(links) == sum(isinstance(r, LinkSample) for r in records) + 1  # FuncTimes unread
    assert report.bad_rows == {port.name: 2}
    assert f"skipped 2 rows of {port.name}: torn" in "\n".join(report.lines_out())


def test_megatron_flags_as_text(tmp_path: Path) -> None:
    args = tmp_path / "train.sh"
    args.write_text(
        "torchrun pretrain_gpt.py \\\n --tensor-model-parallel-size 4 "
        "--pipeline-model-parallel-size 2 --num-layers 32 \\\n --global-batch-size 128 "
        "--micro-batch-size 2 --sequence-parallel --bf16\n"
    )
    cfg = read_megatron_config(args, world_size=64)
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.num_layers, cfg.num_microbatches) == (4, 2, 8, 32, 8)
    assert cfg.sequence_parallel


def test_a_line_that_is_not_a_call_is_skipped_and_counted(tmp_path: Path) -> None:
    d = tmp_path / "logs"
    d.mkdir()
    (d / "rank_0.log").write_text(
        "[1.000000001] [Rank 0] Fun AllReduce Data 8 stream 0x1\n"
        "NCCL INFO something the library printed\n"
        "[1.000000002] [Rank 1] Fun AllReduce Data 8 stream 0x1\n"
        "[1.000000003] [Rank 9] Fun AllReduce Data 8 stream 0x1\n"  # outside the world
    )
    cfg = tmp_path / "c.json"
    cfg.write_text('{"world_size": 2}')
    records, report = import_dir(d, read_megatron_config(cfg), "j")
    assert sum(isinstance(r, Collective) for r in records) == 2
    assert report.skipped_lines == {"rank_0.log": 1} and report.outside == {9: 1}
    said = "\n".join(report.lines_out())
    assert "skipped 1 line of rank_0.log" in said and "rank 9" in said


def test_following_growing_logs(slow_run, tmp_path: Path) -> None:
    run, records = slow_run
    src = tmp_path / "src"
    config = write_logs(run, records, src, ids=True, save_count=False)
    live = tmp_path / "live"
    live.mkdir()
    files = {p.name: p.read_text().splitlines(keepends=True) for p in src.glob("*.log")}
    calls = sum(len(lines) for name, lines in files.items() if name.startswith("rank_"))
    got: list = []
    done = threading.Event()

    def writer() -> None:  # every rank's log grows in chunks, as during training
        for start in range(0, max(map(len, files.values())), 500):
            for name, lines in files.items():
                with open(live / name, "a") as f:
                    f.writelines(lines[start : start + 500])
            time.sleep(0.02)
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    reader = MegatraceLogReader(read_megatron_config(config), "j", eager=True)
    n = follow_dir(live, reader, got.extend, done.is_set, poll_s=0.01)
    t.join()
    assert n == calls
    assert sum(isinstance(r, Collective) for r in got) == n
    # the NICs' throughput logs are tailed too: every sample, once
    samples = sorted((s.ts_ns, s.src_rank) for s in records if isinstance(s, LinkSample))
    tailed = sorted((s.ts_ns, s.src_rank) for s in got if isinstance(s, LinkSample))
    assert samples and tailed == samples


# --------------------------------------------------------------------------- a run as released


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


@pytest.mark.parametrize(
    "line",
    [
        "[1746686438.086167380] [Rank 4] Fun AllReduce Data 1 stream 0x55c685f62020",
        "[save_count 2] [1755590106.365162674] [Rank 2] Fun AllReduce Data 1 stream "
        "0x5585c5844830 opCount 2",
        "[1755590106.365162674] [Rank 2] Fun AllReduce Data 1 stream 0x5585c5844830 opCount 2",
        "[save_count 7] [1755590106.365162674] [Rank 2] Fun ReduceScatter Data 260718592 "
        "stream 0x5585c5844830 opCount 0x1f groupHash -8123412341234123412",
        "[1755590106.365162674] [Rank 2] Fun Send Data 33554432 stream 0x5585c5844830",
    ],
    ids=["neither", "opCount-save_count", "opCount", "both", "send"],
)
def test_every_call_line_variant_parses(line: str) -> None:
    from producers.megatrace_lines import parse_line

    c = parse_line(line)
    assert c.rank in (2, 4) and c.ts_ns > 1.7e18 and c.stream > 0
    if "opCount" in line:
        assert c.op_count is not None
    assert (c.group_hash is not None) == ("groupHash" in line)


def test_a_run_with_opcount_alone_is_analysed(slow_run, tmp_path: Path) -> None:
    """Every line of this variant was once refused."""
    run, records = slow_run
    config = write_logs(run, records, tmp_path / "logs", ids=True, save_count=True)
    for p in (tmp_path / "logs").glob("*.log"):  # drop groupHash, keep opCount
        text = p.read_text().splitlines()
        p.write_text("\n".join(ln.split(" groupHash")[0] for ln in text) + "\n")
    got, report = import_dir(tmp_path / "logs", read_megatron_config(config), "j")
    assert not report.skipped_lines
    assert sum(isinstance(r, Collective) for r in got) == sum(
        isinstance(r, Collective) for r in records
    )


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
    run = build("transient-gpu", scale="small", seed=4)
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
