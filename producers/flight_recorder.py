"""Read PyTorch Flight Recorder dumps, so a hang's dumps go through ``megatrace analyze``.

A dump is one file per rank (a pickle, or JSON), named ``<prefix><rank>``,
holding ``pg_config`` (each process group's member ranks) and ``entries``: the
ring buffer of the rank's last collectives and point-to-point calls, each with
its process group, ``collective_seq_id``/``p2p_seq_id``, ``profiling_name``
(``nccl:all_reduce``...), sizes and dtypes, ``state`` (scheduled, started,
completed) and timestamps. Every entry becomes a
:class:`~schemas.records.Collective` (unfinished ones without an end), and
each rank a :class:`~schemas.records.Heartbeat` at the time of its dump (the
watchdog's timeout after its oldest unfinished call, or the file's time): the
dumping process was alive then and had completed what its entries say. So
the analysis sees who never joined the stuck collective.

Pickles are read with a restricted unpickler that builds only plain
containers and numbers: a dump file cannot run code. Point-to-point entries
carry no peer: on a two-rank group the peer is the other member, and the n-th
transfer from a sender in each buffer is paired (ring buffers that wrapped at
different points can mis-pair them); on larger groups they are skipped and
counted.
"""

from __future__ import annotations

import ast
import json
import math
import pickle
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from producers.megatron_config import MegatronConfig
from producers.torch_collector import comm_hash, megatron_groups
from schemas.records import Collective, CommInfo, CommProgress, Heartbeat
from schemas.units import CollOp, CommRole, DType, torch_op


class DumpFormatError(ValueError):
    """A file that is not a Flight Recorder dump (with the reason)."""


_DTYPES = {
    "Float": DType.FLOAT32,
    "BFloat16": DType.BFLOAT16,
    "Half": DType.FLOAT16,
    "Double": DType.FLOAT64,
    "Long": DType.INT64,
    "Int": DType.INT32,
    "Byte": DType.UINT8,
    "Char": DType.INT8,
}
_BYTES = {DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.FLOAT16: 2, DType.FLOAT64: 8,
          DType.INT64: 8, DType.INT32: 4, DType.UINT8: 1, DType.INT8: 1}  # fmt: skip
_RANK = re.compile(r"(\d+)(?:\.\w+)?$")


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise DumpFormatError(f"refusing to load {module}.{name} from a dump (not plain data)")


