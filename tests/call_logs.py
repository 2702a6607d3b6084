"""The original tool's logs, written from simulated records as its collector leaves them
(call logs of every variant, NIC port throughput files, the Megatron arguments), for the
tests that read them back (test_megatrace_logs.py, test_megatrace_runs.py)."""

from __future__ import annotations

import json
import time
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

from producers.megatrace_lines import format_line
from producers.sim.scenarios import Run, build
from schemas.enums import CollOp
from schemas.records import Collective, CommInfo, LinkSample
from tests.helpers import megatron_args

CSV_HEADER = (
    "Time,Group,FromRank,ToRank,DevIndex,Func,FuncTimes,SrcIP,DstIP,Bandwidth,"
    "SendWrCounter,RemainWrDataSize,Timestamp"
)


@cache
def slow_run_records() -> tuple[Run, list[Any]]:
    """A tiny job whose rank 4 computes 2x slower from step 16, and its records (built
    once: the modules that log it read it, none changes it)."""
    run = build("slow-gpu", scale="tiny", seed=5)
    return run, list(run.records(emit_kernels=False))


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
