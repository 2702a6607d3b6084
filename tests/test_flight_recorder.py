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
from schemas.enums import CollOp
from schemas.records import Collective, CommInfo
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


# --------------------------------------------------------------------------- newer formats

_DESCS = {"tp": "TENSOR_MODEL_PARALLEL_GROUP", "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
          "dp": "DATA_PARALLEL_GROUP", "ep": "EXPERT_MODEL_PARALLEL_GROUP"}  # fmt: skip
_NEW_NAMES = {**_NAMES, CollOp.ALL_GATHER: "nccl:_all_gather_base",
              CollOp.ALL_TO_ALL: "nccl:all_to_all"}  # fmt: skip


def write_new_dumps(records: list, directory: Path, ring: int) -> int:
    """Dumps as PyTorch 2.9 writes them: transfers named with their ends (``nccl:send
    0->1``) on a group of any size, each in a coalesced group closed by a ``coalesced``
    entry (``batch_isend_irecv``), ``pg_status``, groups described as Megatron names them,
    JSON's zeros for times not discovered, and a ring buffer that wrapped. Returns how
    many entries were written."""
    directory.mkdir()
    comms = [r for r in records if isinstance(r, CommInfo)]
    pg_of = {c.comm_hash: str(i + 1) for i, c in enumerate(comms)}
    pg_config = {pg_of[c.comm_hash]: {"name": pg_of[c.comm_hash], "desc": _DESCS.get(c.role.value,
                 "custom"), "ranks": str(sorted(c.ranks))} for c in comms}  # fmt: skip
    members = {c.comm_hash: sorted(c.ranks) for c in comms}
    by_rank: dict[int, list[dict]] = {}
    p2p: dict[tuple[int, int], int] = {}
    status: dict[int, dict[str, dict[str, int]]] = {}
    for c in sorted((r for r in records if isinstance(r, Collective)), key=lambda r: r.enqueue_ns):
        pg = pg_of[c.comm_hash]
        done = c.end_ns is not None
        e = {
            "record_id": 0, "pg_id": int(pg), "process_group": [pg, pg_config[pg]["desc"]],
            "collective_seq_id": 0 if c.op.is_p2p else c.seq + 1, "p2p_seq_id": 0,
            "op_id": 0, "profiling_name": _NEW_NAMES[c.op], "time_created_ns": c.enqueue_ns,
            "input_sizes": [[c.count]], "input_dtypes": ["BFloat16"],
            "output_sizes": [[c.count]], "output_dtypes": ["BFloat16"],
            "state": "completed" if done else "started",
            "time_discovered_started_ns": c.arrival_ns,
            "time_discovered_completed_ns": c.end_ns or 0, "retired": done,
            "timeout_ms": 600_000, "is_p2p": c.op.is_p2p, "frames": [],
        }  # fmt: skip
        entries = by_rank.setdefault(c.rank, [])
        if c.op.is_p2p:
            key = (c.rank, c.comm_hash)
            p2p[key] = p2p.get(key, 0) + 1
            ranks = members[c.comm_hash]
            me, peer = ranks.index(c.rank), ranks.index(c.peer)
            arrow = f"{me}->{peer}" if c.op is CollOp.SEND else f"{me}<-{peer}"
            e.update(p2p_seq_id=p2p[key], profiling_name=f"{_NEW_NAMES[c.op]} {arrow}")
            entries += [e, {**e, "profiling_name": "nccl:coalesced", "input_sizes": []}]
        else:
            entries.append(e)
            st = status.setdefault(c.rank, {}).setdefault(pg, {
                "last_enqueued_collective": 0, "last_started_collective": 0,
                "last_completed_collective": 0})  # fmt: skip
            st["last_enqueued_collective"] = c.seq + 1
            if done:
                st["last_completed_collective"] = c.seq + 1
    n = 0
    for rank, entries in by_rank.items():
        kept = entries[-ring:]
        n += len(kept)
        dump = {"version": "2.9", "pg_config": pg_config, "pg_status": status.get(rank, {}),
                "comm_lib_version": "2.27.5", "entries": kept}  # fmt: skip
        (directory / f"fr_dump_{rank}").write_text(json.dumps(dump))
    return n


