"""Schema records as ClickHouse ``RowBinary``: what the flow inserts when it can.

ClickHouse parses ``RowBinary`` for a third of the CPU ``JSONEachRow`` takes: into
the raw tables, 2.0 against 2.8 µs a row here (and the temporary file chDB reads an
insert from is half the size), and the raw rows are most of what a flow process
inserts. The encoder is compiled (``infra/_rowbinary.c``, built by pip when a C
compiler is there); where it was not built, rows go as JSON (:func:`plan_for` says
None), which is correct, only slower. :func:`encode_py` is the reference the compiled
encoder is held equal to, byte for byte, by a test; another test holds ClickHouse's
rows from either format equal to the rows from the records' JSON.

A table's plan comes from its column types (:class:`~schemas.tables.Table`), the one
place they are defined: ``Int64``, ``UInt64``, ``Float64``, ``Bool``, ``String`` (and
``LowCardinality`` of one, which ``RowBinary`` writes as the plain type), and
``Nullable``, ``Array``, ``Map`` and ``Tuple`` of those, a named tuple being a nested
record. A record type with a ``bytes`` field has no plan: JSON writes bytes as base64
text, and a table must not hold both spellings.

>>> from schemas.records import CommProgress
>>> from schemas.tables import TABLES, Table
>>> t = Table("progress", CommProgress, ("comm_hash",), "issued_seq")
>>> encode_py(Plan.of(t), [CommProgress(comm_hash=7, issued_seq=2)]).hex(" ", 8)
'0700000000000000 0200000000000000 ffffffffffffffff'
"""

from __future__ import annotations

import struct
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec

from schemas.tables import TABLES, Table

INT64, UINT64, FLOAT64, BOOL, STRING, NULLABLE, ARRAY, MAP, TUPLE = range(1, 10)
_SCALAR = {"Int64": INT64, "UInt64": UINT64, "Float64": FLOAT64, "Bool": BOOL, "String": STRING}

Code = Any  # an int (a scalar) or a tuple (NULLABLE, Code) | (ARRAY, Code) | (MAP, Code, Code)
#             | (TUPLE, StructPlan)
StructPlan = tuple[type, tuple[tuple[types.MemberDescriptorType, Code], ...]]


def _split_args(inner: str) -> list[str]:
    """``"a Int64, b Map(String, Int64)"`` -> ``["a Int64", "b Map(String, Int64)"]``."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(inner):
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(inner[start:i].strip())
            start = i + 1
    out.append(inner[start:].strip())
    return out


def _code(ch_type: str, py: Any) -> Code:
    """The code of a ClickHouse column type whose values are of Python type ``py``
    (without ``Annotated`` and ``| None``; a Struct type for a ``Tuple``)."""
    name, _, rest = ch_type.partition("(")
    args = _split_args(rest[:-1]) if rest else []
    if not args and name in _SCALAR:
        if name == "String" and py in (bytes, bytearray, memoryview):
            raise TypeError("a bytes field: JSON writes it as base64 text, so JSON only")
        return _SCALAR[name]
    if name == "LowCardinality" and len(args) == 1:
        return _code(args[0], py)
    if name == "Nullable" and len(args) == 1:
        return (NULLABLE, _code(args[0], py))
    if name == "Array" and len(args) == 1:
        return (ARRAY, _code(args[0], *_args(py, 1)))
    if name == "Map" and len(args) == 2:
        key, value = _args(py, 2)
        return (MAP, _code(args[0], key), _code(args[1], value))
    if name == "Tuple" and isinstance(py, type) and issubclass(py, msgspec.Struct):
        names = [a.split(" ", 1)[0] for a in args]
        if tuple(names) != py.__struct_fields__:
            raise TypeError(f"{ch_type} does not match {py.__name__}'s fields")
        return (TUPLE, _struct_plan(py, [a.split(" ", 1)[1] for a in args]))
    raise TypeError(f"no RowBinary code for ClickHouse type {ch_type}")


def _args(generic: Any, n: int) -> list[Any]:
    """The ``n`` type arguments of ``list[T]`` or ``dict[K, V]``, plain (None: unknown)."""
    args = typing.get_args(generic)
    return [_plain(a) for a in args] if len(args) == n else [None] * n


def _plain(t: Any) -> Any:
    """A field's Python type without ``Annotated[...]`` and ``| None``."""
    while typing.get_origin(t) is typing.Annotated:
        t = typing.get_args(t)[0]
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(t) if a is not type(None)]
        if len(inner) == 1:
            return _plain(inner[0])
    return t


