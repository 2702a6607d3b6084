"""Flight Recorder dumps of a hang in, the rank that never joined out of `megatrace analyze`."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from click.testing import CliRunner

from megatrace.cli import cli
from producers.flight_recorder import DumpFormatError, read_dump
from producers.sim.scenarios import build
from schemas.records import Collective, CommInfo
from schemas.units import CollOp
from tests.helpers import latest_verdicts, megatron_args

_NAMES = {
    CollOp.ALL_REDUCE: "nccl:all_reduce",
    CollOp.ALL_GATHER: "nccl:_allgather_base",
    CollOp.REDUCE_SCATTER: "nccl:_reduce_scatter_base",
    CollOp.SEND: "nccl:send",
    CollOp.RECV: "nccl:recv",
}


def write_dumps(records: list, directory: Path, ring: int = 400) -> None:
    """What each rank's Flight Recorder would have dumped at the watchdog timeout."""
    directory.mkdir()
    comms = [r for r in records if isinstance(r, CommInfo)]
    pg_of = {c.comm_hash: str(i) for i, c in enumerate(comms)}
    pg_config = {str(i): {"name": str(i), "desc": c.role.value, "ranks": str(c.ranks)}
                 for i, c in enumerate(comms)}  # fmt: skip
    by_rank: dict[int, list[dict]] = {}
    seqs: dict[tuple[int, int], int] = {}
    for c in sorted((r for r in records if isinstance(r, Collective)), key=lambda r: r.enqueue_ns):
        key = (c.rank, c.comm_hash)
        seqs[key] = seqs.get(key, 0) + 1
        done = c.end_ns is not None
        by_rank.setdefault(c.rank, []).append(
            {
                "record_id": len(by_rank.get(c.rank, [])),
                "pg_id": int(pg_of[c.comm_hash]),
                "process_group": (pg_of[c.comm_hash], "default"),
                "collective_seq_id": 0 if c.op.is_p2p else c.seq + 1,
                "p2p_seq_id": seqs[key] if c.op.is_p2p else 0,
                "op_id": seqs[key],
                "profiling_name": _NAMES[c.op],
                "time_created_ns": c.enqueue_ns,
                "input_sizes": [[c.count]],
                "input_dtypes": ["BFloat16"],
                "output_sizes": [[c.count]],
                "output_dtypes": ["BFloat16"],
                "state": "completed" if done else "started",
                "time_discovered_started_ns": c.arrival_ns,
                "time_discovered_completed_ns": c.end_ns,
                "retired": done,
                "timeout_ms": 600_000,
                "is_p2p": c.op.is_p2p,
                "frames": [],
            }
        )
    for rank, entries in by_rank.items():
        dump = {"version": "2.4", "pg_config": pg_config, "entries": entries[-ring:]}
        if rank % 2:
            (directory / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump))
        else:
            (directory / f"nccl_trace_rank_{rank}.json").write_text(json.dumps(dump))


@pytest.fixture(scope="module")
def hang(tmp_path_factory: pytest.TempPathFactory):
    run = build("compute-hang", scale="tiny", seed=3)
    records = list(run.records(emit_kernels=False))
    d = tmp_path_factory.mktemp("fr") / "dumps"
    write_dumps(records, d)
    sp = run.spec
    config = d.parent / "megatron.json"
    config.write_text(json.dumps(megatron_args(sp)))
    return run, d, config


def analyze(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "fr.jsonl"
    runner = CliRunner()
    res = runner.invoke(cli, ["import", "flight-recorder", *args, "--job", "fr", "--to", str(out)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["analyze", str(out), "--json"])
    assert res.exit_code == 0, res.output
    return latest_verdicts(res.output)


def test_dumps_with_the_megatron_config_name_the_rank_and_the_phase(hang, tmp_path: Path) -> None:
    run, dumps, config = hang
    (label,) = run.labels
    (v,) = analyze(tmp_path, str(dumps), "--config", str(config))
    assert (v["kind"], v["rank"]) == ("hang", label.rank)
    assert (v["phase"], v["microbatch"], v["pp_stage"]) == (
        label.phase.value,
        label.microbatch,
        label.pp_stage,
    )


def test_dumps_alone_still_name_the_rank_that_never_joined(hang, tmp_path: Path) -> None:
    run, dumps, _ = hang
    (label,) = run.labels
    verdicts = analyze(tmp_path, *map(str, sorted(dumps.iterdir())))
    (v,) = [v for v in verdicts if v["kind"] == "hang"]
    assert v["rank"] == label.rank


def test_a_dump_cannot_run_code(tmp_path: Path) -> None:
    evil = tmp_path / "trace_rank_0"
    evil.write_bytes(pickle.dumps({"entries": [], "x": Path("/")}))
    with pytest.raises(DumpFormatError, match="refusing to load pathlib"):
        read_dump(evil)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DumpFormatError, match="not a Flight Recorder dump"):
        read_dump(tmp_path / "notes.txt")