@pytest.mark.parametrize("scenario", ["missing-recv", "compute-hang"])
def test_dumps_as_pytorch_29_writes_them_lose_no_entry_and_name_the_culprit(
    scenario: str, tmp_path: Path
) -> None:
    from producers.flight_recorder import import_dumps

    run = build(scenario, scale="demo", seed=4, pp_group_comm=True)
    records = list(run.records(emit_kernels=False))
    d = tmp_path / "dumps"
    write_new_dumps(records, d, ring=600)  # wraps: no buffer starts at sequence 1
    got, skipped = import_dumps(sorted(d.iterdir()), "fr")
    assert skipped == {}, skipped  # no entry left out
    comms = {c.name: c for c in got if isinstance(c, CommInfo)}
    assert {c.role.value for c in comms.values()} >= {"tp", "pp", "dp"}
    assert not any(c.inferred for c in comms.values())
    verdicts = analyze(tmp_path, *map(str, sorted(d.iterdir())))
    (label,) = run.labels
    hangs = [v for v in verdicts if v["kind"] == "hang"]
    assert [v["rank"] for v in hangs] == [label.rank], verdicts


def test_a_coalesced_group_of_collectives_is_one_instance() -> None:
    from producers.fr_dump import coalesce

    def e(name: str, seq: int, n: int, state: str = "completed") -> dict:
        return {"profiling_name": name, "process_group": ["3", "x"], "collective_seq_id": seq,
                "p2p_seq_id": 0, "is_p2p": False, "input_sizes": [[n], [n]],
                "input_dtypes": ["Float"], "state": state, "time_created_ns": 10 + seq,
                "time_discovered_completed_ns": 20 + seq}  # fmt: skip

    calls, skipped = coalesce([
        e("nccl:all_reduce", 1, 4),
        e("nccl:allreduce_coalesced", 2, 8), e("nccl:allreduce_coalesced", 2, 8, "started"),
        e("nccl:coalesced", 2, 0),
        e("nccl:all_to_all", 3, 5),  # ragged: each input's size counts
        e("nccl:no_such_op", 4, 1),
    ])  # fmt: skip
    assert [(c.op.value, c.seq, c.count, c.done) for c in calls] == [
        ("AllReduce", 1, 8, True), ("AllReduce", 2, 32, False), ("AllToAll", 3, 10, True),
    ]  # fmt: skip
    assert skipped == {"operation nccl:no_such_op": 1}


def test_groups_of_one_rank_and_groups_no_dump_lists(tmp_path: Path) -> None:
    """Gloo's dumps list no members (``pg_config`` holds one empty group): members come
    from the ranks that use a group, and the default group holds every rank."""
    from producers.flight_recorder import FlightRecorderImport

    def entry(pg: str, seq: int, name: str = "gloo:all_reduce") -> dict:
        return {"profiling_name": name, "process_group": [pg, "default_pg" if pg == "0" else ""],
                "collective_seq_id": seq, "p2p_seq_id": 0, "input_sizes": [[4]],
                "input_dtypes": ["Float"], "state": "scheduled", "retired": True,
                "time_created_ns": 1_000 + seq}  # fmt: skip

    empty = {"": {"name": "", "desc": "", "ranks": "[]"}}
    dumps = {
        0: {"version": "2.10", "pg_config": empty, "pg_status": {"0": {}, "5": {}},
            "entries": [entry("0", 1), entry("5", 1)]},
        1: {"version": "2.10", "pg_config": empty, "pg_status": {"0": {}},
            "entries": [entry("0", 1)]},
    }  # fmt: skip
    imp = FlightRecorderImport("g")
    got = imp.records(dumps, {0: 5_000, 1: 5_000})
    comms = sorted((c for c in got if isinstance(c, CommInfo)), key=lambda c: len(c.ranks))
    assert [(c.ranks, c.role.value, c.inferred) for c in comms] == [
        ([0], "other", True), ([0, 1], "world", True),
    ]  # fmt: skip
    colls = [c for c in got if isinstance(c, Collective)]
    assert len(colls) == 3 and all(c.end_ns is not None for c in colls)  # retired: done
    assert imp.skipped == {}


