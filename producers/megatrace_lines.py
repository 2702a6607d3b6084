"""The original MEGATRACE collector's call-log line, read and written.

>>> line = "[save_count 2] [1718000000.000000500] [Rank 3] Fun Send Data 1024 stream 0x1a"
>>> c = parse_line(line)
>>> c.ts_ns, c.rank, c.op.value, c.count, c.stream, c.group_hash
(1718000000000000500, 3, 'Send', 1024, 26, None)
"""

from __future__ import annotations

import re
from types import ModuleType
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
    try:
        call = _call(*m.groups())
    except LogFormatError as e:
        raise LogFormatError(f"{e}: {line.strip()[:120]!r}") from None
    if call is None:
        raise LogFormatError(f"unknown NCCL function {m[4]!r} (known: {', '.join(_FUNCS)})")
    return call


def parse_text(text: str) -> tuple[list[CallLine], int]:
    """Every call line of a file's text, in order, and how many of its other lines are not
    blank (what :func:`parse_line` refuses, read in one pass: a log has hundreds of
    thousands of lines). A line whose stream or opCount is no number is one of the others.

    >>> calls, other = parse_text("[1.5] [Rank 0] Fun AllReduce Data 8 stream 0x1\\n\\n"
    ...                           "NCCL INFO init\\n[2.0] [Rank 0] Fun Foo Data 8 stream 1\\n"
    ...                           "[2.5] [Rank 0] Fun Send Data 8 stream (nil)\\n")
    >>> [(c.ts_ns, c.op.value, c.stream) for c in calls], other
    ([(1500000000, 'AllReduce', 1), (2500000000, 'Send', 0)], 2)
    """
    out = None if _native is None else _native.parse(text, CallLine, _FUNCS)
    if out is None:  # not built, or a text that is not ASCII (\d, \w and \s are Unicode's)
        out = parse_calls(text)
    lines = text.count("\n") + (not text.endswith("\n"))
    if lines == len(out):  # every line a call (the usual): no other line to count
        return out, 0
    return out, len(_NOT_BLANK.findall(text)) - len(out)


def parse_calls(text: str) -> list[CallLine]:
    """The call lines of :func:`parse_text`, read in Python: the reference that the
    compiled reader (``producers/_calllog.c``, used where it was built) matches."""
    # _call's work inlined, each distinct (function, count, stream) of a file converted
    # once (a rank repeats a few dozen calls over hundreds of thousands of lines)
    out: list[CallLine] = []
    append, new = out.append, tuple.__new__
    ranks: dict[str, int] = {}
    calls: dict[tuple[str, str, str], tuple[CollOp, int, int] | None] = {}
    for sec, frac, rank, fun, data, stream, opc, gh in _LINE.findall(text):
        what = (fun, data, stream)
        call = calls.get(what, what)
        if call is what:
            op, s = _FUNCS.get(fun), _stream(stream)
            call = calls[what] = None if op is None or s is None else (op, int(data), s)
        if call is None:
            continue
        r = ranks.get(rank)
        if r is None:
            r = ranks[rank] = int(rank)
        ts = int(sec + frac if len(frac) == 9 else sec + (frac + "000000000")[:9])
        if opc or gh:
            seq = _op_count(opc) if opc else None
            if opc and seq is None:
                continue
            append(new(CallLine, (ts, r, *call, seq, int(gh) & _U64 if gh else None)))
        else:
            append(new(CallLine, (ts, r, *call, None, None)))
    return out


_U64 = 2**64 - 1


def _stream(stream: str) -> int | None:
    """A stream's pointer as a number (None: it is none). The collector writes it with
    ``%p``, which glibc writes ``(nil)`` for the null stream (the default one)."""
    if stream == "(nil)":
        return 0
    try:
        return int(stream, 16) if stream[:2] in ("0x", "0X") else int(stream)
    except ValueError:
        return None


def _op_count(text: str) -> int | None:
    try:
        return int(text, 0)
    except ValueError:
        return None


def _call(
    sec: str, frac: str, rank: str, fun: str, data: str, stream: str, opc: str | None,
    gh: str | None,
) -> CallLine | None:  # fmt: skip
    """A call line's fields, read (None: a function NCCL does not have)."""
    op = _FUNCS.get(fun)
    if op is None:
        return None
    s = _stream(stream)
    if s is None:
        raise LogFormatError(f"stream {stream!r} is not a pointer")
    seq = _op_count(opc) if opc else None
    if opc and seq is None:
        raise LogFormatError(f"opCount {opc!r} is not a number")
    return CallLine(
        int(sec) * 1_000_000_000 + int((frac + "000000000")[:9]),
        int(rank),
        op,
        int(data),
        s,
        seq,
        int(gh) & _U64 if gh else None,
    )


#: the compiled reader (None where it was not built, no C compiler at install time:
#: :func:`parse_calls` does the same, slower)
_native: ModuleType | None
try:
    from producers import _calllog as _native
except ImportError:
    _native = None


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