def _struct_plan(record: type[msgspec.Struct], ch_types: Sequence[str]) -> StructPlan:
    hints = {f.name: _plain(f.type) for f in msgspec.structs.fields(record)}
    fields = []
    for name, ch_type in zip(record.__struct_fields__, ch_types, strict=True):
        descr = next((k.__dict__[name] for k in record.__mro__ if name in k.__dict__), None)
        if not isinstance(descr, types.MemberDescriptorType):
            raise TypeError(f"{record.__name__}.{name} is not a slot")
        try:
            fields.append((descr, _code(ch_type, hints[name])))
        except TypeError as err:
            raise TypeError(f"{record.__name__}.{name}: {err}") from None
    return record, tuple(fields)


@dataclass(frozen=True)
class Plan:
    """How one table's records are written as ``RowBinary``: its columns (the insert
    names them, so a table that gained columns later still lines up) and the codes."""

    columns: tuple[str, ...]
    struct: StructPlan

    @classmethod
    def of(cls, table: Table) -> Plan:
        """The plan of ``table`` (a TypeError where a column type has no code)."""
        names = [n for n, _ in table.columns]
        return cls(tuple(names), _struct_plan(table.record, [t for _, t in table.columns]))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, low = n >> 7, n & 0x7F
        out.append(low | 0x80 if n else low)
        if not n:
            return bytes(out)


def _encode_value(code: Code, v: Any, out: bytearray) -> None:
    if code in (INT64, UINT64):
        if not isinstance(v, int):
            raise TypeError(f"RowBinary integer column: cannot encode a {type(v).__name__}")
        out += v.to_bytes(8, "little", signed=code == INT64)
    elif code == FLOAT64:
        out += struct.pack("<d", v)
    elif code == BOOL:
        out.append(1 if v is True else 0)
    elif code == STRING:
        if not isinstance(v, str):
            raise TypeError(f"RowBinary String column: cannot encode a {type(v).__name__}")
        b = v.encode()
        out += _varint(len(b)) + b
    elif code[0] == NULLABLE:
        out.append(1 if v is None else 0)
        if v is not None:
            _encode_value(code[1], v, out)
    elif code[0] == ARRAY:
        out += _varint(len(v))
        for x in v:
            _encode_value(code[1], x, out)
    elif code[0] == MAP:
        out += _varint(len(v))
        for k, x in v.items():
            _encode_value(code[1], k, out)
            _encode_value(code[2], x, out)
    else:
        _encode_struct(code[1], v, out)


def _encode_struct(plan: StructPlan, rec: Any, out: bytearray) -> None:
    record, fields = plan
    if type(rec) is not record:
        raise TypeError(
            f"this RowBinary plan encodes {record.__name__} records, not {type(rec).__name__}"
        )
    for descr, code in fields:
        _encode_value(code, descr.__get__(rec), out)


def encode_py(plan: Plan, records: Sequence[Any]) -> bytes:
    """``records`` as ``RowBinary`` rows: the reference the compiled encoder matches."""
    out = bytearray()
    for rec in records:
        _encode_struct(plan.struct, rec, out)
    return bytes(out)


def _core() -> Any:
    try:
        from infra import _rowbinary
    except ImportError:
        return None
    return _rowbinary


_native = _core()


def encode(plan: Plan, records: Sequence[Any]) -> bytes:
    """``records`` as ``RowBinary`` rows, by the compiled encoder (see :func:`plan_for`)."""
    if _native is None:
        return encode_py(plan, records)
    return _native.encode(plan.struct, records)


@cache
def plan_for(table: str) -> Plan | None:
    """The plan the flow inserts ``table``'s records by; None where they go as JSON (the
    compiled encoder was not built, or the record has a bytes field)."""
    if _native is None:
        return None
    try:
        return Plan.of(TABLES[table])
    except TypeError:
        return None


def core_name() -> str:
    """Which encoder writes rows (what a benchmark's numbers were measured with)."""
    if _native is not None:
        return "RowBinary (infra/_rowbinary.c)"
    return "JSON (the compiled RowBinary encoder was not built: no C compiler at install)"
