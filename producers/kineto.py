"""Read PyTorch profiler (Kineto) traces: CUPTI kernel activity and NCCL metadata.

Each GPU activity event (``cat`` kernel, gpu_memcpy, gpu_memset) becomes a
:class:`~schemas.records.Kernel`; a kernel is a NCCL kernel when Kineto
attached collective metadata to it (``Collective name``, message sizes,
process group) - never by matching kernel names, which NCCL changes between
versions. Each process group of ``distributedInfo`` becomes a
:class:`~schemas.records.CommInfo`. Timestamps are Kineto's microseconds plus
the trace's ``baseTimeNanoseconds``, as integer nanoseconds.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from schemas.enums import CommRole, KernelKind, torch_op
from schemas.files import InputFileError, read_bytes
from schemas.records import CommInfo, Kernel


class TraceError(ValueError):
    """The file is not a Kineto trace we can read."""


_KIND = {
    "kernel": KernelKind.COMPUTE,
    "gpu_memcpy": KernelKind.MEMCPY,
    "gpu_memset": KernelKind.MEMSET,
}


def pg_hash(job: str, pg_name: str, ranks: list[int]) -> int:
    """A stable 64-bit communicator hash for a PyTorch process group of a job."""
    key = f"{job}/pg/{pg_name}/{','.join(map(str, ranks))}"
    return (zlib.crc32(key.encode()) << 32) | zlib.crc32(key[::-1].encode())


def _load(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(read_bytes(path))  # compressed or not (Kineto writes .json.gz)
    except InputFileError as e:
        raise TraceError(str(e)) from None
    except (OSError, ValueError) as e:
        raise TraceError(f"{path}: not a readable JSON trace ({e})") from None
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise TraceError(f"{path}: no traceEvents: not a Kineto trace")
    return doc


#: a rank in a trace's file name, as Holistic Trace Analysis names traces (``rank-3.json``,
#: ``rank_3.pt.trace.json.gz``, ``sampled_rank3.json``)
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def _rank_of(path: Path, dist: dict[str, Any]) -> int:
    """The trace's rank: its ``distributedInfo`` (written by a distributed job), else its
    file's name (a trace of a job that initialised no process group, or a profiler that
    left it out, named by rank as HTA's traces are)."""
    if "rank" in dist:
        return int(dist["rank"])
    m = _RANK_IN_NAME.search(path.name)
    if m is None:
        raise TraceError(
            f"{path}: no distributedInfo.rank in the trace and no rank in its name: name "
            "it by its rank (rank-3.json...)"
        )
    return int(m.group(1))


def _ranks(text: Any) -> list[int]:
    if isinstance(text, list):
        return [int(r) for r in text]
    try:
        return [int(r) for r in json.loads(str(text))]
    except (ValueError, TypeError):
        return []


def read_kineto(
    path: Path, *, job: str, node: str, rank: int | None = None
) -> Iterator[msgspec.Struct]:
    """The :class:`CommInfo` and :class:`Kernel` records of one rank's trace."""
    doc = _load(Path(path))
    dist = doc.get("distributedInfo") or {}
    if rank is None:
        rank = _rank_of(Path(path), dist)
    base = int(doc.get("baseTimeNanoseconds", 0))
    for pg in dist.get("pg_config", []):
        ranks = _ranks(pg.get("ranks", []))
        if ranks:
            yield CommInfo(
                job=job,
                ts_ns=base,
                comm_hash=pg_hash(job, str(pg.get("pg_name")), ranks),
                role=CommRole.OTHER,
                ranks=ranks,
                name=str(pg.get("pg_desc") or pg.get("pg_name")),
            )
    for ev in doc["traceEvents"]:
        kind = _KIND.get(ev.get("cat"))
        if kind is None or ev.get("ph") != "X":
            continue
        args = ev.get("args", {})
        start = base + round(float(ev["ts"]) * 1000)
        end = start + round(float(ev.get("dur", 0)) * 1000)
        extra: dict[str, Any] = {}
        coll = args.get("Collective name")
        if coll is not None:
            kind = KernelKind.NCCL
            ranks = _ranks(args.get("Process Group Ranks", "[]"))
            pg = str(args.get("Process Group Name", ""))
            extra = {
                "coll_op": torch_op(str(coll)),
                "count": int(args["In msg nelems"]) if "In msg nelems" in args else None,
                "group_size": int(args["Group size"]) if args.get("Group size") else None,
                "pg_name": pg or None,
                "comm_hash": pg_hash(job, pg, ranks) if ranks else None,
            }
        yield Kernel(
            job=job,
            node=node,
            rank=rank,
            device=int(args.get("device", 0)),
            stream=int(args.get("stream", 0)),
            name=str(ev.get("name", "")),
            kind=kind,
            correlation_id=int(args.get("correlation", 0)),
            start_ns=start,
            end_ns=max(start, end),
            **extra,
        )
