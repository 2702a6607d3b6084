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


#: one call line; over a whole file's text, a line at a time (blanks never reach the next)
_LINE = re.compile(
    r"^[ \t]*(?:\[save_count \d+\][ \t]+)?\[(\d+)\.(\d+)\][ \t]+\[Rank (\d+)\][ \t]+"
    r"Fun (\w+)[ \t]+Data (\d+)[ \t]+stream ([^\s]+)"
    r"(?:[ \t]+opCount ([^\s]+))?(?:[ \t]+groupHash (-?\d+))?[ \t\r]*$",
    re.M,
)
_NOT_BLANK = re.compile(r"^[ \t\r]*\S", re.M)
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
    call = _call(*m.groups())
    if call is None:
        raise LogFormatError(f"unknown NCCL function {m[4]!r} (known: {', '.join(_FUNCS)})")
    return call


def parse_text(text: str) -> tuple[list[CallLine], int]:
    """Every call line of a file's text, in order, and how many of its other lines are not
    blank (what :func:`parse_line` refuses, read in one pass: a log has hundreds of
    thousands of lines).

    >>> calls, other = parse_text("[1.5] [Rank 0] Fun AllReduce Data 8 stream 0x1\\n\\n"
    ...                           "NCCL INFO init\\n[2.0] [Rank 0] Fun Foo Data 8 stream 1\\n")
    >>> [(c.ts_ns, c.op.value) for c in calls], other
    ([(1500000000, 'AllReduce')], 2)
    """
    # _call's work inlined, with a file's few ranks and streams converted once each: a
    # log has hundreds of thousands of lines
    out: list[CallLine] = []
    append, new, funcs = out.append, tuple.__new__, _FUNCS
    ranks: dict[str, int] = {}
    streams: dict[str, int] = {}
    for sec, frac, rank, fun, data, stream, opc, gh in _LINE.findall(text):
        op = funcs.get(fun)
        if op is None:
            continue
        r = ranks.get(rank)
        if r is None:
            r = ranks[rank] = int(rank)
        s = streams.get(stream)
        if s is None:
            s = streams[stream] = _stream(stream)
        ts = int(sec + frac if len(frac) == 9 else sec + (frac + "000000000")[:9])
        ids = (int(opc, 0) if opc else None, int(gh) & _U64 if gh else None)
        append(new(CallLine, (ts, r, op, int(data), s, *ids)))
    lines = text.count("\n") + (not text.endswith("\n"))
    if lines == len(out):  # every line a call (the usual): no other line to count
        return out, 0
    return out, len(_NOT_BLANK.findall(text)) - len(out)


_U64 = 2**64 - 1


def _stream(stream: str) -> int:
    return int(stream, 16) if stream[:2] in ("0x", "0X") else int(stream)


def _call(
    sec: str, frac: str, rank: str, fun: str, data: str, stream: str, opc: str | None,
    gh: str | None,
) -> CallLine | None:  # fmt: skip
    """A call line's fields, read (None: a function NCCL does not have)."""
    op = _FUNCS.get(fun)
    if op is None:
        return None
    return CallLine(
        int(sec) * 1_000_000_000 + int((frac + "000000000")[:9]),
        int(rank),
        op,
        int(data),
        _stream(stream),
        int(opc, 0) if opc else None,
        int(gh) & _U64 if gh else None,
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
