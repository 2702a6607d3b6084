"""MEGATRACE's own logs in (both variants, with and without [save_count]), the
injected slow rank out of `megatrace analyze`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from megatrace.cli import cli
from producers.megatrace_logs import MegatraceLogReader
from producers.megatrace_run import follow_dir, import_dir
from producers.megatron_config import read_megatron_config
from schemas.records import Collective, CommInfo, LinkSample
from tests.call_logs import slow_run_records, write_logs
from tests.helpers import latest_verdicts


@pytest.fixture(scope="module")
def slow_run():
    return slow_run_records()


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