def _fr_trace_missing(dumps: Path) -> set[int] | None:
    """The ranks PyTorch's own analyser (``fr_trace``) says never joined, or None where it
    cannot read the dumps."""
    import re
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps),
         "-p", "rank_"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if res.returncode != 0:
        return None
    found: set[int] = set()
    for m in re.finditer(r"[Mm]issing ranks?[^\d\[{(]*[\[{(]([\d,\s]*)[\]})]", res.stdout):
        found.update(int(x) for x in m.group(1).replace(",", " ").split())
    return found


def test_real_gloo_dumps_of_two_ranks_that_never_joined_name_both(tmp_path: Path) -> None:
    """Flight Recorder dumps as the installed torch writes them for a real Gloo job in
    which two ranks never joined a data-parallel all-reduce: no entry skipped, one hang
    naming both, at least the ranks PyTorch's own analyser names (where it can read the
    dumps: torch 2.13's cannot read Gloo's, whose groups its dumps do not list)."""
    pytest.importorskip("torch", reason="a real job needs pip install torch==2.13.0")
    import os
    import socket
    import subprocess
    import sys

    from producers.flight_recorder import import_dumps

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).parent.parent
    env = {**os.environ, "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "TORCH_FR_BUFFER_SIZE": "2000"}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.fr_job", "--out", str(tmp_path), "--skip", "1", "2"],
            env={**env, "RANK": str(r)},
            cwd=root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(4)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    dumps = sorted(tmp_path.glob("rank_*"))
    assert len(dumps) == 4
    records, skipped = import_dumps(dumps, "fr-gloo")
    assert skipped == {}
    from detectors.replay import Replay
    from schemas.results import Verdict

    hangs = [v for v in Replay().run(records) if isinstance(v, Verdict) and v.kind.value == "hang"]
    assert hangs and {v.verdict_id for v in hangs} == {hangs[0].verdict_id}  # one incident
    hang = hangs[-1]
    assert sorted(hang.culprit_ranks) == [1, 2] and hang.rank == 1
    theirs = _fr_trace_missing(tmp_path)
    if theirs is not None:
        assert theirs <= {1, 2}


def test_real_gloo_dumps_of_a_pipeline_job_name_the_stopped_rank(tmp_path: Path) -> None:
    """The dumps of a real job (``megatrace lab``, case megatron-hang: a Megatron-style
    1F1B job over Gloo, TP 2 x PP 2 x DP 2, rank 2 stopped by SIGSTOP at step 8; the
    seven other ranks dumped at the hang timeout, rank 2 could not). Gloo's dumps list
    no group's members, and a rank's ``pg_status`` names its groups by their id in that
    process, not by name. The groups rank 2 belongs to are used by one rank that
    dumped, which waits in a call nobody completed: rank 2 is their other member."""
    import tarfile

    from detectors.replay import Replay
    from producers.flight_recorder import import_dumps
    from schemas.results import Verdict

    with tarfile.open(
        Path(__file__).parent / "data" / "fr_gloo_megatron_rank2_stopped.tar.gz"
    ) as t:
        t.extractall(tmp_path, filter="data")
    records, skipped = import_dumps(sorted((tmp_path / "fr").glob("rank_*")), "lab-megatron")
    assert skipped == {}
    groups = {tuple(c.ranks) for c in records if isinstance(c, CommInfo)}
    assert {(2, 3), (0, 2)} <= groups and (0, 1) in groups  # not every dumped rank
    verdicts = {v.verdict_id: v for v in Replay().run(records) if isinstance(v, Verdict)}
    (hang,) = verdicts.values()
    assert (hang.kind.value, hang.rank) == ("hang", 2)
    # where: the call its tensor-parallel peer waits in, not the group's first call (a
    # rank that wrote no dump is missing from every call the others' dumps hold)
    tp = {c.comm_hash for c in records if isinstance(c, CommInfo) and tuple(c.ranks) == (2, 3)}
    assert hang.comm_hash in tp and hang.seq > 100


