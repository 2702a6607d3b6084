"""MEGATRACE's own logs in (both variants, with and without [save_count]), the
injected slow rank out of `megatrace analyze`."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from megatrace.cli import cli
from producers.megatrace_logs import (
    LogFormatError,
    MegatraceLogReader,
    follow_dir,
    format_line,
    import_dir,
    read_megatron_config,
)
from producers.sim.scenarios import build
from schemas.records import Collective, CommInfo, LinkSample
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


def write_logs(run, records, directory: Path, *, ids: bool, save_count: bool) -> Path:
    directory.mkdir()
    sp = run.spec
    colls = sorted((r for r in records if isinstance(r, Collective)), key=lambda r: r.enqueue_ns)
    by_rank: dict[int, list[str]] = {}
    for i, c in enumerate(colls):
        stream = 0x7F00_0000 + 0x100 * c.rank + (1 if c.op.is_p2p else 0)  # per process
        line = format_line(c, stream=stream, save_count=i if save_count else None, ids=ids)
        by_rank.setdefault(c.rank, []).append(line)
    for rank, lines in by_rank.items():
        (directory / f"rank_{rank}.log").write_text("\n".join(lines) + "\n")
    rows = [CSV_HEADER]
    for s in (r for r in records if isinstance(r, LinkSample)):
        rows.append(
            f"{s.ts_ns / 1e9:.3f},{s.comm_hash},{s.src_rank},{s.dst_rank},{s.src_rank % 8},6,1,"
            f"10.0.0.{s.src_rank},10.0.0.{s.dst_rank},{s.throughput_gbps},50,0,"
            f"{s.ts_ns // 1000}"
        )
    (directory / "nic_throughput.csv").write_text("\n".join(rows) + "\n")
    config = directory.parent / f"{directory.name}-megatron.json"
    config.write_text(json.dumps(megatron_args(sp)))
    return config


@pytest.mark.parametrize(
    ("ids", "save_count"), [(True, True), (True, False), (False, True), (False, False)]
)
def test_importing_megatrace_logs_names_the_slow_rank(
    slow_run, tmp_path: Path, ids: bool, save_count: bool
) -> None:
    run, records = slow_run
    config = write_logs(run, records, tmp_path / "logs", ids=ids, save_count=save_count)
    out = tmp_path / "records.jsonl"
    runner = CliRunner()
    args = ["import", "megatrace-logs", str(tmp_path / "logs"), "--config", str(config)]
    res = runner.invoke(cli, [*args, "--job", "mt-logs", "--to", str(out)])
    assert res.exit_code == 0, res.output
    assert "inferred: point-to-point peer from the 1F1B order" in res.output
    if not ids:
        assert "inferred: tp communicator from the rank layout and call sizes" in res.output
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


def test_a_bad_line_says_where(tmp_path: Path) -> None:
    d = tmp_path / "logs"
    d.mkdir()
    (d / "rank_0.log").write_text(
        "[1.000000001] [Rank 0] Fun AllReduce Data 8 stream 0x1\ngarbage\n"
    )
    cfg = tmp_path / "c.json"
    cfg.write_text('{"world_size": 2}')
    with pytest.raises(LogFormatError, match=r"rank_0.log:2: not a MEGATRACE call line"):
        import_dir(d, read_megatron_config(cfg), "j")
    (d / "rank_0.log").write_text("[1.000000001] [Rank 9] Fun AllReduce Data 8 stream 0x1\n")
    with pytest.raises(LogFormatError, match="rank 9 is outside the configured world of 2"):
        import_dir(d, read_megatron_config(cfg), "j")


def test_following_growing_logs(slow_run, tmp_path: Path) -> None:
    run, records = slow_run
    src = tmp_path / "src"
    config = write_logs(run, records, src, ids=True, save_count=False)
    live = tmp_path / "live"
    live.mkdir()
    files = {p.name: p.read_text().splitlines(keepends=True) for p in src.glob("*.log")}
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
    assert n == sum(map(len, files.values()))
    assert sum(isinstance(r, Collective) for r in got) == n
