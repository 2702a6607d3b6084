"""A PyTorch Flight Recorder dump as read: the file (a pickle read without running code,
or JSON), its entries as calls (:class:`Call`, a coalesced group as one), each group's
status by name, and when the rank dumped. :mod:`producers.flight_recorder` turns every
rank's dump into records.

>>> entry = {"pg_id": 1, "process_group": ("6", "undefined"), "collective_seq_id": 3,
...          "profiling_name": "gloo:all_reduce", "input_sizes": [[16, 384]],
...          "input_dtypes": ["Float"], "state": "scheduled", "retired": False}
>>> (call,), skipped = coalesce([entry])
>>> call.op.value, call.pg, call.seq, call.count, call.done, skipped
('AllReduce', '6', 3, 6144, False, {})
>>> status_by_name({"entries": [entry], "pg_status": {"1": {"last_completed_collective": 2}}})
({'6': {'last_completed_collective': 2}}, 0)
"""

from __future__ import annotations

import ast
import io
import json
import math
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.enums import CollOp, DType, torch_op
from schemas.files import InputFileError, read_bytes


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
DTYPE_BYTES = {DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.FLOAT16: 2, DType.FLOAT64: 8,
          DType.INT64: 8, DType.INT32: 4, DType.UINT8: 1, DType.INT8: 1}  # fmt: skip
_RANK = re.compile(r"(\d+)(?:\.\w+)?$")
_PEERS = re.compile(r"(\d+)\s*(->|<-)\s*(\d+)")


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise DumpFormatError(f"refusing to load {module}.{name} from a dump (not plain data)")


def read_dump(path: Path) -> tuple[int, dict[str, Any]]:
    """(rank, dump) of one file; the rank from the dump or the end of the file name."""
    try:
        raw = read_bytes(path)  # decompressed where a copy was compressed
    except InputFileError as e:
        raise DumpFormatError(str(e)) from None
    try:
        if raw[:1] in (b"{", b"["):
            dump = json.loads(raw)
        else:
            dump = _SafeUnpickler(io.BytesIO(raw)).load()
    except DumpFormatError:
        raise
    except Exception as e:  # a pickle of something else, JSON cut short, not a dump at all
        raise DumpFormatError(f"{path}: not a Flight Recorder dump ({type(e).__name__})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise DumpFormatError(f"{path}: no 'entries' (not a Flight Recorder dump)")
    rank = dump.get("rank")
    if rank is None:
        m = _RANK.search(Path(path).name)
        if m is None:
            raise DumpFormatError(f"{path}: no rank in the dump or at the end of the file name")
        rank = int(m.group(1))
    return int(rank), dump


def ranks_in(spec: Any) -> tuple[int, ...]:
    if isinstance(spec, str):
        spec = ast.literal_eval(spec) if spec.strip() else []
    return tuple(sorted(int(r) for r in spec or ()))


def pg_of(e: dict[str, Any]) -> tuple[str, str]:
    """An entry's process group: (name, description)."""
    pg = e.get("process_group")
    if isinstance(pg, list | tuple) and pg:
        return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    return str(e.get("pg_id", "")), ""


def _time(v: Any) -> int | None:
    return int(v) if v else None  # JSON dumps write 0 for "not discovered"


@dataclass
class Call:
    """One entry (or a coalesced group of them) as the import reads it."""

    op: CollOp
    pg: str
    seq: int  # collective_seq_id or p2p_seq_id (from 1)
    p2p: bool
    peers: tuple[int, int] | None  # (src, dst) group ranks of a transfer
    count: int
    dtype: DType
    created: int
    started: int | None
    ended: int | None

    @property
    def done(self) -> bool:
        return self.ended is not None


def _call(e: dict[str, Any]) -> Call | str:
    """An entry read, or why it cannot be."""
    name = str(e.get("profiling_name", ""))
    op = torch_op(name)
    if op is None:
        return f"operation {name or '?'}"
    pg, _ = pg_of(e)
    p2p = bool(e.get("is_p2p", op.is_p2p)) or op.is_p2p
    seq_key = "p2p_seq_id" if p2p else "collective_seq_id"
    seq = e.get(seq_key, e.get("seq_id"))
    if not isinstance(seq, int):
        return f"{name} without {seq_key}"
    peers = None
    if p2p and (m := _PEERS.search(name.split(":", 1)[-1])):
        a, arrow, b = int(m[1]), m[2], int(m[3])
        peers = (a, b) if arrow == "->" else (b, a)
    sizes = e.get("input_sizes") or []
    count = sum(math.prod(s) for s in sizes if isinstance(s, list | tuple))
    dtype = _DTYPES.get((e.get("input_dtypes") or ["Byte"])[0], DType.UINT8)
    state = e.get("state", "scheduled")
    created = int(e.get("time_created_ns") or 0)
    started = _time(e.get("time_discovered_started_ns"))
    completed = _time(e.get("time_discovered_completed_ns"))
    ended: int | None = None
    if state == "completed" or e.get("retired"):  # retired: the work is over (Gloo says no more)
        ended = completed or created + int(float(e.get("duration_ms") or 0) * 1e6)
    if state == "scheduled":
        started = None
    return Call(op, pg, seq, p2p, peers, count, dtype, created, started, ended)


def status_by_name(d: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], int]:
    """A dump's ``pg_status`` by group name, and how many groups it could not name.

    torch keys it by the group's id in that process (an entry's ``pg_id``: a process
    numbers only the groups it belongs to), which the entries pair with the group's
    name; where no entry gives that pair (the ring wrapped past every call of the
    group) the group cannot be named. Entries without ``pg_id`` (older dumps) are
    named by it."""
    status = d.get("pg_status") or {}
    names = {str(e["pg_id"]): pg_of(e)[0] for e in d["entries"] if "pg_id" in e}
    if not names:
        return {str(k): st for k, st in status.items() if isinstance(st, dict)}, 0
    out = {
        names[str(k)]: st for k, st in status.items() if str(k) in names and isinstance(st, dict)
    }
    return out, len(status) - len(out)