def test_real_gloo_dumps_of_a_pipeline_job_name_the_killed_rank(tmp_path: Path) -> None:
    """Case megatron-killed of the same lab: rank 3 SIGKILLed at step 8. Its peers fail
    in its calls, and Gloo's dumps show those calls retired as if completed: no group is
    blocked. The groups rank 3 belongs to are each called on by one rank that dumped (a
    group of one has nobody to wait for): rank 3 is their other member, and a rank never
    heard from while its peers were is named before the peers that failed after it
    (rank 2, its tensor-parallel peer, is a step behind on its gradient sync)."""
    import tarfile

    from detectors.replay import Replay
    from producers.flight_recorder import import_dumps
    from schemas.results import Verdict

    with tarfile.open(Path(__file__).parent / "data" / "fr_gloo_megatron_rank3_killed.tar.gz") as t:
        t.extractall(tmp_path, filter="data")
    dumps = sorted((tmp_path / "fr").glob("rank_*"))
    assert [p.name for p in dumps] == [f"rank_{r}" for r in (0, 1, 2, 4, 5, 6, 7)]
    records, skipped = import_dumps(dumps, "lab-megatron")
    assert skipped == {}
    groups = {tuple(c.ranks) for c in records if isinstance(c, CommInfo)}
    assert {(2, 3), (1, 3)} <= groups
    verdicts = {v.verdict_id: v for v in Replay().run(records) if isinstance(v, Verdict)}
    (hang,) = verdicts.values()
    assert (hang.kind.value, hang.rank) == ("hang", 3)
    tp = {c.comm_hash for c in records if isinstance(c, CommInfo) and tuple(c.ranks) == (2, 3)}
    assert hang.comm_hash in tp and hang.seq > 100


def test_real_gloo_dumps_name_the_killed_last_rank_once_told_the_jobs_size(tmp_path: Path) -> None:
    """Case moe-killed of the lab (a mixture of experts, four ranks): rank 3 SIGKILLed at
    step 12. It is the highest rank, it wrote no dump, and Gloo's dumps name no group's
    members (its groups have no names): from the dumps alone the job has three ranks,
    and one of them is blamed. Told four (``--world-size``), its expert-parallel and
    expert-data-parallel groups, each called on by one rank that dumped, have rank 3
    as their other member: it is named."""
    import tarfile

    with tarfile.open(Path(__file__).parent / "data" / "fr_gloo_moe_rank3_killed.tar.gz") as t:
        t.extractall(tmp_path, filter="data")
    (told,) = analyze(tmp_path, str(tmp_path / "fr"), "--world-size", "4")
    assert (told["kind"], told["rank"]) == ("hang", 3)


def test_real_gloo_dumps_of_a_job_hung_in_the_network_name_no_rank(tmp_path: Path) -> None:
    """The dumps of a real job hung in the network (``megatrace lab``, case ddp-link-down:
    DDP over Gloo, 4 ranks on 2 nodes, node lab-n1's link set down at step 12; every rank
    dumped at the hang timeout). Every rank issued all-reduces 31 and 32 and completed
    30: each waits in the same call. Their dumps come within milliseconds of each other,
    two minutes after their last progress: none of them is a rank that stopped beating,
    and the hang is the network's, not a rank's."""
    import tarfile

    from detectors.replay import Replay
    from producers.flight_recorder import import_dumps
    from schemas.results import Verdict

    with tarfile.open(Path(__file__).parent / "data" / "fr_gloo_ddp_link_down.tar.gz") as t:
        t.extractall(tmp_path, filter="data")
    records, skipped = import_dumps(sorted((tmp_path / "fr").glob("rank_*")), "lab-ddp")
    assert skipped == {}
    verdicts = {v.verdict_id: v for v in Replay().run(records) if isinstance(v, Verdict)}
    (hang,) = verdicts.values()
    assert (hang.kind.value, hang.cause.value) == ("hang", "network_link")
    assert hang.rank is None and hang.culprit_ranks == []
