"""The NCCL Inspector's JSON output in (its documented v4.3 format and the older one), the
same collectives out, through `megatrace import nccl-inspector` and the node agent."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest
from click.testing import CliRunner

from megatrace.cli import cli
from producers.nccl_inspector import import_files
from producers.sim.scenarios import build
from schemas.codec import read_jsonl
from schemas.records import Collective, CommInfo

WORLD = 0xA11


def write_inspector(
    records: list, directory: Path, *, verbose: bool, v43: bool, world_comm: bool
) -> dict[int, tuple[str, int]]:
    """What the Inspector of each rank's process would write: a file per process, a dump
    every 50 operations per communicator. Returns each rank's (host, pid)."""
    directory.mkdir()
    comms = {c.comm_hash: sorted(c.ranks) for c in records if isinstance(c, CommInfo)}
    colls = [r for r in records if isinstance(r, Collective) and r.end_ns is not None]
    ranks = sorted({c.rank for c in colls})
    proc = {r: (f"node-{r // 8}", 1000 + r) for r in ranks}
    if world_comm:  # the default group's first collective: every process is on it
        t0 = min(c.enqueue_ns for c in colls) - 10**9
        comms[WORLD] = ranks
        colls += [Collective(job="x", node="n", rank=r, comm_hash=WORLD, comm_size=len(ranks),
                             rank_in_comm=r, op=colls[0].op, seq=0, count=4096,
                             size_bytes=8192, dtype=colls[0].dtype, enqueue_ns=t0,
                             start_ns=t0, end_ns=t0 + 1000) for r in ranks]  # fmt: skip
    per: dict[tuple[int, int], list[Collective]] = defaultdict(list)
    for c in sorted(colls, key=lambda c: c.end_ns):
        per[(c.rank, c.comm_hash)].append(c)
    lines: dict[int, list[str]] = defaultdict(list)
    for (rank, comm), ops in sorted(per.items()):
        host, pid = proc[rank]
        header = {"id": f"{comm:#x}", "rank": comms[comm].index(rank),
                  "n_ranks": len(comms[comm]), "nnodes": 1}  # fmt: skip
        for i in range(0, len(ops), 50):
            batch = ops[i : i + 50]
            meta = {"inspector_output_format_version": "v4.3" if v43 else "v4.1",
                    "git_rev": "", "rec_mechanism": "nccl_profiler_interface",
                    "dump_timestamp_us": batch[-1].end_ns // 1000 + 500, "hostname": host,
                    "pid": pid}  # fmt: skip
            bodies = [_body(c, comms) for (c,) in zip(batch, strict=True)]
            if not verbose:
                for b in bodies:
                    next(iter(b.values())).pop("event_trace_ts")
            if v43:
                n_coll = sum("coll_perf" in b for b in bodies)
                lines[rank].append(json.dumps({"header": header, "metadata": meta, "dump_stats": {
                    "coll_records": n_coll, "p2p_records": len(bodies) - n_coll,
                    "coll_dropped_total": 0, "coll_dropped_since_last_dump": 0}}))  # fmt: skip
                lines[rank] += [json.dumps(b) for b in bodies]
            else:
                lines[rank] += [json.dumps({"header": header, "metadata": meta, **b})
                                for b in bodies]  # fmt: skip
    for rank, text in lines.items():
        (directory / f"{proc[rank][0]}-{proc[rank][1]}.log").write_text("\n".join(text) + "\n")
    return proc


def _body(c: Collective, comms: dict[int, list[int]]) -> dict:
    us = lambda ns: ns // 1000  # noqa: E731
    trace = {"kernel_events": [{"channel_id": 0, "kernel_start_ts": us(c.arrival_ns),
                                "kernel_stop_ts": us(c.end_ns)}]}  # fmt: skip
    if c.op.is_p2p:
        return {"p2p_perf": {"p2p": c.op.value, "p2p_sn": c.seq,
                             "p2p_peer": comms[c.comm_hash].index(c.peer),
                             "p2p_msg_size_bytes": c.size_bytes,
                             "p2p_exec_time_us": us(c.end_ns - c.arrival_ns),
                             "p2p_timing_source": "kernel_gpu", "p2p_algobw_gbs": 1.0,
                             "p2p_busbw_gbs": 1.0,
                             "event_trace_ts": {"p2p_start_ts": us(c.enqueue_ns),
                                                **trace}}}  # fmt: skip
    return {"coll_perf": {"coll": c.op.value, "coll_algo": "RING", "coll_proto": "SIMPLE",
                          "coll_sn": c.seq, "coll_msg_size_bytes": c.size_bytes,
                          "coll_exec_time_us": us(c.end_ns - c.arrival_ns),
                          "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": 1.0,
                          "coll_busbw_gbs": 1.0,
                          "event_trace_ts": {"coll_start_ts": us(c.enqueue_ns),
                                             **trace}}}  # fmt: skip