def read_dump(path: Path) -> tuple[int, dict[str, Any]]:
    """(rank, dump) of one file; the rank from the dump or the end of the file name."""
    raw = Path(path).read_bytes()
    try:
        dump = json.loads(raw) if raw[:1] in (b"{", b"[") else _SafeUnpickler(_io(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        if isinstance(e, DumpFormatError):
            raise
        raise DumpFormatError(f"{path}: not a Flight Recorder dump ({e})") from None
    if not isinstance(dump, dict) or "entries" not in dump:
        raise DumpFormatError(f"{path}: no 'entries' (not a Flight Recorder dump)")
    rank = dump.get("rank")
    if rank is None:
        m = _RANK.search(Path(path).name)
        if m is None:
            raise DumpFormatError(f"{path}: no rank in the dump or at the end of the file name")
        rank = int(m.group(1))
    return int(rank), dump


def _io(raw: bytes) -> Any:
    import io

    return io.BytesIO(raw)


def _ranks(spec: Any) -> tuple[int, ...]:
    if isinstance(spec, str):
        spec = ast.literal_eval(spec) if spec.strip() else []
    return tuple(int(r) for r in spec)


class FlightRecorderImport:
    """Turns every rank's dump into schema records (see the module docstring)."""

    def __init__(self, job: str, config: MegatronConfig | None = None, node_of=None) -> None:
        self.job = job
        self.config = config
        self.node_of = node_of or (lambda rank: f"host-rank{rank}")
        self.skipped: dict[str, int] = {}

    def records(self, dumps: dict[int, dict[str, Any]], dump_times: dict[int, int]) -> list:
        world = max(
            [max(dumps) + 1]
            + [max(_ranks(pg.get("ranks", [])) or (0,)) + 1 for d in dumps.values()
               for pg in d.get("pg_config", {}).values()]
        )  # fmt: skip
        cfg = self.config or MegatronConfig(world_size=world)
        if cfg.world_size < world:
            raise DumpFormatError(
                f"dumps name rank {world - 1}, beyond the world of {cfg.world_size}"
            )
        layout = megatron_groups(cfg.world_size, cfg.tp, cfg.pp, cfg.dp)
        first_ns = min(
            (e.get("time_created_ns", 0) for d in dumps.values() for e in d["entries"]),
            default=0,
        )
        out: list[msgspec.Struct] = [cfg.job_record(self.job, first_ns, "flight-recorder")]
        groups: dict[str, tuple[int, ...]] = {}
        for d in dumps.values():
            for name, pg in d.get("pg_config", {}).items():
                groups[str(name)] = _ranks(pg.get("ranks", [])) or tuple(range(cfg.world_size))
        for name, ranks in sorted(groups.items()):
            role = layout.get(ranks, CommRole.OTHER)
            out.append(
                CommInfo(
                    job=self.job,
                    ts_ns=first_ns,
                    comm_hash=comm_hash("group", ranks),
                    role=role,
                    ranks=list(ranks),
                    name=f"pg {name}",
                    pp_stage=min(r // (cfg.tp * cfg.dp) for r in ranks),
                )
            )
        out += [cfg.rank_record(self.job, first_ns, r, self.node_of(r)) for r in sorted(dumps)]
        calls: list[Collective] = []
        for rank, d in sorted(dumps.items()):
            progress: dict[int, list[int]] = {}
            p2p_counts: dict[tuple[int, int], int] = {}
            for e in d["entries"]:
                c = self._collective(rank, e, groups, p2p_counts)
                if c is None:
                    continue
                calls.append(c)
                p = progress.setdefault(c.comm_hash, [-1, -1])
                p[0] = max(p[0], c.seq)
                if c.end_ns is not None:
                    p[1] = max(p[1], c.seq)
            # liveness as the dump tells it: progress up to the last completion, then
            # none until the dump (the silence that makes a hang)
            comms = [
                CommProgress(comm_hash=h, issued_seq=p[0], completed_seq=p[1])
                for h, p in progress.items()
            ]
            last_done = max((c.end_ns for c in calls if c.rank == rank and c.end_ns), default=0)
            for ts in sorted({last_done, dump_times[rank]} - {0}):
                out.append(
                    Heartbeat(
                        job=self.job, node=self.node_of(rank), rank=rank, ts_ns=ts, comms=comms
                    )
                )
        calls.sort(key=lambda c: c.enqueue_ns)
        hb = [r for r in out if isinstance(r, Heartbeat)]
        meta = [r for r in out if not isinstance(r, Heartbeat)]
        return [*meta, *calls, *sorted(hb, key=lambda h: h.ts_ns)]

    def _collective(
        self,
        rank: int,
        e: dict[str, Any],
        groups: dict[str, tuple[int, ...]],
        p2p_counts: dict[tuple[int, int], int],
    ) -> Collective | None:
        op = torch_op(str(e.get("profiling_name", "")))
        pg = e.get("process_group") or (e.get("pg_id"), "")
        members = groups.get(str(pg[0]))
        if op is None or members is None or rank not in members:
            key = str(e.get("profiling_name", "?"))
            self.skipped[key] = self.skipped.get(key, 0) + 1
            return None
        p2p = op.is_p2p
        peer = None
        h = comm_hash("group", members)
        if p2p:
            if len(members) != 2:  # the peer is not in the dump: cannot be paired
                self.skipped["p2p on a group of more than two ranks"] = (
                    self.skipped.get("p2p on a group of more than two ranks", 0) + 1
                )
                return None
            peer = members[1 - members.index(rank)]
        sizes = e.get("input_sizes") or [[]]
        count = sum(math.prod(s) for s in sizes) if sizes and isinstance(sizes[0], list) else 0
        dtype = _DTYPES.get((e.get("input_dtypes") or ["Byte"])[0], DType.UINT8)
        state = e.get("state", "scheduled")
        created = int(e["time_created_ns"])
        started = e.get("time_discovered_started_ns")
        completed = e.get("time_discovered_completed_ns")
        end = int(completed) if state == "completed" and completed else None
        if state == "completed" and end is None:
            end = created + int(float(e.get("duration_ms") or 0) * 1e6)
        if p2p:  # the n-th transfer from the sender on this pair, in buffer order
            key = (h, rank if op == CollOp.SEND else peer)
            seq = p2p_counts.get(key, 0)
            p2p_counts[key] = seq + 1
        else:  # Flight Recorder counts from 1; the schema's sequence numbers from 0
            seq = max(int(e["collective_seq_id"]) - 1, 0)
        return Collective(
            job=self.job,
            node=self.node_of(rank),
            rank=rank,
            comm_hash=h,
            comm_size=len(members),
            rank_in_comm=members.index(rank),
            op=op,
            seq=seq,
            count=count,
            size_bytes=count * _BYTES.get(dtype, 1),
            dtype=dtype,
            enqueue_ns=created,
            start_ns=int(started) if started and state != "scheduled" else None,
            end_ns=end,
            peer=peer,
        )


def dump_time_ns(path: Path, dump: dict[str, Any]) -> int:
    """When a rank dumped: its watchdog's timeout after its oldest unfinished call,
    else the file's modification time, else its newest entry."""
    entries = dump["entries"]
    pending = [
        int(e["time_created_ns"]) + int(float(e.get("timeout_ms") or 600_000) * 1e6)
        for e in entries
        if e.get("state") != "completed"
    ]
    newest = max((int(e["time_created_ns"]) for e in entries), default=0)
    if pending:
        return max(min(pending), newest)
    return max(int(Path(path).stat().st_mtime_ns), newest)


def import_dumps(
    paths: Iterable[Path], job: str, config: MegatronConfig | None = None
) -> tuple[list[msgspec.Struct], dict[str, int]]:
    """Every record of a hang's dumps (one file per rank); and what was skipped."""
    dumps: dict[int, dict[str, Any]] = {}
    times: dict[int, int] = {}
    for p in paths:
        rank, d = read_dump(p)
        dumps[rank] = d
        times[rank] = dump_time_ns(p, d)
    if not dumps:
        raise DumpFormatError("no Flight Recorder dumps given")
    imp = FlightRecorderImport(job, config)
    return imp.records(dumps, times), imp.skipped


__all__ = ["DumpFormatError", "FlightRecorderImport", "dump_time_ns", "import_dumps", "read_dump"]
