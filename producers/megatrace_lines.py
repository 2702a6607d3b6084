"""The original MEGATRACE collector's call-log line, read and written.

>>> line = "[save_count 2] [1718000000.000000500] [Rank 3] Fun Send Data 1024 stream 0x1a"
>>> c = parse_line(line)
>>> c.ts_ns, c.rank, c.op.value, c.count, c.stream, c.group_hash
(1718000000000000500, 3, 'Send', 1024, 26, None)
"""

from __future__ import annotations

import re
from typing import NamedTuple

from producers.megatron_config import ConfigFormatError
from schemas.enums import CollOp
from schemas.records import Collective


class LogFormatError(ConfigFormatError):
    """A line or file that is not in the MEGATRACE format (with the file and line)."""


_LINE = re.compile(
    r"^(?:\[save_count \d+\]\s+)?\[(?P<sec>\d+)\.(?P<frac>\d+)\]\s+\[Rank (?P<rank>\d+)\]\s+"
    r"Fun (?P<fun>\w+)\s+Data (?P<data>\d+)\s+stream (?P<stream>\S+)"
    r"(?:\s+opCount (?P<opc>\S+))?(?:\s+groupHash (?P<gh>-?\d+))?\s*$"
)
_FUNCS = {op.value: op for op in CollOp}


class CallLine(NamedTuple):
    """One call line, read (a named tuple: a log has hundreds of thousands)."""

    ts_ns: int
    rank: int
    op: CollOp
    count: int
    stream: int
    op_count: int | None
    group_hash: int | None


def parse_line(line: str) -> CallLine:
    m = _LINE.match(line.strip())
    if m is None:
        raise LogFormatError(f"not a MEGATRACE call line: {line.strip()[:120]!r}")
    fun = m["fun"]
    if fun not in _FUNCS:
        raise LogFormatError(f"unknown NCCL function {fun!r} (known: {', '.join(_FUNCS)})")
    frac = (m["frac"] + "000000000")[:9]
    stream = m["stream"]
    gh = m["gh"]
    return CallLine(
        ts_ns=int(m["sec"]) * 1_000_000_000 + int(frac),
        rank=int(m["rank"]),
        op=_FUNCS[fun],
        count=int(m["data"]),
        stream=int(stream, 16) if stream.lower().startswith("0x") else int(stream),
        op_count=int(m["opc"], 0) if m["opc"] is not None else None,
        group_hash=int(gh) & (2**64 - 1) if gh is not None else None,
    )


def format_line(
    c: Collective, *, stream: int, save_count: int | None = None, ids: bool = True
) -> str:
    """A record as the original tool would have logged it (for interop tests).

    ``ids=False`` writes the older variant without opCount/groupHash.
    """
    sec, ns = divmod(c.enqueue_ns, 1_000_000_000)
    head = f"[save_count {save_count}] " if save_count is not None else ""
    line = (
        f"{head}[{sec}.{ns:09d}] [Rank {c.rank}] Fun {c.op.value} Data {c.count} stream {stream:#x}"
    )
    if ids:
        signed = c.comm_hash - 2**64 if c.comm_hash >= 2**63 else c.comm_hash
        line += f" opCount {c.seq} groupHash {signed}"
    return line