def blocked(
    name: str,
    users: set[int],
    status: dict[int, dict[str, dict[str, Any]]],
    calls: dict[int, list[Call]],
) -> bool:
    """Whether some collective of group ``name`` was posted by every rank that dumped it
    and completed by none (numbers from 1, as the dumps count; ``status``: each rank's
    ``pg_status`` by group name, :func:`status_by_name`)."""
    posted, done = [], 0
    for rank in users:
        st = status[rank].get(name, {})
        mine = [c for c in calls.get(rank, ()) if c.pg == name and not c.p2p]
        posted.append(max([c.seq for c in mine] + [int(st.get("last_enqueued_collective") or 0)]))
        done = max(
            [done, *(c.seq for c in mine if c.done), int(st.get("last_completed_collective") or 0)]
        )
    return bool(posted) and min(posted) > done


def coalesce(entries: list[dict[str, Any]]) -> tuple[list[Call], dict[str, int]]:
    """A rank's calls in buffer order, a coalesced group's collectives as one (their sizes
    summed, done when all are); and why entries could not be read."""
    calls: list[Call] = []
    skipped: dict[str, int] = {}
    group: list[Call] = []
    for e in entries:
        name = str(e.get("profiling_name", ""))
        if name.split(":", 1)[-1].strip().startswith("coalesced"):
            colls = [c for c in group if not c.p2p]
            if len(colls) > 1:
                first = colls[0]
                first.count = sum(c.count for c in colls)
                if not all(c.done for c in colls):
                    first.ended = None
                calls = [c for c in calls if c not in colls[1:]]
            group = []
            continue
        c = _call(e)
        if isinstance(c, str):
            skipped[c] = skipped.get(c, 0) + 1
            continue
        if group and (group[0].pg, group[0].seq, group[0].p2p) != (c.pg, c.seq, c.p2p):
            group = []
        group.append(c)
        calls.append(c)
    return calls, skipped


def dump_time_ns(path: Path, dump: dict[str, Any]) -> int:
    """When a rank dumped: its watchdog's timeout after its oldest unfinished call,
    else the file's modification time, else its newest entry."""
    entries = dump["entries"]
    pending = [
        int(e.get("time_created_ns") or 0) + int(float(e.get("timeout_ms") or 600_000) * 1e6)
        for e in entries
        if e.get("state") != "completed" and not e.get("retired")
    ]
    newest = max((int(e.get("time_created_ns") or 0) for e in entries), default=0)
    if pending:
        return max(min(pending), newest)
    return max(int(Path(path).stat().st_mtime_ns), newest)


__all__ = [
    "DTYPE_BYTES",
    "Call",
    "DumpFormatError",
    "blocked",
    "coalesce",
    "dump_time_ns",
    "pg_of",
    "ranks_in",
    "read_dump",
    "status_by_name",
]  # fmt: skip