@pytest.fixture(scope="module")
def job():
    run = build("slow-gpu", scale="tiny", seed=5, steps=12)
    return run, list(run.records(emit_kernels=False))


def _last_arrivers(colls: list[Collective]) -> dict[tuple[int, int], int]:
    """Who arrived last at each collective instance (the rank the others waited for)."""
    groups: dict[tuple[int, int], list[Collective]] = defaultdict(list)
    for c in colls:
        if not c.op.is_p2p and c.comm_size > 1:
            groups[(c.comm_hash, c.seq)].append(c)
    return {k: max(g, key=lambda c: (c.arrival_ns, c.rank)).rank for k, g in groups.items()
            if len(g) == g[0].comm_size}  # fmt: skip


@pytest.mark.parametrize(
    ("verbose", "v43", "world_comm"),
    [(True, True, True), (False, True, True), (True, False, True), (True, True, False)],
    ids=["v4.3-verbose", "v4.3-plain", "v4.1-verbose", "no-world-communicator"],
)
def test_the_inspector_output_gives_back_the_jobs_collectives(
    job, tmp_path: Path, verbose: bool, v43: bool, world_comm: bool
) -> None:
    _, records = job
    write_inspector(records, tmp_path / "insp", verbose=verbose, v43=v43, world_comm=world_comm)
    got, reader = import_files([tmp_path / "insp"], "insp")
    assert reader.skipped == {} and reader.numbered == (not world_comm)  # fmt: skip
    mine = [c for c in got if isinstance(c, Collective) and c.comm_hash != WORLD]
    theirs = [c for c in records if isinstance(c, Collective) and c.end_ns is not None]
    assert len(mine) == len(theirs)
    # the same ranks (their rank in the world, or their processes' order), the same
    # instances, and the same rank arriving last at each: who waited for whom holds
    key = lambda c: (c.rank, c.comm_hash, c.seq, c.op, c.peer)  # noqa: E731
    assert sorted(map(key, mine)) == sorted(map(key, theirs))
    truth, seen = _last_arrivers(theirs), _last_arrivers(mine)
    agree = sum(seen.get(k) == r for k, r in truth.items()) / len(truth)
    assert agree > (0.99 if verbose else 0.9), agree
    comms = [c for c in got if isinstance(c, CommInfo)]
    assert {tuple(sorted(c.ranks)) for c in comms if c.comm_hash != WORLD} == {
        tuple(sorted(c.ranks)) for c in records if isinstance(c, CommInfo)}  # fmt: skip


def test_import_nccl_inspector_through_the_command_line(job, tmp_path: Path) -> None:
    _, records = job
    write_inspector(records, tmp_path / "insp", verbose=True, v43=True, world_comm=True)
    (tmp_path / "insp" / "notes.txt").write_text("not Inspector output\n")
    out = tmp_path / "recs.jsonl"
    res = CliRunner().invoke(cli, ["import", "nccl-inspector", str(tmp_path / "insp"),
                                   "--job", "insp", "--to", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "skipped: a line that is not JSON (1)" in res.output
    assert sum(isinstance(r, Collective) for r in read_jsonl(out)) > 1000


def test_the_agent_follows_the_inspectors_files(job, tmp_path: Path) -> None:
    """Live: the node agent tails the Inspector's directory as it grows and spools
    records, the ranks' operations once their rank in the world is known."""
    from producers.agent import NodeAgent
    from producers.agent_publish import unpack
    from schemas.codec import decode
    from schemas.config import AgentSettings
    from schemas.topics import Topics

    _, records = job
    write_inspector(records, tmp_path / "src", verbose=True, v43=True, world_comm=True)
    live = tmp_path / "live"
    live.mkdir()
    agent = NodeAgent(
        AgentSettings(job="insp", inspector=[str(live / "*.log")]),
        {"bootstrap.servers": "127.0.0.1:1"}, Topics(), tmp_path / "state",
    )  # fmt: skip
    try:
        srcs = {
            p.name: p.read_text().splitlines(keepends=True) for p in (tmp_path / "src").iterdir()
        }
        longest = max(map(len, srcs.values()))
        for start in range(0, longest, 400):  # the files grow as the dumps come
            for name, lines in srcs.items():
                with open(live / name, "a") as f:
                    f.writelines(lines[start : start + 400])
            agent.tail_once()
            time.sleep(0.01)
        frames = [unpack(p) for p, _ in agent.spool.read(10**6)]
        got = [decode(v) for _, _, v in frames]
        colls = [r for r in got if isinstance(r, Collective) and r.comm_hash != WORLD]
        assert len(colls) == sum(
            isinstance(r, Collective) and r.end_ns is not None for r in records
        )
        assert agent.health.refused == 0
    finally:
        agent.spool.close()
